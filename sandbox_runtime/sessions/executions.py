"""Executions read and controlled from any replica: this one's from memory, another's from
the shared store (marked lost on the way when that replica stopped heart-beating), stdin and
cancel for another's sent to it as a signed call over the cluster transport (control.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.models import (
    ExecutionInfo,
    ExecutionStatus,
    is_execution_id,
    shown_id,
)
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import (
    ExecutionNotFoundError,
    InvalidRequestError,
    OwnerUnavailableError,
    SandboxRuntimeError,
)
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.execution.reading import MAX_BYTES_PER_READ, MAX_EVENTS_PER_READ, OutputPage
from sandbox_runtime.sessions.control import ControlChannel
from sandbox_runtime.state.keys import session_key
from sandbox_runtime.state.store import StateStore, incarnation_gone

REMOTE_POLL_SECONDS = 0.05  # long-poll interval for executions owned by another replica


class ExecutionAccess:
    """Reads and control of the caller's executions, wherever they run."""

    def __init__(
        self,
        settings: Settings,
        manager: ExecutionManager,
        control: ControlChannel | None,
        store: StateStore | None = None,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.store = store  # the executions' mirror (None: one replica, no Redis)
        self.control = control
        self.metrics = manager.metrics
        self.replica_id = manager.replica_id

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
        if self.store is None:
            raise ExecutionNotFoundError(f"execution {shown_id(execution_id)} not found")
        try:
            info = await self.store.get_execution(execution_id)
            if info is None or (info.principal, info.session_id) != (
                owner.principal,
                owner.session_id,
            ):
                raise ExecutionNotFoundError(f"execution {shown_id(execution_id)} not found")
            return await self._check_alive(info)
        except SandboxRuntimeError:
            raise
        except Exception as exc:  # the store failed: say so instead of "not found"
            raise OwnerUnavailableError(
                f"execution {shown_id(execution_id)} is not on this replica and the shared "
                f"store is unavailable ({type(exc).__name__}); retry shortly"
            ) from exc

    async def _check_alive(self, info: ExecutionInfo) -> ExecutionInfo:
        """`info`, marked lost first if the process running it is gone: its replica stopped
        heart-beating, or restarted (this one included) under the same id."""
        assert self.store is not None
        if info.status.finished:
            return info
        if info.replica_id == self.replica_id:
            if info.incarnation in (None, self.manager.incarnation):
                return info  # (ours: not in memory only when it has just ended)
        elif not incarnation_gone(info, await self.store.replica_beat(info.replica_id)):
            return info
        return await self._mark_lost(info)

    async def _mark_lost(self, info: ExecutionInfo) -> ExecutionInfo:
        marked = await self.store.mark_lost(info.execution_id, time.time()) if self.store else None
        info = marked or info
        if info.status is ExecutionStatus.LOST:
            self.metrics.lost_detected.inc()
            logger.warning(
                "execution {} of replica {} (incarnation {}) marked lost",
                info.execution_id,
                info.replica_id,
                info.incarnation,
            )
        return info

    async def mark_previous_incarnations_lost(self) -> int:
        """At start: mark lost the executions this replica id's earlier processes left
        running (killed, restarted at once under the same id). Returns how many.

        Raises what the store raises (the caller retries).
        """
        if self.store is None:
            return 0
        lost = 0
        for info in await self.store.replica_running(self.replica_id):
            if info.incarnation == self.manager.incarnation or info.status.finished:
                continue
            if (await self._mark_lost(info)).status is ExecutionStatus.LOST:
                lost += 1
        return lost

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
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidRequestError("the cursor (after / last_event_id) must be an integer >= 0")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequestError("limit must be a positive integer")
        found = await self.find(owner, execution_id)
        if isinstance(found, Execution):
            return await self.manager.read_output(owner, execution_id, after, limit, wait)
        limit = min(limit, MAX_EVENTS_PER_READ)
        wait = min(max(0.0, float(wait or 0)), self.settings.max_wait)
        return await self._read_remote(owner, found, after, limit, wait)

    async def _read_remote(
        self, owner: Owner, info: ExecutionInfo, after: int, limit: int, wait: float
    ) -> OutputPage:
        assert self.store is not None
        deadline = time.monotonic() + wait
        while True:
            try:
                events = await self.store.get_events(info.execution_id, after, limit + 1)
            except Exception as exc:  # store failure: not the caller's fault
                raise OwnerUnavailableError(
                    f"the shared store is unavailable ({type(exc).__name__}); retry shortly"
                ) from exc
            if events or info.status.finished or time.monotonic() >= deadline:
                break
            await asyncio.sleep(REMOTE_POLL_SECONDS)
            refreshed = await self.find(owner, info.execution_id)
            info = refreshed.info if isinstance(refreshed, Execution) else refreshed
        has_more = len(events) > limit
        events = events[:limit]
        size = 0
        for i, event in enumerate(events):
            size += event.wire_size()
            if i and size > MAX_BYTES_PER_READ:
                events, has_more = events[:i], True
                break
        next_cursor = events[-1].seq if events else after
        return OutputPage(
            info=info, events=events, next_cursor=next_cursor, has_more=has_more, first_available=1
        )

    async def send_stdin(
        self, owner: Owner, execution_id: str, data: str, close: bool
    ) -> tuple[int, ExecutionInfo]:
        """Write to an interactive execution's stdin, forwarding to its replica if need be."""
        if not isinstance(data, str):
            raise InvalidRequestError("input_data must be a string")
        found = await self.find(owner, execution_id)
        if isinstance(found, Execution):
            return await self.manager.write_stdin(found, data, close), found.info
        assert self.control is not None
        reply = await self.control.send(
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
        assert self.control is not None
        reply = await self.control.send(found, {"op": "cancel", "force": bool(force)}, owner)
        return bool(reply["was_finished"]), ExecutionInfo.model_validate(reply["info"])

    async def list(
        self, owner: Owner, status: str | None = None, limit: int = 100
    ) -> list[ExecutionInfo]:
        """The owner's executions (this replica's and, with a store, every replica's)."""
        wanted: ExecutionStatus | None = None
        if status is not None:
            try:
                wanted = ExecutionStatus(status)
            except ValueError:
                names = ", ".join(s.value for s in ExecutionStatus)
                raise InvalidRequestError(f"unknown status {status!r}; one of {names}") from None
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequestError("limit must be a positive integer")
        found = {i.execution_id: i for i in self.manager.local_infos(owner)}
        if self.store is not None:
            try:
                remote = await self.store.session_executions(
                    session_key(owner.principal, owner.session_id)
                )
            except Exception as exc:  # store down: local executions are still an answer
                logger.warning("list_executions without the shared store: {}", exc)
                remote = []
            for info in remote:
                if info.execution_id in found:
                    continue
                if (info.principal, info.session_id) != (owner.principal, owner.session_id):
                    continue
                with contextlib.suppress(Exception):
                    info = await self._check_alive(info)
                found[info.execution_id] = info
        out = [i for i in found.values() if wanted is None or i.status == wanted]
        out.sort(key=lambda i: i.created_at, reverse=True)
        return out[: min(limit, 1000)]
