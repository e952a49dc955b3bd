"""Mirrors executions into a StateStore in batches, off the hot path; and the heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loguru import logger

from sandbox_runtime.state.keys import HEARTBEAT_INTERVAL_SECONDS, HEARTBEAT_TTL_SECONDS
from sandbox_runtime.state.store import Beat, Snapshot, StateStore
from sandbox_runtime.supervisor import Supervisor

FLUSH_LOOP = "mirror flush"
HEARTBEAT_LOOP = "heartbeat"

if TYPE_CHECKING:
    from sandbox_runtime.domain.models import OutputEvent
    from sandbox_runtime.execution.execution import Execution

FLUSH_INTERVAL = 0.002  # pause between flushes while there is more to write (lets batches form)
MAX_EVENTS_PER_FLUSH = 2000  # per execution; the rest goes in the next flush
MAX_BYTES_PER_FLUSH = 8 * 1024 * 1024
BACKOFF_MAX = 5.0


class Mirror:
    """Writes changed executions to the store; never blocks output or tool calls.

    Memory stays bounded while the store is slow or down: the mirror keeps only which
    executions are dirty and how far each was written; the events themselves stay in the
    executions' own bounded logs until a flush succeeds.
    """

    def __init__(
        self,
        store: StateStore,
        replica_id: str,
        session_key: Callable[[Execution], str],
        heartbeat_payload: Callable[[], dict[str, Any]],
        heartbeat_ttl: int = HEARTBEAT_TTL_SECONDS,
        known: Callable[[], list[Execution]] = list,
        observe_lag: Callable[[float], None] | None = None,
        on_store_lost: Callable[[], object] | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.store = store
        self.supervisor = supervisor or Supervisor()
        self.replica_id = replica_id
        self.session_key = session_key
        self.heartbeat_payload = heartbeat_payload
        self.heartbeat_ttl = heartbeat_ttl
        self.known = known
        self.observe_lag = observe_lag
        self.on_store_lost = on_store_lost
        self.heartbeat_interval = min(HEARTBEAT_INTERVAL_SECONDS, heartbeat_ttl / 3)
        self.connected = False
        self.last_error: str | None = None
        self.lag_samples: deque[float] = deque(maxlen=10_000)
        self._dirty: dict[str, Execution] = {}
        self._version: dict[str, int] = {}
        self._written_seq: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._started = False
        self._stopping = False
        self._reached = False  # a heartbeat or write of ours reached the store once
        # Set once this process's heartbeat is in the store (it replaced an earlier process's).
        self.beaten = asyncio.Event()
        # (monotonic) when the last heartbeat that reached the store was sent: it lives at
        # least a heartbeat TTL from then, and until then no other replica takes this one's
        # sessions.
        self.last_contact: float | None = None

    # -- hooks -------------------------------------------------------------------------------

    def on_events(self, execution: Execution, events: list[OutputEvent]) -> None:
        self.mark(execution)

    def mark(self, execution: Execution) -> None:
        """Schedule `execution` (metadata and new events) for the next flush."""
        execution_id = execution.execution_id
        self._dirty[execution_id] = execution
        self._version[execution_id] = self._version.get(execution_id, 0) + 1
        self._wake.set()

    @property
    def backlog(self) -> int:
        return len(self._dirty)

    @property
    def degraded(self) -> bool:
        return not self.connected

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.supervisor.run(FLUSH_LOOP, self._flush_forever)
        self.supervisor.every(HEARTBEAT_LOOP, lambda: self.heartbeat_interval, self.beat, True)
        self._started = True

    async def stop(self, flush_timeout: float = 5.0) -> None:
        """Flush what is left (bounded), drop the heartbeat, stop the tasks."""
        self._stopping = True
        deadline = time.monotonic() + flush_timeout
        while self._dirty and time.monotonic() < deadline:
            if not await self.flush_once():
                await asyncio.sleep(0.2)
        if self._started:  # (a loop stuck in a Redis call must not hold shutdown: bounded)
            await self.supervisor.stop(HEARTBEAT_LOOP, FLUSH_LOOP)
            self._started = False
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.store.drop_replica(self.replica_id), 2)
        if self._dirty:
            logger.warning("{} executions were not mirrored before shutdown", len(self._dirty))
        with contextlib.suppress(Exception):  # a half-dead connection must not hold shutdown
            await asyncio.wait_for(self.store.aclose(), 2)

    # -- flushing ----------------------------------------------------------------------------

    def _snapshot(self, execution: Execution) -> Snapshot:
        execution_id = execution.execution_id
        written = self._written_seq.get(execution_id, 0)
        events: list[OutputEvent] = []
        if written < execution.first_seq - 1:
            logger.warning(
                "execution {}: events {}..{} left memory before Redis took them",
                execution_id,
                written + 1,
                execution.first_seq - 1,
            )
            written = execution.first_seq - 1
        size = 0
        start = written + 1 - execution.first_seq
        for i in range(max(0, start), len(execution.events)):
            event = execution.events[i]
            size += len(event.data or "")
            if events and (len(events) >= MAX_EVENTS_PER_FLUSH or size > MAX_BYTES_PER_FLUSH):
                break
            events.append(event)
        info = execution.info.model_copy()
        return Snapshot(info=info, session_key=self.session_key(execution), events=events)

    async def flush_once(self) -> bool:
        """Write every dirty execution in one batch. False when the store failed."""
        if not self._dirty:
            return True
        versions = dict(self._version)
        batch = [self._snapshot(e) for e in self._dirty.values()]
        # (Stopping: no heartbeat published again after the replica has said goodbye.)
        beat = None
        if not self._stopping:
            beat = Beat(self.replica_id, self.heartbeat_payload(), self.heartbeat_ttl)
        try:
            written = await self.store.write(batch, beat)
        except Exception as exc:  # any store failure: stay dirty, retry with backoff
            self._set_connected(False, exc)
            return False
        if self._reached and (written.beat_restored or not self.connected):
            self._store_lost_data(
                "this replica's heartbeat was gone"
                if written.beat_restored
                else "back after an outage"
            )
        self._reached = True
        self._set_connected(True)
        stored = written.stored
        now = time.time()
        for snap in batch:
            execution_id = snap.info.execution_id
            if snap.events:
                self._written_seq[execution_id] = snap.events[-1].seq
                for event in snap.events:
                    lag = now - event.ts
                    self.lag_samples.append(lag)
                    if self.observe_lag is not None:
                        self.observe_lag(lag)
            have = stored.get(execution_id, 0)
            if have < self._written_seq.get(execution_id, 0) and have < self.store.max_events:
                # The store lost events (restarted empty): resend from what it has.
                self._written_seq[execution_id] = have
                self._version[execution_id] = self._version.get(execution_id, 0) + 1
                continue
            complete = self._written_seq.get(execution_id, 0) >= snap.info.last_seq
            if complete and self._version.get(execution_id) == versions.get(execution_id):
                self._dirty.pop(execution_id, None)
                self._version.pop(execution_id, None)
        return True

    def forget(self, execution_id: str) -> None:
        """The execution left this replica's memory (evicted): stop tracking it."""
        self._dirty.pop(execution_id, None)
        self._version.pop(execution_id, None)
        self._written_seq.pop(execution_id, None)

    async def _flush_forever(self) -> None:
        backoff = 0.1
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                if await self.flush_once():
                    backoff = 0.1
                    await asyncio.sleep(FLUSH_INTERVAL)
                else:
                    await asyncio.sleep(backoff)
                    backoff = min(BACKOFF_MAX, backoff * 2)

    def _store_lost_data(self, why: str) -> None:
        """The store may have lost what we wrote: our heartbeat vanished (Redis restarted
        empty, even too quickly for a call of ours to fail), or we are back after an outage.
        Write everything again; the hooks restore what else we keep there."""
        logger.warning("redis: {}; writing again what this replica keeps there", why)
        for execution in self.known():
            self.mark(execution)
        logger.info("redis: writing back {} executions", len(self._dirty))
        self._run_loss_hooks()

    def _run_loss_hooks(self) -> None:
        if self.on_store_lost is None:
            return
        try:
            self.on_store_lost()
        except Exception:  # a hook's failure must not stop mirroring
            logger.exception("a hook for a store that lost data failed")

    def _set_connected(self, connected: bool, exc: BaseException | None = None) -> None:
        if connected and not self.connected:
            # (Back after an outage, _store_lost_data has marked everything for writing again.)
            logger.info("redis: connected; mirroring {} executions", len(self._dirty))
        elif not connected and self.connected:
            logger.warning("redis: unavailable ({}); serving from local state", exc)
        self.connected = connected
        self.last_error = None if connected else f"{type(exc).__name__}: {exc}"

    # -- heartbeat ---------------------------------------------------------------

    async def beat(self) -> bool:
        """Publish the heartbeat once; whether it reached the store. Noticing that the store
        lost it (restarted empty) or that this is the first beat after an outage runs the
        loss hooks."""
        sent = time.monotonic()
        try:
            existed = await self.store.heartbeat(
                self.replica_id, self.heartbeat_payload(), self.heartbeat_ttl
            )
        except Exception as exc:  # Redis down: keep serving, retry next beat
            self._set_connected(False, exc)
            return False
        self.last_contact = sent
        if self._reached and (not existed or not self.connected):
            self._store_lost_data(
                "back after an outage" if existed else "this replica's heartbeat was gone"
            )
        self._reached = True
        self._set_connected(True)
        self.beaten.set()
        if self._dirty:
            self._wake.set()
        return True
