"""The cluster this replica runs in: alone (`LocalCluster`), or one of several sharing Redis
(`RedisCluster`). The one seam where "is there a shared store?" is answered.

Both keep the sessions' records (in memory, or in Redis), count executions against their
principal's running limit, give the heartbeat its fields and say how the cluster is for
/health. The Redis one also mirrors every execution into the store (sessions/mirror.py), beats
the heartbeat, watches the other replicas' clocks, and, when the store restarts empty, has the
sessions homed here published again (the router says which: it knows where it placed them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.models import OutputEvent
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import LimitExceededError, SandboxRuntimeError
from sandbox_runtime.execution.cluster import ExecutionsHere
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.sessions.channel import ChannelClient
from sandbox_runtime.sessions.clock import ClockWatch
from sandbox_runtime.sessions.control import ControlChannel
from sandbox_runtime.sessions.elsewhere import InTheStore, NowhereElse
from sandbox_runtime.sessions.epochs import EpochWatch, Reclaim
from sandbox_runtime.sessions.fence import Fence
from sandbox_runtime.sessions.mirror import Mirror
from sandbox_runtime.sessions.signing import ClusterSigner
from sandbox_runtime.sessions.store import MemorySessionStore, SessionStore
from sandbox_runtime.sessions.written import until_written
from sandbox_runtime.state.keys import RUNNING_LEASE_SECONDS, session_key
from sandbox_runtime.state.store import StateStore
from sandbox_runtime.supervisor import Supervisor

RENEW_INTERVAL_SECONDS = 5.0
RENEW_LOOP = "lease renewal"
SWEEP_JOB = "earlier incarnations' executions"
WATCH_LOOP = "store watch"

Running = Callable[[], list[Execution]]  # the executions running here
MarkLost = Callable[[], Awaitable[int]]  # mark an earlier process's executions lost


class LocalCluster:
    """One replica and no shared store: every session is homed here."""

    shared = False  # (a store other replicas share)

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        supervisor: Supervisor,
        sessions: SessionStore | None = None,
        address: str = "",
    ) -> None:
        self.settings = settings
        # A worker's room, for its heartbeat (set by the composition root): sessions, capacity.
        self.capacity: Callable[[], dict[str, int]] | None = None
        self.metrics = metrics
        self.supervisor = supervisor
        self.replica_id = settings.replica_id
        self.sessions = sessions or MemorySessionStore()
        secret = settings.cluster_secret.get_secret_value() if settings.cluster_secret else ""
        self.signer = ClusterSigner(secret, self.replica_id) if secret else None
        self.address = address  # this replica's cluster listener ("": none)
        self.problem: str | None = None  # what is wrong with the deployment's secret
        self._loops: list[str] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, here: ExecutionsHere) -> None:
        """Begin serving as `here`'s cluster (its executions, its heartbeat)."""

    def watch(
        self,
        running: Running,
        record_ttl: int,
        reclaim: Reclaim,
        mark_lost: MarkLost,
        fence: Fence | None = None,
    ) -> None:
        """Keep the records right: renew the leases of the executions `running` here and the
        records of their sessions (and check the cluster) every few seconds; with a shared
        store, `reclaim` the sessions homed here when it restarts empty, `mark_lost` an
        earlier process's executions, and `fence` what others took while this replica's
        heartbeat lapsed."""

        async def renew() -> None:
            with contextlib.suppress(Exception):  # store down: retried at the next interval
                await self.renew(running(), record_ttl)
            await self.check()

        self.supervisor.every(RENEW_LOOP, RENEW_INTERVAL_SECONDS, renew)
        self._loops = [RENEW_LOOP]

    async def aclose(self) -> None:
        """Stop (after the manager's shutdown, whose final states it may still write)."""
        await self.supervisor.stop(*reversed(self._loops))
        self._loops = []

    # -- executions --------------------------------------------------------------------------

    def elsewhere(self, manager: ExecutionManager, channel: ChannelClient | None) -> NowhereElse:
        """Other replicas' executions as seen from here: none."""
        return NowhereElse()

    async def admit(self, owner: Owner, execution_id: str) -> None:
        """Count an execution against its principal's running limit, cluster-wide."""
        limit = self.settings.max_running_per_principal
        try:
            granted = await self.sessions.reserve_running(
                owner.principal, execution_id, limit, RUNNING_LEASE_SECONDS, time.time()
            )
        except Exception as exc:  # store down: the local limits still hold
            logger.warning("per-principal running limit unchecked (store: {})", exc)
            return
        if not granted:
            self.metrics.rejections.labels("principal").inc()
            raise LimitExceededError(
                f"this token is running its maximum of {limit} executions across all its "
                "sessions; wait for one to finish or cancel one"
            )

    def finished(self, execution: Execution) -> None:
        async def release() -> None:
            with contextlib.suppress(Exception):  # its lease lapses on its own
                await self.sessions.release_running(
                    execution.owner.principal, execution.execution_id
                )

        with contextlib.suppress(RuntimeError):  # (closing: the lease lapses on its own)
            self.supervisor.spawn("running lease release", release())

    def changed(self, execution: Execution, events: list[OutputEvent] | None = None) -> None:
        """Nothing to write out alone."""

    def forgotten(self, execution_id: str) -> None:
        """Nothing to forget alone."""

    async def written(self, execution: Execution, within: float) -> None: ...  # (alone: none)

    async def renew(self, executions: list[Execution], record_ttl: int) -> None:
        """Renew the leases of the executions running here and the records of their sessions
        (a session with a running execution is in use). Raises what the store raises."""
        now = time.time()
        running = [(e.owner.principal, e.execution_id) for e in executions]
        await self.sessions.renew_running(running, RUNNING_LEASE_SECONDS, now)
        for key in {session_key(e.owner.principal, e.owner.session_id) for e in executions}:
            await self.sessions.lookup(key, self.replica_id, now, record_ttl)

    @property
    def evicted(self) -> str | None:
        """Why this process serves nothing any more: another holds its replica id (None)."""
        return None

    async def release_homes(self) -> None:
        """Stopping: mark this replica's sessions released so their next call re-homes now."""
        if self.evicted is not None:
            return  # (the records with this id are the other process's)
        try:
            released = await asyncio.wait_for(
                self.sessions.release_replica(self.replica_id, "home_stopped", time.time()), 5
            )
        except Exception as exc:  # the store is down: the heartbeat's expiry does it later
            logger.warning("could not release this replica's sessions: {}", exc)
            return
        if released:
            logger.info("released {} sessions for re-homing", released)

    # -- the shared store --------------------------------------------------------------------

    async def check(self, starting: bool = False) -> str | None:
        """What is wrong with this deployment's secret (None: nothing)."""
        return None

    async def await_records_published(self, key: str, record_ttl: int) -> str:
        """Return once a session without a record may start afresh here; the store's epoch
        to claim it in ("": no epoch to check). Alone: at once."""
        return ""

    @property
    def store_status(self) -> str:
        """For /health: "disabled", "ok" or "unavailable: why"."""
        return "disabled"

    async def unreachable(self) -> str | None:
        """For /ready: why the shared store does not answer now (None: it does, or none)."""
        return None

    @property
    def backlog(self) -> int:
        """Executions changed here and not yet written to the store."""
        return 0

    @property
    def last_contact(self) -> float | None:
        """(monotonic) when the store last heard this replica's heartbeat."""
        return None

    @property
    def clock_problem(self) -> str | None:
        return None

    @property
    def own_clock_problem(self) -> str | None:
        """For /ready: this replica's clock too far off the store's (None: not, or no store)."""
        return None

    @property
    def clock_skews(self) -> dict[str, float]:
        return {}

    @property
    def store_clock_skew(self) -> float | None:
        """Seconds this replica's clock is ahead of the store's (None: no store, not read)."""
        return None

    def heartbeat_fields(self) -> dict[str, Any]:
        return {
            "cluster_address": self.address,
            "cluster_key_id": self.signer.key_id if self.signer else None,
            "role": self.settings.role,
            **(self.capacity() if self.capacity is not None else {}),
        }

    async def live_workers(self) -> list[str]:
        """Replicas that run sessions (role worker or all) whose heartbeat lives: this one."""
        return [self.replica_id] if self.settings.role != "api" else []


