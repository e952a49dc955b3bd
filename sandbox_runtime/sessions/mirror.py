"""Mirrors executions into a StateStore in batches, off the hot path; and the heartbeat.

The mirror is also where a replica learns that it was fenced: its heartbeat lapsed (it was
frozen, or cut off from the store, for longer than a heartbeat TTL) so that other replicas may
have taken its sessions and marked its executions lost. Then it holds every write until its
loss hook (`on_store_lost`: the epoch watch) has found out what was taken, stopped it
(sessions/fence.py) and called `release()`; and the store refuses, per execution, what it must
no longer write (`Written.fenced`, handed to `on_fenced`). A heartbeat refused because another
process holds the replica id (`on_evicted`) ends all writing for good, once this process
held it: before, a heartbeat of another incarnation may be a dead predecessor's, which expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loguru import logger

from sandbox_runtime.errors import ReplicaIdInUseError
from sandbox_runtime.sessions.flushes import Flushes
from sandbox_runtime.state.keys import HEARTBEAT_INTERVAL_SECONDS, HEARTBEAT_TTL_SECONDS
from sandbox_runtime.state.store import Beat, Snapshot, StateStore
from sandbox_runtime.supervisor import Supervisor

FLUSH_LOOP, HEARTBEAT_LOOP = "mirror flush", "heartbeat"
if TYPE_CHECKING:
    from sandbox_runtime.domain.models import OutputEvent
    from sandbox_runtime.execution.execution import Execution

FLUSH_INTERVAL = 0.002  # pause between flushes while there is more to write (lets batches form)
MAX_EVENTS_PER_FLUSH = 2000  # per execution; the rest goes in the next flush
MAX_BYTES_PER_FLUSH = 8 * 1024 * 1024
BACKOFF_MAX = 5.0
TAKE_ID_MARGIN_SECONDS = 1.0  # past a heartbeat TTL, for a dead process's heartbeat to expire
TAKE_ID_POLL_SECONDS = 0.2


class Mirror:
    """Writes changed executions to the store; never blocks output (a call waits, bounded,
    only in sessions/written.py). Memory stays bounded while the store is slow or down: the
    mirror keeps only which executions are dirty and how far each was written; the events
    themselves stay in the executions' own bounded logs until a flush succeeds."""

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
        on_fenced: Callable[[list[str]], object] | None = None,
        on_evicted: Callable[[str], object] | None = None,
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
        self.on_fenced = on_fenced
        self.on_evicted = on_evicted
        # Why writes are held (None: they are not): this replica's heartbeat lapsed, and what
        # was taken from it meanwhile is not known yet (see release()); or its id is another
        # process's now (`evicted`: for good).
        self.held: str | None = None
        self.evicted: str | None = None
        self._released = asyncio.Event()
        self._released.set()
        # Executions the store refused (lost, or another incarnation's): never written again.
        self._fenced: set[str] = set()
        self.heartbeat_interval = min(HEARTBEAT_INTERVAL_SECONDS, heartbeat_ttl / 3)
        self.connected = False
        self.reconnected_at: float | None = None  # (monotonic) back after an outage
        self._was_connected = False
        self.last_error: str | None = None
        self.lag_samples: deque[float] = deque(maxlen=10_000)
        self._dirty: dict[str, Execution] = {}
        self._version: dict[str, int] = {}
        self._written_seq: dict[str, int] = {}
        self.flushes = Flushes()  # (counted and awaited by sessions/written.py)
        self._wake = asyncio.Event()
        self._started = False
        self._stopping = False
        self._reached = False  # a heartbeat or write of ours reached the store once
        # A heartbeat of ours was in the store once: this process held the id (a heartbeat
        # refused from then on means another process took it). While it was not yet: the
        # other incarnation's heartbeat first seen, and until when it may live (`_contested`).
        self._held_id = False
        self._contest_seen: dict[str, Any] | None = None
        self._contest_until = 0.0
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
        if execution_id in self._fenced:
            return
        self._dirty[execution_id] = execution
        self._version[execution_id] = self._version.get(execution_id, 0) + 1
        self._wake.set()

    def behind(self, execution_id: str) -> bool:
        return execution_id in self._dirty

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
        while self._dirty and self.evicted is None and time.monotonic() < deadline:
            if not await self.flush_once():
                await asyncio.sleep(0.2)
        if self._started:  # (a loop stuck in a Redis call must not hold shutdown: bounded)
            await self.supervisor.stop(HEARTBEAT_LOOP, FLUSH_LOOP)
            self._started = False
        with contextlib.suppress(Exception):
            incarnation = self.heartbeat_payload().get("incarnation")
            await asyncio.wait_for(self.store.drop_replica(self.replica_id, incarnation), 2)
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
        """Write every dirty execution in one batch. False when the store failed, or writes
        are held (see `lapsed`)."""
        if not self._dirty:
            return True
        if self.lapsed():
            return False
        versions = dict(self._version)
        batch = [self._snapshot(e) for e in self._dirty.values()]
        # (Stopping: no heartbeat published again after the replica has said goodbye.)
        beat = None
        if not self._stopping:
            beat = Beat(self.replica_id, self.heartbeat_payload(), self.heartbeat_ttl)
        try:
            written = await self.flushes.around(self.store.write(batch, beat))
        except Exception as exc:  # any store failure: stay dirty, retry with backoff
            self._set_connected(False, exc)
            return False
        if written.fenced:
            self._refused(written.fenced)
        if self._held_id and written.beat_restored:
            self._hold("this replica's heartbeat was gone")
        elif self._reached and not self.connected:
            self._store_lost_data("back after an outage")
        self._reached = True
        self._held_id |= written.beat_restored  # (ours now, where none was)
        self._set_connected(True)
        stored = written.stored
        now = time.time()
        for snap in batch:
            execution_id = snap.info.execution_id
            if execution_id in self._fenced:
                continue
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
        self._fenced.discard(execution_id)

    # -- fencing -----------------------------------------------------------------------------

    def lapsed(self) -> bool:
        """Whether writes must wait: they are held, or this replica's last heartbeat that
        reached the store has expired by now (a freeze or a partition: other replicas may
        have taken its sessions; the next beat finds out)."""
        if self.held is not None:
            return True
        contact = self.last_contact
        return contact is not None and time.monotonic() - contact >= self.heartbeat_ttl

    def _hold(self, why: str) -> None:
        """The heartbeat was gone: hold writes until the loss hook has run and release()d
        them (it learns what was taken meanwhile, or that the store lost its data)."""
        if self.held is None:
            logger.warning("redis: {}; holding writes until what it kept is checked", why)
        self.held = why
        self._released.clear()
        self._run_loss_hooks()

    def release(self) -> None:
        """What was taken while the heartbeat lapsed is known and stopped: write again what
        this replica keeps (the store refuses what it must not take)."""
        if self.held is None or self.evicted is not None:
            return
        self.held = None
        self._released.set()
        for execution in self.known():
            self.mark(execution)
        logger.info("redis: writing again {} executions after the check", len(self._dirty))

    def _refused(self, execution_ids: list[str]) -> None:
        """The store refused these executions (lost, or another incarnation's): never
        written again; the hook stops them."""
        for execution_id in execution_ids:
            self._dirty.pop(execution_id, None)
            self._version.pop(execution_id, None)
            self._fenced.add(execution_id)
        logger.warning(
            "redis: {} executions are lost or another process's there; not written again: {}",
            len(execution_ids),
            ", ".join(execution_ids[:10]),
        )
        if self.on_fenced is not None:
            try:
                self.on_fenced(execution_ids)
            except Exception:  # a hook's failure must not stop mirroring
                logger.exception("a hook for refused executions failed")

    def _evict(self, exc: ReplicaIdInUseError) -> None:
        """Another process holds this replica id now: this one writes nothing ever again."""
        if self.evicted is not None:
            return
        self.evicted = self.held = str(exc)
        self._released.clear()
        logger.error("fenced for good: {}", exc)
        if self.on_evicted is not None:
            try:
                self.on_evicted(str(exc))
            except Exception:
                logger.exception("the hook for an evicted replica failed")

    async def _flush_forever(self) -> None:
        backoff = 0.1
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                if self.lapsed():  # (the heartbeat loop finds out; release() wakes this)
                    if self.held is None:
                        await asyncio.sleep(0.05)
                    else:
                        await self._released.wait()
                    continue
                if await self.flush_once():
                    backoff = 0.1
                    await self.flushes.pause(FLUSH_INTERVAL)
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
            if self._was_connected:  # (not the first contact: back after an outage)
                self.reconnected_at = time.monotonic()
            self._was_connected = True
        elif not connected and self.connected:
            logger.warning("redis: unavailable ({}); serving from local state", exc)
        self.connected = connected
        self.last_error = None if connected else f"{type(exc).__name__}: {exc}"

    def settled(self) -> bool:
        """Whether a missing heartbeat means a dead replica: not for a heartbeat TTL after this
        replica is back in contact from an outage (a store back with its data has let every
        replica's heartbeat expire, and each beats again within a TTL)."""
        back = self.reconnected_at
        return self.connected and (back is None or time.monotonic() - back >= self.heartbeat_ttl)

    # -- heartbeat ---------------------------------------------------------------

    async def take_id(self, margin: float = TAKE_ID_MARGIN_SECONDS) -> None:
        """Publish this process's first heartbeat: a compare-and-set on its incarnation. While
        the id's heartbeat is another incarnation's, wait (see `_contested`). (The store down:
        the heartbeat loop beats later, and waits the same way before it refuses.)

        Raises ReplicaIdInUseError.
        """
        while True:
            sent = time.monotonic()
            try:
                await self.store.heartbeat(
                    self.replica_id, self.heartbeat_payload(), self.heartbeat_ttl
                )
            except ReplicaIdInUseError as exc:
                if await self._contested(exc, margin):
                    raise exc from None
                await asyncio.sleep(TAKE_ID_POLL_SECONDS)
                continue
            except Exception as exc:  # the store is down: serve, beat later
                self._set_connected(False, exc)
                return
            self._took(sent)
            return

    async def _contested(self, exc: ReplicaIdInUseError, margin: float) -> bool:
        """The id's heartbeat is another incarnation's and this process never held the id:
        whether to refuse it now. A process that died leaves a heartbeat that expires within
        a heartbeat TTL (then this one takes the id); one renewed while this one waits, or
        still there after a TTL, is a live process with the same id."""
        try:
            theirs = await self.store.replica_beat(self.replica_id)
        except Exception:  # (the store failed between the two: try again)
            theirs = self._contest_seen
        if self._contest_seen is None:
            logger.warning(
                "replica id {} has a live heartbeat of another process; waiting up to {} s "
                "for it to expire (it died) or be renewed (refused)",
                self.replica_id,
                self.heartbeat_ttl,
            )
            self._contest_seen = theirs or {}
            self._contest_until = time.monotonic() + self.heartbeat_ttl + margin
            self._set_connected(False, exc)
            return False
        renewed = theirs is not None and theirs != self._contest_seen
        return renewed or time.monotonic() >= self._contest_until

    def _took(self, sent: float) -> None:
        """A heartbeat of this process's reached the store (holding the id from now on)."""
        self.last_contact = sent
        self._held_id = self._reached = True
        self._contest_seen = None
        self._set_connected(True)
        self.beaten.set()

    async def beat(self) -> bool:
        """Publish the heartbeat once; whether it reached the store. Noticing that the store
        lost it (restarted empty) or that this is the first beat after an outage runs the
        loss hooks."""
        if self.evicted is not None:
            return False
        sent = time.monotonic()
        try:
            existed = await self.store.heartbeat(
                self.replica_id, self.heartbeat_payload(), self.heartbeat_ttl
            )
        except ReplicaIdInUseError as exc:
            # Held once: another process took this id meanwhile. Never held (the store failed
            # take_id): maybe a dead predecessor's heartbeat, expiring within a TTL.
            if self._held_id or await self._contested(exc, TAKE_ID_MARGIN_SECONDS):
                self._evict(exc)
            return False
        except Exception as exc:  # Redis down: keep serving, retry next beat
            self._set_connected(False, exc)
            return False
        if self._held_id and not existed:
            self._hold("this replica's heartbeat was gone")
        elif self._reached and not self.connected:
            self._store_lost_data("back after an outage")
        self._took(sent)
        if self._dirty:
            self._wake.set()
        return True
