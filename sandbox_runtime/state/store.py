"""The state-store interface and its in-memory implementation (the embedded default)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandbox_runtime.domain.models import (
    EventType,
    ExecutionInfo,
    ExecutionStatus,
    OutputEvent,
)
from sandbox_runtime.errors import ReplicaIdInUseError

LOST_MESSAGE = "the replica that ran this execution stopped answering; its process is gone"
FENCED_MESSAGE = (
    "the replica that ran this execution lost its heartbeat and the session moved to another "
    "replica; the execution was stopped and what it wrote after that is not in the session"
)


@dataclass
class Snapshot:
    """What a mirror flush writes for one execution: metadata plus events not yet stored."""

    info: ExecutionInfo
    session_key: str
    events: list[OutputEvent] = field(default_factory=list)


@dataclass(frozen=True)
class Beat:
    """A replica's heartbeat: its id, what it publishes about itself, and for how long."""

    replica_id: str
    payload: dict[str, Any]
    ttl: int


@dataclass
class Written:
    """What a write left in the store: how many events each execution has stored afterwards
    (fewer than written: the store lost data), whether the writer's heartbeat had to be
    published again (it expired, or the store lost it), and the executions the store refused
    (`fenced`: stored as `lost`, which is final, or as another incarnation's)."""

    stored: dict[str, int]
    beat_restored: bool = False
    fenced: list[str] = field(default_factory=list)


class StateStore(Protocol):
    """Where executions live beyond the process that runs them. Errors: OSError/ConnectionError
    subclasses (redis.exceptions.RedisError for Redis) mean "unavailable now, retry later"."""

    ttl_seconds: int
    max_events: int

    async def write(self, batch: list[Snapshot], beat: Beat | None = None) -> Written:
        """Store every snapshot (metadata, appended events, session membership); refresh TTLs.

        With `beat`, first publish the writer's heartbeat if the store has none (it restarted
        empty): a running execution is never readable while its replica looks dead. What is
        returned lets a writer notice that the store lost data (a restarted Redis without
        persistence) and write it again.

        A snapshot is skipped (listed in `fenced`) when the stored execution is `lost` (final:
        readers were told so) or another incarnation's: a process that was frozen or cut off
        past its heartbeat never writes over what the cluster decided meanwhile.
        """

    async def get_execution(self, execution_id: str) -> ExecutionInfo | None:
        """An execution's metadata (refreshing its TTL), or None."""

    async def get_events(self, execution_id: str, after: int, limit: int) -> list[OutputEvent]:
        """Up to `limit` events with seq > after, in order."""

    async def session_executions(self, session_key: str) -> list[ExecutionInfo]:
        """Every execution of a session that is still stored."""

    async def heartbeat(self, replica_id: str, payload: dict[str, Any], ttl: int) -> bool:
        """Publish (and extend) a replica's heartbeat; whether it was still there before (False
        on the first beat, after an expiry, or when the store lost it). A compare-and-set on
        the payload's `incarnation`: raises ReplicaIdInUseError, writing nothing, while the
        id's live heartbeat is another incarnation's (two processes never alternate)."""

    async def drop_replica(self, replica_id: str, incarnation: str | None = None) -> None:
        """Remove a replica's heartbeat (with `incarnation`: only if it is that one's)."""

    async def replica_alive(self, replica_id: str) -> bool: ...

    async def replica_beat(self, replica_id: str) -> dict[str, Any] | None:
        """A replica's heartbeat payload (None: it has none, it is not alive)."""

    async def replica_running(self, replica_id: str) -> list[ExecutionInfo]:
        """The executions `replica_id`'s processes mirrored as not finished (yet)."""

    async def live_replicas(self) -> dict[str, dict[str, Any]]:
        """Every replica with a live heartbeat: id -> heartbeat payload."""

    async def replica_beats(self) -> dict[str, dict[str, Any]]:
        """Every replica whose heartbeat has not expired by the store's own clock (none of the
        replicas' clocks, which may be skewed): id -> heartbeat payload."""

    async def mark_lost(self, execution_id: str, now: float) -> ExecutionInfo | None:
        """Atomically mark a running execution whose process is gone (`incarnation_gone`)
        as lost.

        Returns the stored metadata afterwards (changed or not), None if unknown.
        """

    async def ping(self) -> bool: ...

    async def aclose(self) -> None: ...


