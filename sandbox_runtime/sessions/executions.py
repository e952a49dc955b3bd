"""Executions read and controlled from any replica: this one's from memory, another's
through `elsewhere` (elsewhere.py: the shared store, and a signed call to its replica)."""

from __future__ import annotations

import heapq

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.models import ExecutionInfo, ExecutionStatus, is_execution_id, shown_id
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import ExecutionNotFoundError, InvalidRequestError
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.execution.reading import MAX_EVENTS_PER_READ, OutputPage, checked_read
from sandbox_runtime.sessions.elsewhere import Elsewhere


class ExecutionAccess:
    """Reads and control of the caller's executions, wherever they run."""

    def __init__(self, settings: Settings, manager: ExecutionManager, elsewhere: Elsewhere) -> None:
        self.settings = settings
        self.manager = manager
        self.elsewhere = elsewhere  # other replicas' executions (none when alone)

    async def find(self, owner: Owner, execution_id: str) -> Execution | ExecutionInfo:
        """The caller's execution: local, or another replica's from the store.

        An execution whose owner replica stopped heart-beating is marked lost on the way.
        Raises ExecutionNotFoundError, OwnerUnavailableError (store unreachable).
        """
        # Malformed ids are refused before any lookup, with the answer an unknown id gets: an
        # id shaped like another key ("ID:output") must not tell a real id from an unknown one.
        if not is_execution_id(execution_id):
            raise ExecutionNotFoundError(f"execution {shown_id(execution_id)} not found")
        local = self.manager.lookup(owner, execution_id)
        if local is not None:
            return local
        found = await self.elsewhere.find(owner, execution_id)
        if found is None:
            raise ExecutionNotFoundError(f"execution {shown_id(execution_id)} not found")
        return found

    async def mark_previous_incarnations_lost(self) -> int:
        """At start: mark lost the executions this replica id's earlier processes left
        running. Returns how many. Raises what the store raises (the caller retries)."""
        return await self.elsewhere.mark_previous_incarnations_lost()

    async def status(self, owner: Owner, execution_id: str) -> ExecutionInfo:
        found = await self.find(owner, execution_id)
        return found.info if isinstance(found, Execution) else found

    async def read_output(
        self,
        owner: Owner,
        execution_id: str,
        after: int = 0,
        limit: int = MAX_EVENTS_PER_READ,
        wait: float = 0,
    ) -> OutputPage:
        """Events after the cursor; with `wait`, block up to that long for new ones."""
        after, limit, wait = checked_read(after, limit, wait, self.settings.max_wait)
        found = await self.find(owner, execution_id)
        if isinstance(found, Execution):
            return await self.manager.read_output(owner, execution_id, after, limit, wait)
        return await self.elsewhere.read(owner, found, after, limit, wait)

    async def send_stdin(
        self, owner: Owner, execution_id: str, data: str, close: bool
    ) -> tuple[int, ExecutionInfo]:
        """Write to an interactive execution's stdin, forwarding to its replica if need be."""
        if not isinstance(data, str):
            raise InvalidRequestError("input_data must be a string")
        found = await self.find(owner, execution_id)
        if isinstance(found, Execution):
            return await self.manager.write_stdin(found, data, close), found.info
        reply = await self.elsewhere.control(
            found, {"op": "stdin", "data": data, "close": bool(close)}, owner
        )
        return int(reply["bytes_written"]), ExecutionInfo.model_validate(reply["info"])

    async def cancel(
        self, owner: Owner, execution_id: str, force: bool = False
    ) -> tuple[bool, ExecutionInfo]:
        """Stop an execution and its whole tree (idempotent). Returns (was it finished, info)."""
        found = await self.find(owner, execution_id)
        if isinstance(found, Execution):
            return await self.manager.cancel_local(found, force), found.info
        if found.status.finished:
            return True, found
        reply = await self.elsewhere.control(found, {"op": "cancel", "force": bool(force)}, owner)
        return bool(reply["was_finished"]), ExecutionInfo.model_validate(reply["info"])

    async def list(
        self, owner: Owner, status: str | None = None, limit: int = 10, cursor: str | None = None
    ) -> tuple[list[ExecutionInfo], bool]:
        """A page of the owner's executions (this replica's and, with a store, every
        replica's), newest first: at most `limit` (capped at 1000), those after `cursor` (a
        previous page's `page_cursor`); and whether more follow."""
        wanted: ExecutionStatus | None = None
        if status is not None:
            try:
                wanted = ExecutionStatus(status)
            except ValueError:
                names = ", ".join(s.value for s in ExecutionStatus)
                raise InvalidRequestError(f"unknown status {status!r}; one of {names}") from None
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequestError("limit must be a positive integer")
        after = _parsed_cursor(cursor)
        found = {i.execution_id: i for i in self.manager.local_infos(owner)}
        for info in await self.elsewhere.listed(owner, set(found)):
            found[info.execution_id] = info
        out = [
            i
            for i in found.values()
            if (wanted is None or i.status == wanted)
            and (after is None or (i.created_at, i.execution_id) < after)
        ]
        limit = min(limit, 1000)
        page = heapq.nlargest(limit, out, key=_order)  # (not a sort of the whole history)
        return page, len(out) > len(page)


def _order(info: ExecutionInfo) -> tuple[float, str]:
    return info.created_at, info.execution_id


def page_cursor(info: ExecutionInfo) -> str:
    """The cursor of the page that follows `info` (opaque to callers)."""
    return f"{info.created_at!r}/{info.execution_id}"


def _parsed_cursor(cursor: str | None) -> tuple[float, str] | None:
    if cursor is None or cursor == "":
        return None
    when, _, execution_id = cursor.partition("/") if isinstance(cursor, str) else ("", "", "")
    try:
        created_at = float(when)
    except ValueError:
        created_at = float("nan")
    if created_at != created_at or not is_execution_id(execution_id):  # (nan: unparsable)
        raise InvalidRequestError(
            "cursor is not one this server gave: pass a list_executions reply's next_cursor"
        )
    return created_at, execution_id
