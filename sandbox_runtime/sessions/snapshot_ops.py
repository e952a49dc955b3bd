"""The session-bound snapshot operations, run on the session's home: take a snapshot of its
workspace, and restore one into it (on demand, or as a fork's new session).

A restore on demand replaces the session's files only once the snapshot is whole: it is
written into a workspace of its own first, which then takes the session's place; a failure
leaves the session's files as they were. Before that place is taken, the session gets a
snapshot of its own holding what it is about to hold, named by its newest-snapshot pointer
(so a takeover brings back what the restore or fork put there, not what it held before). Its
interpreters are stopped (their memory is not in a snapshot: the next run_code says
`state_reset`); a running execution refuses it.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING, Any

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.snapshots.records import LOST, restored_from

if TYPE_CHECKING:
    from sandbox_runtime.sessions.operations import Parts, Progress

IN_USE_WAIT_SECONDS = 10.0


async def snapshot(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    trigger = "fork" if args.get("trigger") == "fork" else "on_demand"
    return await parts.snapshots.take(owner, trigger)


async def restore(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """Restore snapshot `snapshot_id` (the principal's) into this session. `fresh_only`: the
    session must hold nothing yet (a fork's new session)."""
    snapshots, manager = parts.snapshots, parts.manager
    workspaces = manager.workspaces
    meta = await snapshots.meta(owner.principal, args.get("snapshot_id"))  # type: ignore[arg-type]
    name = workspace_name(owner)
    if args.get("fresh_only") and await _has_files(parts, owner):
        raise InvalidRequestError("the session to fork into already has files: name a new session")
    if name in manager.workspaces_in_use():
        raise InvalidRequestError(
            "an execution is running in this session: wait for it or cancel it, then restore"
        )
    temp = f"restore-{secrets.token_hex(12)}"
    trigger = args.get("trigger") or "on_demand"
    async with snapshots.gate(owner):
        # First the whole snapshot, in a workspace of its own: a failure changes nothing.
        applied = await snapshots.restore(owner, meta, trigger, temp)
        undo = None
        try:
            # (`held`: the session's own copy of `meta`, which the prune after it keeps.)
            undo, held = await snapshots.own(owner, meta, trigger)
            stopped = parts.interpreters.forget_owner(owner, "restored")
            deadline = time.monotonic() + IN_USE_WAIT_SECONDS
            while name in workspaces.in_use() and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # (its interpreters stopping)
            if name in workspaces.in_use():
                raise InvalidRequestError("the session is in use: retry the restore shortly")
            if workspaces.exists(name):
                await workspaces.remove(name)
            if not await workspaces.adopt(temp, name, owner.principal):
                # (a mount cap): the snapshot is written again where the session's files were
                applied = await snapshots.restore(owner, held, trigger)
        except BaseException:
            if undo is not None:  # (the session holds what it held: so does its pointer)
                await asyncio.shield(undo())
            raise
        finally:
            if workspaces.exists(temp):
                await workspaces.remove(temp)
        snapshots.adopt_environment(owner, meta.get("environment"))  # (and its environment)
    return {
        "restored_from": restored_from(meta),
        "files": applied.files,
        "directories": applied.directories,
        "symlinks": applied.links,
        "hard_links": applied.hard_links,
        "size_bytes": applied.bytes,
        "interpreters_stopped": stopped,
        "lost": LOST if args.get("trigger") != "fork" else None,
    }


async def _has_files(parts: Parts, owner: Owner) -> bool:
    workspaces = parts.manager.workspaces
    name = workspace_name(owner)
    if not workspaces.exists(name):
        return False
    path, _ = await workspaces.ensure(name, owner.principal, ahead=True)
    with workspaces.hold(name):
        return await asyncio.to_thread(lambda: any(path.iterdir()))