def lost_event(seq: int, now: float) -> OutputEvent:
    return OutputEvent(seq=seq, type=EventType.ERROR, ts=now, message=LOST_MESSAGE)


def incarnation_gone(info: ExecutionInfo, beat: dict[str, Any] | None) -> bool:
    """Whether the process that ran `info` is gone: its replica has no heartbeat, or the
    heartbeat is another incarnation's that started after the execution was created (the
    replica restarted under the same id). A heartbeat of an earlier incarnation (a new process
    whose first beat has not replaced it yet) or without incarnations (an older version) says
    nothing against it."""
    if beat is None:
        return True
    theirs = beat.get("incarnation")
    if not info.incarnation or not theirs or theirs == info.incarnation:
        return False
    started = beat.get("started_at")
    return isinstance(started, int | float) and started >= info.created_at


def refuses(stored: ExecutionInfo | None, info: ExecutionInfo) -> bool:
    """Whether a write of `info` must not replace `stored`: it says `lost` (final), or another
    incarnation of the replica wrote it."""
    if stored is None:
        return False
    if stored.status is ExecutionStatus.LOST:
        return True
    return bool(stored.incarnation and info.incarnation and stored.incarnation != info.incarnation)


def taken_by_other(beat: dict[str, Any] | None, payload: dict[str, Any]) -> dict[str, Any] | None:
    """The live heartbeat `beat` if it is another incarnation's than `payload`'s (None: the
    id is free, or ours)."""
    if beat is None:
        return None
    theirs, mine = beat.get("incarnation"), payload.get("incarnation")
    return beat if theirs and mine and theirs != mine else None


def id_in_use(replica_id: str, beat: dict[str, Any]) -> ReplicaIdInUseError:
    started = beat.get("started_at")
    since = ""
    if isinstance(started, int | float):
        since = f", started {time.time() - started:.0f} s ago"
    where = beat.get("cluster_address") or beat.get("address") or "an unknown address"
    return ReplicaIdInUseError(
        f"replica id {replica_id!r} is in use by another live process (at {where}{since}): "
        "give every replica its own SANDBOX_REPLICA_ID"
    )


def mark_info_lost(info: ExecutionInfo, now: float) -> bool:
    if info.status.finished:
        return False
    info.status = ExecutionStatus.LOST
    info.finished_at = now
    info.error = LOST_MESSAGE
    info.reason = "lost"
    info.stdin_open = False
    return True


