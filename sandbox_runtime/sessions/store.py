"""Where session homes and per-principal counts live: the interface and its in-memory form.

The in-memory store serves one replica without Redis (it is its every session's home); the
Redis store (sessions/redis_store.py) is shared by every replica of a deployment.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from sandbox_runtime.sessions.models import SessionRecord

ClaimOutcome = Literal["claimed", "exists", "moved", "session_limit"]


@dataclass(frozen=True)
class Lookup:
    """A session's record, and the heartbeat of its home (None: the home is not alive).

    `touched`: this replica is the session's active home and the call refreshed the record.
    """

    record: SessionRecord | None
    home_heartbeat: dict[str, Any] | None = None
    touched: bool = False


@dataclass(frozen=True)
class StoreEpoch:
    """The store's current epoch: a new one begins whenever the store has lost its data.

    `restarted`: it began after an earlier one (a replica that knew an earlier epoch saw it),
    so sessions may have lost their records; `age`: seconds since it began (store's clock).
    """

    epoch_id: str
    age: float
    restarted: bool


class SessionStore(Protocol):
    """Session records and per-principal counts, atomically updated. Errors: OSError /
    ConnectionError subclasses (redis.exceptions.RedisError for Redis): unavailable now."""

    async def lookup(
        self, key: str, replica_id: str, now: float, ttl: int, take: bool = False
    ) -> Lookup:
        """The session's record and its home's heartbeat. When `replica_id` is the active
        home, refresh last use and the record's life (`ttl` seconds) in the same step, and
        with `take` (an operation of the session's, not a background check) take the reset
        its record says the next call is owed."""

    async def claim(
        self,
        record: SessionRecord,
        expected_generation: int | None,
        max_sessions: int,
        ttl: int,
        previous_home: str | None = None,
        epoch: str | None = None,
        previous_dead: bool = False,
    ) -> ClaimOutcome:
        """Store `record` as the session's record.

        `expected_generation` None: only if the session has no record (a new session), and
        only while its principal has fewer than `max_sessions` live sessions. Otherwise only
        if the stored record still has that generation (re-homing; `previous_home` forgets
        the session). With `epoch`, only while the store is in that epoch ("moved"
        otherwise: it lost its data since). With `previous_dead`, only while `previous_home`
        has no heartbeat ("moved": it came back between the lookup and the claim).
        """

    async def owe_reset(self, key: str, home: str, reason: str, previous_home: str) -> bool:
        """Note on a session's record, if it is a first generation homed on `home` and not
        published again (started afresh there, not re-homed from a record nor restored), that
        its next call must say it started afresh (`reason`, `previous_home`). Whether it was
        noted."""

    async def epoch(self, known: str | None) -> StoreEpoch:
        """The store's epoch, begun now if it has none. `known`: the epoch the caller last
        saw (None: none); one that differs marks the current epoch `restarted`."""

    async def release_replica(self, replica_id: str, reason: str, now: float) -> int:
        """Mark every session homed on `replica_id` released (it is stopping): the next
        operation re-homes it at once. Returns how many were released."""

    async def reserve_running(
        self, principal: str, execution_id: str, limit: int, lease: float, now: float
    ) -> bool:
        """Count a running execution against its principal, if under `limit`."""

    async def renew_running(self, running: list[tuple[str, str]], lease: float, now: float) -> None:
        """Extend (or restore) the leases of these running (principal, execution_id) pairs."""

    async def release_running(self, principal: str, execution_id: str) -> None: ...


class MemorySessionStore:
    """A SessionStore in this process's memory, with the same rules as the Redis one."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[SessionRecord, float]] = {}
        self._principal_sessions: dict[str, dict[str, float]] = {}
        self._running: dict[str, dict[str, float]] = {}
        self.heartbeats: dict[str, dict[str, Any]] = {}  # replica id -> payload (tests)
        self._epoch = (uuid.uuid4().hex, time.time())  # (this store never loses its data)

    def _live(self, key: str) -> SessionRecord | None:
        entry = self._records.get(key)
        if entry is None:
            return None
        if entry[1] <= time.time():
            del self._records[key]
            return None
        return entry[0]

    async def lookup(
        self, key: str, replica_id: str, now: float, ttl: int, take: bool = False
    ) -> Lookup:
        record = self._live(key)
        if record is None:
            return Lookup(None)
        if record.home == replica_id and record.state == "active":
            record.last_used_at = now
            found = record.model_copy()
            if take:
                record.reset_reason = record.reset_from = None  # (taken)
            self._records[key] = (record, now + ttl)
            self._principal_sessions.setdefault(record.principal, {})[key] = now + ttl
            return Lookup(found, None, touched=True)
        return Lookup(record.model_copy(), self.heartbeats.get(record.home))

    async def claim(
        self,
        record: SessionRecord,
        expected_generation: int | None,
        max_sessions: int,
        ttl: int,
        previous_home: str | None = None,
        epoch: str | None = None,
        previous_dead: bool = False,
    ) -> ClaimOutcome:
        if epoch is not None and epoch != self._epoch[0]:
            return "moved"
        if previous_dead and previous_home in self.heartbeats:
            return "moved"
        current = self._live(record.key)
        sessions = self._principal_sessions.setdefault(record.principal, {})
        if expected_generation is None:
            if current is not None:
                return "exists"
            now = time.time()
            for key, expires in list(sessions.items()):
                if expires <= now:
                    del sessions[key]
            if len(sessions) >= max_sessions:
                return "session_limit"
        elif current is None or current.generation != expected_generation:
            return "moved"
        self._records[record.key] = (record.model_copy(), record.last_used_at + ttl)
        sessions[record.key] = record.last_used_at + ttl
        return "claimed"

    async def owe_reset(self, key: str, home: str, reason: str, previous_home: str) -> bool:
        record = self._live(key)
        if record is None or record.home != home or record.generation != 1:
            return False
        if record.published_again_at is not None:
            return False
        if record.reset_reason is None:
            record.reset_reason, record.reset_from = reason, previous_home
        return True

    async def epoch(self, known: str | None) -> StoreEpoch:
        epoch_id, created_at = self._epoch
        return StoreEpoch(epoch_id, time.time() - created_at, restarted=False)

    async def release_replica(self, replica_id: str, reason: str, now: float) -> int:
        released = 0
        for key in list(self._records):
            record = self._live(key)
            if record is not None and record.home == replica_id and record.state == "active":
                record.state = "released"
                record.released_reason = reason
                released += 1
        return released

    async def reserve_running(
        self, principal: str, execution_id: str, limit: int, lease: float, now: float
    ) -> bool:
        running = self._running.setdefault(principal, {})
        for other, expires in list(running.items()):
            if expires <= now:
                del running[other]
        if execution_id not in running and len(running) >= limit:
            return False
        running[execution_id] = now + lease
        return True

    async def renew_running(self, running: list[tuple[str, str]], lease: float, now: float) -> None:
        for principal, execution_id in running:
            self._running.setdefault(principal, {})[execution_id] = now + lease

    async def release_running(self, principal: str, execution_id: str) -> None:
        self._running.get(principal, {}).pop(execution_id, None)
