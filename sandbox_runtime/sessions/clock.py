"""Clock skew between replicas, read off the times in their heartbeats, and between this
replica and the shared store (Redis TIME, the clock placement requests are timed on): /health
reports both; /ready is not ready while this replica's clock is off the store's by more than
MAX_STORE_SKEW_SECONDS (then two replicas could differ by more than signed calls allow)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from loguru import logger

from sandbox_runtime.sessions.signing import MAX_SKEW_SECONDS
from sandbox_runtime.state.store import StateStore
from sandbox_runtime.supervisor import Supervisor

SAMPLES = 6  # readings kept per replica (three heartbeat intervals)
# Each replica within this of the store's clock: any two within twice it, well inside what
# signed calls allow (the rest is the calls' own time and the measurement's error).
MAX_STORE_SKEW_SECONDS = MAX_SKEW_SECONDS / 3

StoreTime = Callable[[], Awaitable[float]]  # the store's clock, in seconds


class ClockWatch:
    """Samples the other replicas' heartbeats; `skews` is each one's clock minus this one's.

    A heartbeat is read up to one interval after it was written, so a reading falls short of
    the true skew by up to that much; the largest recent reading is the closest.
    """

    def __init__(
        self,
        store: StateStore,
        replica_id: str,
        interval: float,
        supervisor: Supervisor,
    ) -> None:
        self.store = store
        # The store's own clock, when it has one (Redis TIME; the in-memory store has none)
        redis = getattr(store, "redis", None)
        self.store_time: StoreTime | None = (
            (lambda: redis_time(redis)) if redis is not None else None
        )
        # (round trip, this clock minus the store's) of recent readings of the store's clock
        self._store_samples: deque[tuple[float, float]] = deque(maxlen=SAMPLES)
        self.supervisor = supervisor
        self.replica_id = replica_id
        self.interval = interval
        self._samples: dict[str, deque[float]] = {}
        self._reported: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def skews(self) -> dict[str, float]:
        """replica id -> seconds its clock is ahead of this replica's (negative: behind)."""
        return {rid: round(max(q), 1) for rid, q in sorted(self._samples.items())}

    @property
    def store_skew(self) -> float | None:
        """Seconds this replica's clock is ahead of the store's (negative: behind); None: not
        measured. The reading with the shortest round trip is the closest."""
        if not self._store_samples:
            return None
        return round(min(self._store_samples)[1], 1)

    @property
    def own_problem(self) -> str | None:
        """This replica's clock off the store's by more than MAX_STORE_SKEW_SECONDS, said
        plainly (for /ready); None if it is not."""
        skew = self.store_skew
        if skew is None or abs(skew) <= MAX_STORE_SKEW_SECONDS:
            return None
        direction = "ahead of" if skew > 0 else "behind"
        return (
            f"clock: this replica's clock is {abs(skew):.1f} s {direction} the shared store's "
            f"(Redis TIME); replicas must keep within {MAX_STORE_SKEW_SECONDS:g} s of it (signed "
            f"calls between two allow {MAX_SKEW_SECONDS:g} s): synchronise the clocks (NTP)"
        )

    @property
    def problem(self) -> str | None:
        """The worst skew past what signed calls allow, or this replica's own off the store's,
        said plainly; None if none is."""
        skews = self.skews
        if not skews:
            return self.own_problem
        rid, skew = max(skews.items(), key=lambda item: abs(item[1]))
        if abs(skew) <= MAX_SKEW_SECONDS:
            return self.own_problem
        direction = "ahead of" if skew > 0 else "behind"
        return (
            f"clocks differ by about {abs(skew):.0f} s: replica {rid}'s clock is {direction} "
            f"this replica's (signed calls allow {MAX_SKEW_SECONDS:g} s, so calls between them "
            "are refused); synchronise the replicas' clocks (NTP)"
        )

    async def sample(self) -> None:
        """Read every replica's heartbeat, and the store's clock, once. Raises what the store
        raises."""
        if self.store_time is not None:
            before = time.time()
            theirs = await self.store_time()
            after = time.time()
            self._store_samples.append((after - before, (before + after) / 2 - theirs))
        beats = await self.store.replica_beats()
        now = time.time()
        for rid in [r for r in self._samples if r not in beats]:
            del self._samples[rid]  # (stopped, or its heartbeat expired)
        for rid, beat in beats.items():
            stamp = beat.get("last_seen")
            if rid == self.replica_id or isinstance(stamp, bool):
                continue
            if isinstance(stamp, int | float) and math.isfinite(stamp):
                self._samples.setdefault(rid, deque(maxlen=SAMPLES)).append(stamp - now)
        problem = self.problem
        if problem != self._reported:
            if problem:
                logger.error("cluster: {}", problem)
            else:
                logger.info("cluster: the replicas' clocks agree again")
            self._reported = problem

    def start(self) -> None:
        """Sample twice per heartbeat interval until `aclose` (the store down: skipped)."""
        self._task = self.supervisor.spawn("clock watch", self._run())

    async def aclose(self) -> None:
        """Stop sampling. Never cancels a store call midway: a redis call cancelled in flight
        can keep its pooled connection, which the final flush of the mirror then waits for."""
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.sample()
            except Exception as exc:  # the store is down: health reports that already
                logger.debug("clock watch: no heartbeats read ({})", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval / 2)


async def redis_time(redis: Any) -> float:
    """The shared store's clock (Redis TIME), in seconds: the one clock that deadlines crossing
    machines are measured on."""
    seconds, micros = await redis.time()
    return int(seconds) + int(micros) / 1e6
