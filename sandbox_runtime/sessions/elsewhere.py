"""Executions other replicas run, as this replica sees them: none when it is alone
(`NowhereElse`), or those in the shared store (`InTheStore`): read from it (marked lost on the
way when their replica stopped heart-beating), with stdin and cancel sent to their replica as
a signed call over the cluster transport (control.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from loguru import logger

from sandbox_runtime.domain.models import ExecutionInfo, ExecutionStatus, OutputEvent, shown_id
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import (
    ExecutionNotFoundError,
    OwnerUnavailableError,
    SandboxRuntimeError,
)
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.execution.reading import MAX_BYTES_PER_READ, OutputPage
from sandbox_runtime.sessions.control import ControlChannel
from sandbox_runtime.state.keys import session_key
from sandbox_runtime.state.store import StateStore, incarnation_gone

REMOTE_POLL_SECONDS = 0.05  # long-poll interval, when the replica running it cannot be asked
READ_SLACK_SECONDS = 5.0  # past a forwarded read's own wait


class NowhereElse:
    """One replica alone: every execution is this one's."""

    control_channel: ControlChannel | None = None  # (serves other replicas' control calls)

    async def find(self, owner: Owner, execution_id: str) -> ExecutionInfo | None:
        return None

    async def listed(self, owner: Owner, known: set[str]) -> list[ExecutionInfo]:
        return []

    async def mark_previous_incarnations_lost(self) -> int:
        return 0

    async def read(
        self, owner: Owner, info: ExecutionInfo, after: int, limit: int, wait: float
    ) -> OutputPage:
        raise ExecutionNotFoundError(f"execution {shown_id(info.execution_id)} not found")

    async def control(self, info: ExecutionInfo, request: dict[str, Any], owner: Owner) -> dict:
        raise ExecutionNotFoundError(f"execution {shown_id(info.execution_id)} not found")


class InTheStore(NowhereElse):
    """The executions of every replica sharing the store."""

    def __init__(
        self,
        store: StateStore,
        manager: ExecutionManager,
        control: ControlChannel,
        settled: Callable[[], bool] = lambda: True,
    ) -> None:
        self.store = store
        # Whether a missing heartbeat means a dead replica yet (sessions/mirror.py settled)
        self.settled = settled
        self.manager = manager
        self.control_channel = self.sender = control
        self.metrics = manager.metrics
        self.replica_id = manager.replica_id
        self.max_wait = manager.settings.max_wait

    async def find(self, owner: Owner, execution_id: str) -> ExecutionInfo | None:
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
        if info.status.finished:
            return info
        if info.replica_id == self.replica_id:
            if info.incarnation in (None, self.manager.incarnation):
                return info  # (ours: not in memory only when it has just ended)
        elif not incarnation_gone(info, await self.store.replica_beat(info.replica_id)):
            return info
        elif not self.settled():
            return info  # (the store is just back: its owner may not have beaten again yet)
        return await self._mark_lost(info)

    async def _mark_lost(self, info: ExecutionInfo) -> ExecutionInfo:
        marked = await self.store.mark_lost(info.execution_id, time.time())
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
        lost = 0
        for info in await self.store.replica_running(self.replica_id):
            if info.incarnation == self.manager.incarnation or info.status.finished:
                continue
            if (await self._mark_lost(info)).status is ExecutionStatus.LOST:
                lost += 1
        return lost

    async def read(
        self, owner: Owner, info: ExecutionInfo, after: int, limit: int, wait: float
    ) -> OutputPage:
        """Events of another replica's execution after the cursor: with `wait`, from that
        replica (it answers as soon as there is news, from memory: fresher than the store),
        else, or when it cannot be asked, from the store (polled for up to `wait`)."""
        if wait > 0 and not info.status.finished and self.sender.channel is not None:
            request = {"op": "read", "after": after, "limit": limit, "wait": wait}
            with contextlib.suppress(SandboxRuntimeError):
                reply = await self.sender.send(info, request, owner, wait + READ_SLACK_SECONDS)
                return OutputPage(
                    info=ExecutionInfo.model_validate(reply["info"]),
                    events=[OutputEvent.model_validate(e) for e in reply["events"]],
                    next_cursor=int(reply["next_cursor"]),
                    has_more=bool(reply["has_more"]),
                    first_available=int(reply["first_available"]),
                )
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
            local = self.manager.lookup(owner, info.execution_id)
            refreshed = (
                local.info if local is not None else await self.find(owner, info.execution_id)
            )
            info = refreshed or info
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

    async def control(self, info: ExecutionInfo, request: dict[str, Any], owner: Owner) -> dict:
        return await self.sender.send(info, request, owner)

    async def listed(self, owner: Owner, known: set[str]) -> list[ExecutionInfo]:
        """The owner's executions other replicas hold (store down: none, logged)."""
        try:
            remote = await self.store.session_executions(
                session_key(owner.principal, owner.session_id)
            )
        except Exception as exc:  # store down: local executions are still an answer
            logger.warning("list_executions without the shared store: {}", exc)
            return []
        out = []
        for info in remote:
            if info.execution_id in known:
                continue
            if (info.principal, info.session_id) != (owner.principal, owner.session_id):
                continue
            with contextlib.suppress(Exception):
                info = await self._check_alive(info)
            out.append(info)
        return out


Elsewhere = NowhereElse  # (InTheStore is one)
