"""Session-bound operations on a session as a whole and on its files' names (the E2B edge's
sandboxes and filesystem service): ending a session, stat, make_dir, move."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from sandbox_runtime.domain.owner import Owner, workspace_name

if TYPE_CHECKING:
    from sandbox_runtime.sessions.operations import Parts, Progress

END_WAIT_SECONDS = 10.0


async def end_session(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """Cancel the session's running executions, stop its interpreters and remove its
    workspace: what is left of it is its executions' records (and its snapshots)."""
    manager = parts.manager
    cancelled = 0
    for execution in manager.known():
        if execution.owner == owner and not execution.info.status.finished:
            await manager.cancel_local(execution, True)
            cancelled += 1
    stopped = parts.interpreters.forget_owner(owner, "ended")
    workspaces = manager.workspaces
    name = workspace_name(owner)
    deadline = time.monotonic() + END_WAIT_SECONDS
    while name in workspaces.in_use() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    removed = False
    if workspaces.exists(name) and name not in workspaces.in_use():
        await workspaces.remove(name)
        removed = True
    return {"cancelled": cancelled, "interpreters_stopped": stopped, "workspace_removed": removed}
