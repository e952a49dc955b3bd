"""Session-bound operations on a session as a whole and on its files' names (the E2B edge's
sandboxes and filesystem service): ending a session, stat, make_dir, move."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import InvalidRequestError

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
    if manager.images is not None:  # (a session of this name again chooses its environment)
        await asyncio.to_thread(manager.images.forget, owner)
    return {"cancelled": cancelled, "interpreters_stopped": stopped, "workspace_removed": removed}


def _path(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{key} must be a string")
    return value


async def _files_of(parts: Parts, owner: Owner) -> tuple[str, Any]:
    workspaces = parts.manager.workspaces
    name = workspace_name(owner)
    await workspaces.ensure(name, owner.principal)
    return name, workspaces


async def stat_file(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """What a workspace path is (a link reported, not followed)."""
    name, workspaces = await _files_of(parts, owner)
    with workspaces.hold(name):
        entry = await asyncio.to_thread(workspaces.files(name).stat, _path(args, "path"))
    return {"entry": entry.wire()}


async def make_dir(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """Make a directory and its parents; `created` false: it was there already."""
    name, workspaces = await _files_of(parts, owner)
    path = _path(args, "path")
    with workspaces.hold(name):
        files = workspaces.files(name)
        created = await asyncio.to_thread(files.make_dir, path)
        entry = await asyncio.to_thread(files.stat, path)
    return {"created": created, "entry": entry.wire()}


async def move_file(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """Rename a file or directory within the workspace."""
    name, workspaces = await _files_of(parts, owner)
    source, destination = _path(args, "source"), _path(args, "destination")
    with workspaces.hold(name):
        entry = await asyncio.to_thread(workspaces.files(name).move, source, destination)
    return {"entry": entry.wire()}