class MemoryStore:
    """A StateStore in this process's memory, with the same TTL and capping rules as Redis."""

    def __init__(self, ttl_seconds: int = 3600, max_events: int = 100_000) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_events = max_events
        self._infos: dict[str, tuple[ExecutionInfo, float]] = {}
        self._events: dict[str, list[OutputEvent]] = {}
        self._sessions: dict[str, set[str]] = {}
        self._replicas: dict[str, float] = {}
        self._payloads: dict[str, dict[str, Any]] = {}
        self._replica_running: dict[str, set[str]] = {}

    def _expire(self) -> None:
        now = time.monotonic()
        for execution_id, (_, deadline) in list(self._infos.items()):
            if deadline <= now:
                del self._infos[execution_id]
                self._events.pop(execution_id, None)
        for replica_id, deadline in list(self._replicas.items()):
            if deadline <= now:
                del self._replicas[replica_id]

    async def write(self, batch: list[Snapshot], beat: Beat | None = None) -> Written:
        self._expire()
        restored = beat is not None and beat.replica_id not in self._replicas
        if beat is not None and restored:
            await self.heartbeat(beat.replica_id, beat.payload, beat.ttl)
        deadline = time.monotonic() + self.ttl_seconds
        stored: dict[str, int] = {}
        fenced: list[str] = []
        for snap in batch:
            execution_id = snap.info.execution_id
            if refuses(self._infos.get(execution_id, (None, 0))[0], snap.info):
                fenced.append(execution_id)
                stored[execution_id] = len(self._events.get(execution_id, []))
                continue
            self._infos[execution_id] = (snap.info.model_copy(deep=True), deadline)
            events = self._events.setdefault(execution_id, [])
            for event in snap.events:
                if len(events) < self.max_events and event.seq == len(events) + 1:
                    events.append(event)
            self._sessions.setdefault(snap.session_key, set()).add(execution_id)
            running = self._replica_running.setdefault(snap.info.replica_id, set())
            if snap.info.status.finished:
                running.discard(execution_id)
            else:
                running.add(execution_id)
            stored[execution_id] = len(events)
        return Written(stored, restored, fenced)

    async def get_execution(self, execution_id: str) -> ExecutionInfo | None:
        self._expire()
        entry = self._infos.get(execution_id)
        if entry is None:
            return None
        self._infos[execution_id] = (entry[0], time.monotonic() + self.ttl_seconds)
        return entry[0].model_copy(deep=True)

    async def get_events(self, execution_id: str, after: int, limit: int) -> list[OutputEvent]:
        self._expire()
        return list(self._events.get(execution_id, [])[after : after + limit])

    async def session_executions(self, session_key: str) -> list[ExecutionInfo]:
        self._expire()
        ids = self._sessions.get(session_key, set())
        return [self._infos[i][0].model_copy(deep=True) for i in ids if i in self._infos]

    async def heartbeat(self, replica_id: str, payload: dict[str, Any], ttl: int) -> bool:
        other = taken_by_other(await self.replica_beat(replica_id), payload)
        if other is not None:
            raise id_in_use(replica_id, other)
        now = time.monotonic()
        existed = self._replicas.get(replica_id, now) > now
        self._replicas[replica_id] = now + ttl
        self._payloads[replica_id] = dict(payload)
        return existed

    async def live_replicas(self) -> dict[str, dict[str, Any]]:
        self._expire()
        return {r: self._payloads.get(r, {}) for r in self._replicas}

    async def replica_beats(self) -> dict[str, dict[str, Any]]:
        return await self.live_replicas()  # (one process, one clock)

    async def drop_replica(self, replica_id: str, incarnation: str | None = None) -> None:
        beat = self._payloads.get(replica_id, {})
        if incarnation is None or beat.get("incarnation") in (None, incarnation):
            self._replicas.pop(replica_id, None)

    async def replica_alive(self, replica_id: str) -> bool:
        self._expire()
        return replica_id in self._replicas

    async def replica_beat(self, replica_id: str) -> dict[str, Any] | None:
        self._expire()
        if replica_id not in self._replicas:
            return None
        return dict(self._payloads.get(replica_id, {}))

    async def replica_running(self, replica_id: str) -> list[ExecutionInfo]:
        self._expire()
        ids = self._replica_running.get(replica_id, set())
        return [self._infos[i][0].model_copy(deep=True) for i in ids if i in self._infos]

    async def mark_lost(self, execution_id: str, now: float) -> ExecutionInfo | None:
        self._expire()
        entry = self._infos.get(execution_id)
        if entry is None:
            return None
        info = entry[0]
        if info.status.finished:
            self._replica_running.get(info.replica_id, set()).discard(execution_id)
        elif incarnation_gone(info, await self.replica_beat(info.replica_id)):
            self._replica_running.get(info.replica_id, set()).discard(execution_id)
            mark_info_lost(info, now)
            events = self._events.setdefault(execution_id, [])
            events.append(lost_event(len(events) + 1, now))
            info.last_seq = len(events)
        return info.model_copy(deep=True)

    async def ping(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None