class RedisCluster(LocalCluster):
    """One replica among those sharing a Redis store."""

    shared = True

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        supervisor: Supervisor,
        store: StateStore,
        sessions: SessionStore | None = None,
        address: str = "",
    ) -> None:
        if sessions is None:
            from sandbox_runtime.sessions.redis_store import RedisSessionStore

            sessions = RedisSessionStore(store.redis)  # type: ignore[attr-defined]
        super().__init__(settings, metrics, supervisor, sessions, address)
        self.store = store
        self._here: ExecutionsHere | None = None
        self.mirror = Mirror(
            store,
            self.replica_id,
            session_key=lambda e: session_key(e.owner.principal, e.owner.session_id),
            heartbeat_payload=self._heartbeat_payload,
            heartbeat_ttl=settings.heartbeat_ttl,
            known=lambda: self._here.known() if self._here is not None else [],
            observe_lag=metrics.mirror_lag.observe,
            on_store_lost=lambda: self.epochs.store_changed.set(),
            supervisor=supervisor,
            on_fenced=lambda ids: self._fence.refused(ids) if self._fence else None,
            on_evicted=lambda why: self._fence.evicted(why) if self._fence else None,
        )
        self._fence: Fence | None = None
        self.clock = ClockWatch(store, self.replica_id, self.mirror.heartbeat_interval, supervisor)
        metrics.bind_store(lambda: self.mirror.backlog, lambda: 1 if self.mirror.connected else 0)
        self.epochs = EpochWatch(settings, self.sessions, store, self.mirror, lambda: self._here)

    async def start(self, here: ExecutionsHere) -> None:
        """Take this replica's id (refused while another live process holds it), then begin
        mirroring and beating. Raises ReplicaIdInUseError."""
        self._here = here
        await self.mirror.take_id()
        self.mirror.start()
        self.clock.start()

    def watch(
        self,
        running: Running,
        record_ttl: int,
        reclaim: Reclaim,
        mark_lost: MarkLost,
        fence: Fence | None = None,
    ) -> None:
        super().watch(running, record_ttl, reclaim, mark_lost, fence)
        self._fence = fence
        beaten = self.mirror.beaten
        self.supervisor.once(SWEEP_JOB, lambda: self._sweep_earlier_incarnations(beaten, mark_lost))
        check = fence.check if fence is not None else None
        self.supervisor.run(WATCH_LOOP, lambda: self.epochs.watch(reclaim, check))
        self._loops += [SWEEP_JOB, WATCH_LOOP]

    async def aclose(self) -> None:
        # The final flush first, then the loops: a Redis call cancelled in flight can keep its
        # pooled connection, which the flush would then wait for.
        await self.clock.aclose()
        try:
            await asyncio.wait_for(self.mirror.stop(), 15)
        except TimeoutError:
            logger.error("redis: the final flush did not finish in 15 s; giving up")
        await super().aclose()

    # -- executions --------------------------------------------------------------------------

    def elsewhere(self, manager: ExecutionManager, channel: ChannelClient | None) -> NowhereElse:
        """Other replicas' executions: read from the store, controlled over `channel`."""
        control = ControlChannel(self.store, manager, channel)
        return InTheStore(self.store, manager, control, self.mirror.settled)

    def changed(self, execution: Execution, events: list[OutputEvent] | None = None) -> None:
        self.mirror.mark(execution)

    def forgotten(self, execution_id: str) -> None:
        self.mirror.forget(execution_id)

    async def written(self, execution: Execution, within: float) -> None:
        await until_written(self.mirror, execution, within)

    # -- the heartbeat and the other replicas ------------------------------------------------

    def _heartbeat_payload(self) -> dict[str, Any]:
        here = self._here.heartbeat() if self._here is not None else {}
        return {**here, **self.heartbeat_fields()}

    def heartbeat_fields(self) -> dict[str, Any]:
        return {**super().heartbeat_fields(), "store_epoch": self.epochs.synced}

    @property
    def evicted(self) -> str | None:
        return self.mirror.evicted

    @property
    def store_status(self) -> str:
        if self.mirror.evicted is not None:
            return f"fenced: {self.mirror.evicted}"
        if self.mirror.connected:
            return "ok"
        return f"unavailable: {self.mirror.last_error or 'not connected yet'}"

    async def live_workers(self) -> list[str]:
        beats = await self.store.replica_beats()
        return sorted(r for r, beat in beats.items() if beat.get("role", "all") != "api")

    async def unreachable(self) -> str | None:
        if self.mirror.evicted is not None:
            return f"fenced: {self.mirror.evicted}"
        try:
            await asyncio.wait_for(self.store.ping(), 2)
        except Exception as exc:  # any failure to answer means not ready
            return f"redis: {type(exc).__name__}: {exc}"
        return None

    @property
    def backlog(self) -> int:
        return self.mirror.backlog

    @property
    def connected(self) -> bool:
        return self.mirror.connected

    @property
    def last_contact(self) -> float | None:
        return self.mirror.last_contact

    @property
    def clock_problem(self) -> str | None:
        return self.clock.problem

    @property
    def own_clock_problem(self) -> str | None:
        return self.clock.own_problem

    @property
    def clock_skews(self) -> dict[str, float]:
        return self.clock.skews

    @property
    def store_clock_skew(self) -> float | None:
        return self.clock.store_skew

    async def check(self, starting: bool = False) -> str | None:
        """What is wrong with this deployment's secret (None: nothing), from the heartbeats
        of the other replicas. At start a problem is an error: the replica refuses to run.

        Raises SandboxRuntimeError when `starting` and the cluster is misconfigured."""
        try:
            peers = await self.store.replica_beats()
        except Exception:  # the store is down: health reports that already
            return self.problem
        peers.pop(self.replica_id, None)
        mine = self.signer.key_id if self.signer is not None else None
        problem = None
        if peers and self.signer is None:
            problem = (
                f"{len(peers)} other replica(s) share this Redis ({', '.join(sorted(peers))}) "
                "and SANDBOX_CLUSTER_SECRET is not set: sessions homed elsewhere cannot be "
                "reached. Give every replica the same secret"
            )
        elif self.signer is not None:
            other = sorted(r for r, p in peers.items() if p.get("cluster_key_id") != mine)
            if other:
                problem = (
                    f"replica(s) {', '.join(other)} use a different SANDBOX_CLUSTER_SECRET (or "
                    "none): calls between them and this replica will be refused"
                )
        if problem != self.problem:
            if problem:
                logger.error("cluster: {}", problem)
            elif self.problem:
                logger.info("cluster: the secret now agrees with every replica")
        self.problem = problem
        if problem and starting and self.signer is None:
            # Without a secret this replica could never reach their sessions. (A secret that
            # differs is reported, not fatal: one stray heartbeat must not stop every start.)
            raise SandboxRuntimeError(f"refusing to start: {problem}")
        return problem

    async def _sweep_earlier_incarnations(self, beaten: asyncio.Event, mark_lost: MarkLost) -> None:
        """Once this process's heartbeat has replaced an earlier one's (same replica id),
        mark that process's running executions lost (retried until done)."""
        await beaten.wait()
        backoff = 0.2
        while True:
            try:
                lost = await mark_lost()
            except Exception as exc:  # the store failed: retry shortly
                logger.warning("marking an earlier process's executions lost: {}", exc)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            if lost:
                logger.warning(
                    "{} executions of this replica's previous process were left running: "
                    "marked lost",
                    lost,
                )
            return

    async def await_records_published(self, key: str, record_ttl: int) -> str:
        return await self.epochs.await_records_published(key, record_ttl)
