"""The snapshot tools: snapshot_session, list_snapshots, restore_session, fork_session.

A snapshot keeps a session's workspace (files, permissions, symlinks, empty directories) and
so the packages `pip install --user` / `npm install` put there; not interpreter memory.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastmcp import Context, FastMCP
from pydantic import BaseModel, Field

from sandbox_runtime.app.services import Root
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.server.calls import SESSION_RE
from sandbox_runtime.server.replies import ToolFailure
from sandbox_runtime.server.tools import SessionArg, call, owner_of, session_name
from sandbox_runtime.sessions.models import RestoredFrom, SessionReset

SnapshotIdArg = Annotated[str, Field(description="A snapshot id, as list_snapshots gives it.")]


class SnapshotInfo(BaseModel):
    snapshot_id: str
    session: str = Field(description="The session it was taken of.")
    taken_at: float = Field(description="Unix time.")
    trigger: str = Field(
        description="on_demand, idle, drain (the replica stopped), retention (before its idle "
        "workspace was removed over a byte budget) or fork; or, with "
        "from_snapshot, on_demand, fork or takeover: the session's own copy of a snapshot "
        "restored into it."
    )
    from_snapshot: str | None = Field(
        None, description="The snapshot this one copies (what was restored into the session)."
    )
    files: int
    directories: int
    symlinks: int
    hard_links: int = Field(0, description="Further paths of a file kept (restored as links).")
    size_bytes: int = Field(description="The data it holds (what a restore writes).")
    stored_bytes: int = Field(
        description="Stored for the first time by this snapshot (unchanged files, and data "
        "another snapshot of yours holds, are not stored again; compressed)."
    )
    skipped: dict[str, int] = Field(
        default_factory=dict, description="Entries not kept: FIFOs, sockets, devices."
    )
    changed_while_read: int = Field(0, description="Files that changed while being read.")
    environment: dict[str, str] | None = Field(
        None,
        description="The environment its session ran on ({name, digest}): a restore "
        "puts the session back on it.",
    )


class SnapshotTaken(SnapshotInfo):
    session_reset: SessionReset | None = None


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]
    count: int


class Restored(BaseModel):
    session: str = Field(description="The session restored into.")
    restored_from: RestoredFrom
    files: int
    directories: int
    symlinks: int
    hard_links: int = 0
    size_bytes: int
    interpreters_stopped: list[str] = Field(
        description="Interpreters stopped (their next call starts afresh: state_reset)."
    )
    lost: str | None = Field(None, description="What the session had that is now gone.")
    session_reset: SessionReset | None = None


def _info(meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "session": session_name(Owner("", str(meta.get("session"))))}


def register_snapshot_tools(mcp: FastMCP, root: Root) -> None:
    async def run(owner: Owner, op: str, args: dict[str, Any], tool: str) -> dict[str, Any]:
        s = root.services
        return await call(s, lambda: s.router.run(owner, op, args, None), tool)

    @mcp.tool
    async def snapshot_session(ctx: Context, session: SessionArg = None) -> SnapshotTaken:
        """Snapshot the session's workspace now (files, permissions, symlinks, hard links,
        installed packages; not interpreter memory). Unchanged files are not stored again.
        The newest snapshot is restored by itself if the session's replica is lost."""
        owner = owner_of(ctx, session)
        result = await run(owner, "snapshot", {}, "snapshot_session")
        return SnapshotTaken.model_validate(_info(result))

    @mcp.tool
    async def list_snapshots(
        ctx: Context,
        session: Annotated[
            str | None, Field(description="Only this session's snapshots; omitted: all yours.")
        ] = None,
        limit: Annotated[int, Field(description="Most to return, newest first.")] = 50,
    ) -> SnapshotList:
        """Your snapshots (this token's), newest first."""
        owner = owner_of(ctx, session)
        s = root.services
        only = owner.session_id if session is not None else None
        metas = await call(s, lambda: s.snapshots.list(owner.principal, only), "list_snapshots")
        shown = [SnapshotInfo.model_validate(_info(m)) for m in metas[: max(0, min(limit, 1000))]]
        return SnapshotList(snapshots=shown, count=len(metas))

    @mcp.tool
    async def restore_session(
        ctx: Context, snapshot_id: SnapshotIdArg, session: SessionArg = None
    ) -> Restored:
        """Replace the session's workspace with a snapshot of yours (of this session or
        another). Its files change only once the whole snapshot is restored; its interpreters
        restart empty; refused while an execution runs in it."""
        owner = owner_of(ctx, session)
        result = await run(owner, "restore", {"snapshot_id": snapshot_id}, "restore_session")
        return Restored.model_validate({**result, "session": session_name(owner)})

    @mcp.tool
    async def fork_session(
        ctx: Context,
        to_session: Annotated[str, Field(description="The new session (it must hold no files).")],
        from_session: Annotated[
            str | None,
            Field(description="Fork this session as it is now (a snapshot is taken of it)."),
        ] = None,
        snapshot_id: Annotated[
            str | None, Field(description="Or start from this snapshot of yours.")
        ] = None,
    ) -> Restored:
        """Start a new session from another of yours: its files as they are now
        (from_session) or as a snapshot kept them (snapshot_id)."""
        if (from_session is None) == (snapshot_id is None):
            raise ToolFailure("give exactly one of from_session and snapshot_id")
        if not isinstance(to_session, str) or not SESSION_RE.fullmatch(to_session):
            raise ToolFailure("to_session must be 1-128 characters of letters, digits and ._:@-")
        target = owner_of(ctx, to_session)
        if from_session is not None:
            source = owner_of(ctx, from_session)
            if source == target:
                raise ToolFailure("from_session and to_session must differ")
            taken = await run(source, "snapshot", {"trigger": "fork"}, "fork_session")
            snapshot_id = str(taken["snapshot_id"])
        args = {"snapshot_id": snapshot_id, "fresh_only": True, "trigger": "fork"}
        result = await run(target, "restore", args, "fork_session")
        return Restored.model_validate({**result, "session": session_name(target)})
