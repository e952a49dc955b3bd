"""The cluster this replica runs in: alone (`LocalCluster`), or one of several sharing Redis
(`RedisCluster`). The one seam where "is there a shared store?" is answered.

Both keep the sessions' records (in memory, or in Redis), count executions against their
principal's running limit, give the heartbeat its fields and say how the cluster is for
/health. The Redis one also mirrors every execution into the store (state/mirror.py), beats
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
from sandbox_runtime.errors import LimitExceededError, OwnerUnavailableError, SandboxRuntimeError
from sandbox_runtime.execution.cluster import ExecutionsHere
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.sessions.clock import ClockWatch
from sandbox_runtime.sessions.signing import ClusterSigner
from sandbox_runtime.sessions.store import MemorySessionStore, SessionStore
from sandbox_runtime.state.keys import RUNNING_LEASE_SECONDS, session_key
from sandbox_runtime.state.mirror import Mirror
from sandbox_runtime.state.store import StateStore
from sandbox_runtime.supervisor import Supervisor

SETTLE_MARGIN_SECONDS = 2.0  # beyond a heartbeat TTL, for records published again
SETTLE_POLL_SECONDS = 0.1
SWEEP_JOB = "earlier incarnations' executions"
WATCH_LOOP = "store watch"

Reclaim = Callable[[], Awaitable[int]]  # publish again the sessions homed here; how many
MarkLost = Callable[[], Awaitable[int]]  # mark an earlier process's executions lost


class LocalCluster:
    """One replica and no shared store: every session is homed here."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        supervisor: Supervisor,
        sessions: SessionStore | None = None,
        address: str = "",
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.supervisor = supervisor
        self.replica_id = settings.replica_id
        self.sessions = sessions or MemorySessionStore()
        secret = settings.cluster_secret.get_secret_value() if settings.cluster_secret else ""
        self.signer = ClusterSigner(secret, self.replica_id) if secret else None
        self.address = address  # this replica's cluster listener ("": none)
        self.problem: str | None = None  # what is wrong with the deployment's secret

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, here: ExecutionsHere) -> None:
        """Begin serving as `here`'s cluster (its executions, its heartbeat)."""

    def watch(self, reclaim: Reclaim, mark_lost: MarkLost) -> None:
        """Keep the shared records right (nothing to keep alone)."""

    async def aclose(self) -> None:
        """Stop (after the manager's shutdown, whose final states it may still write)."""

    # -- executions --------------------------------------------------------------------------

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

    async def renew(self, executions: list[Execution], record_ttl: int) -> None:
        """Renew the leases of the executions running here and the records of their sessions
        (a session with a running execution is in use). Raises what the store raises."""
        now = time.time()
        running = [(e.owner.principal, e.execution_id) for e in executions]
        await self.sessions.renew_running(running, RUNNING_LEASE_SECONDS, now)
        for key in {session_key(e.owner.principal, e.owner.session_id) for e in executions}:
            await self.sessions.lookup(key, self.replica_id, now, record_ttl)

    async def release_homes(self) -> None:
        """Stopping: mark this replica's sessions released so their next call re-homes now."""
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
    def connected(self) -> bool:
        return True

    @property
    def last_contact(self) -> float | None:
        """(monotonic) when the store last heard this replica's heartbeat."""
        return None

    @property
    def clock_problem(self) -> str | None:
        return None

    @property
    def clock_skews(self) -> dict[str, float]:
        return {}

    def heartbeat_fields(self) -> dict[str, Any]:
        return {
            "cluster_address": self.address,
            "cluster_key_id": self.signer.key_id if self.signer else None,
        }


class RedisCluster(LocalCluster):
    """One replica among those sharing a Redis store."""

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
        # Set when the mirror finds the store lost what this replica wrote (Redis restarted
        # empty) or is back after an outage: the records are published again at once.
        self.store_changed = asyncio.Event()
        # The store's epoch under which this replica has published the records of the
        # sessions it holds (in its heartbeat: a session with no record may start afresh only
        # once every live replica has).
        self.synced_epoch: str | None = None
        # The last epoch this replica published under, kept in its state dir: a process that
        # starts after the store restarted empty says it knew another (the new epoch is then
        # marked restarted, and no session without a record starts afresh until every replica
        # had its heartbeat's time to publish again), even when it is the first to look.
        self._epoch_file = settings.state_dir / "store-epoch"
        self._known_epoch: str | None = None
        with contextlib.suppress(OSError, UnicodeDecodeError):
            self._known_epoch = self._epoch_file.read_text().strip()[:128] or None
        self.mirror = Mirror(
            store,
            self.replica_id,
            session_key=lambda e: session_key(e.owner.principal, e.owner.session_id),
            heartbeat_payload=self._heartbeat_payload,
            heartbeat_ttl=settings.heartbeat_ttl,
            known=lambda: self._here.known() if self._here is not None else [],
            observe_lag=metrics.mirror_lag.observe,
            on_store_lost=self.store_changed.set,
            supervisor=supervisor,
        )
        self.clock = ClockWatch(store, self.replica_id, self.mirror.heartbeat_interval, supervisor)
        self._loops: list[str] = []

    async def start(self, here: ExecutionsHere) -> None:
        self._here = here
        self.mirror.start()
        self.clock.start()

    def watch(self, reclaim: Reclaim, mark_lost: MarkLost) -> None:
        beaten = self.mirror.beaten
        self.supervisor.once(SWEEP_JOB, lambda: self._sweep_earlier_incarnations(beaten, mark_lost))
        self.supervisor.run(WATCH_LOOP, lambda: self._watch_store(reclaim))
        self._loops = [SWEEP_JOB, WATCH_LOOP]

    async def aclose(self) -> None:
        await self.supervisor.stop(*reversed(self._loops))
        self._loops = []
        await self.clock.aclose()
        try:
            await asyncio.wait_for(self.mirror.stop(), 15)
        except TimeoutError:
            logger.error("redis: the final flush did not finish in 15 s; giving up")

    # -- executions --------------------------------------------------------------------------

    def changed(self, execution: Execution, events: list[OutputEvent] | None = None) -> None:
        self.mirror.mark(execution)

    def forgotten(self, execution_id: str) -> None:
        self.mirror.forget(execution_id)

    # -- the heartbeat and the other replicas ------------------------------------------------

    def _heartbeat_payload(self) -> dict[str, Any]:
        here = self._here.heartbeat() if self._here is not None else {}
        return {**here, **self.heartbeat_fields()}

    def heartbeat_fields(self) -> dict[str, Any]:
        return {**super().heartbeat_fields(), "store_epoch": self.synced_epoch}

    @property
    def store_status(self) -> str:
        if self.mirror.connected:
            return "ok"
        return f"unavailable: {self.mirror.last_error or 'not connected yet'}"

    async def unreachable(self) -> str | None:
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
    def clock_skews(self) -> dict[str, float]:
        return self.clock.skews

    async def check(self, starting: bool = False) -> str | None:
        """What is wrong with this deployment's secret (None: nothing), from the heartbeats
        of the other replicas. At start a problem is an error: the replica refuses to run.

        Raises SandboxRuntimeError when `starting` and the cluster is misconfigured.
        """
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

    # -- when the store restarts empty -------------------------------------------------------

    async def _watch_store(self, reclaim: Reclaim) -> None:
        """Publish again, where missing, the records of the sessions homed here whenever the
        store begins a new epoch (Redis restarted empty), so that their next calls, wherever
        they land, come here and find their workspaces; then say so in the heartbeat. Checked
        every heartbeat interval, and at once when the mirror finds the store lost data or is
        back after an outage (then the sessions that moved away meanwhile are learnt of too:
        this replica must not publish a stale home for them later)."""
        mirror = self.mirror
        backoff = 0.2
        resync = False  # the mirror found the store lost data, or came back after an outage
        while True:
            resync = resync or self.store_changed.is_set()
            self.store_changed.clear()
            try:
                epoch = await self.sessions.epoch(self.synced_epoch or self._known_epoch)
                changed = epoch.epoch_id != self.synced_epoch
                accepting = self._here is not None and self._here.accepting
                if (changed or resync) and accepting:
                    # First this replica's heartbeat (a record whose home has none would be
                    # taken over), then the records, then the heartbeat that says so.
                    if not await mirror.beat():
                        raise ConnectionError(mirror.last_error or "the heartbeat failed")
                    restored = await reclaim()
                    resync = False
                    if changed and (self.synced_epoch is not None or restored):
                        logger.warning(
                            "the shared store began anew (epoch {}): published again the "
                            "records of {} sessions homed here",
                            epoch.epoch_id,
                            restored,
                        )
                    self.synced_epoch = epoch.epoch_id
                    self._remember_epoch(epoch.epoch_id)
                    await mirror.beat()
                backoff = 0.2
                wait = mirror.heartbeat_interval
            except Exception as exc:  # the store failed: retry with backoff
                if mirror.connected:
                    logger.warning("publishing again the records of sessions homed here: {}", exc)
                wait = backoff
                backoff = min(5.0, backoff * 2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.store_changed.wait(), wait)

    def _remember_epoch(self, epoch_id: str) -> None:
        if epoch_id == self._known_epoch:
            return
        self._known_epoch = epoch_id
        try:
            self._epoch_file.write_text(epoch_id)
        except OSError as exc:  # (then a restart after a store restart may not wait)
            logger.warning("could not keep the store's epoch in {}: {}", self._epoch_file, exc)

    async def await_records_published(self, key: str, record_ttl: int) -> str:
        """Return once a session without a record may start afresh here: the store's epoch
        is old enough that every replica alive before it began has heartbeat since (a
        heartbeat TTL), and every live replica has published the records of the sessions it
        holds under it; or at once if the session's record appears meanwhile. Returns that
        epoch (a claim is made only in it).

        Raises OwnerUnavailableError (the store is down, or the replicas did not publish in
        time: retry).
        """
        ttl = self.settings.heartbeat_ttl
        deadline = time.monotonic() + ttl + SETTLE_MARGIN_SECONDS
        logged = False
        while True:
            try:
                epoch, waiting = await self._unpublished()
                if not waiting:
                    return epoch
                found = await self.sessions.lookup(key, self.replica_id, time.time(), record_ttl)
            except Exception as exc:
                raise OwnerUnavailableError(
                    f"the shared store is unavailable ({type(exc).__name__}); retry shortly"
                ) from exc
            if found.record is not None:
                return epoch
            if not logged:
                logger.info("a session without a record waits for {}", ", ".join(waiting))
                logged = True
            if time.monotonic() >= deadline:
                raise OwnerUnavailableError(
                    "the shared store (Redis) lost its data moments ago and the replicas are "
                    "publishing again the sessions they hold; this session has no record yet "
                    f"(waiting for {', '.join(waiting)}): retry in a few seconds"
                )
            await asyncio.sleep(SETTLE_POLL_SECONDS)

    async def _unpublished(self) -> tuple[str, list[str]]:
        """The store's epoch, and what a session without a record waits for in it before it
        may start afresh (nothing: it may). Raises what the store raises."""
        epoch = await self.sessions.epoch(self.synced_epoch or self._known_epoch)
        waiting: list[str] = []
        grace = self.settings.heartbeat_ttl - epoch.age
        if epoch.restarted and grace > 0:
            waiting.append(f"replicas not heard from since ({grace:.1f} s more)")
        if self.synced_epoch != epoch.epoch_id:
            waiting.append(f"replica {self.replica_id}")
            self.store_changed.set()  # (publish now, not at the next heartbeat interval)
        # (Alive by the store's clock: its heartbeat key exists. The set's scores are each
        # writer's own clock, and a replica whose clock is behind would drop out of them.)
        peers = await self.store.replica_beats()
        peers.pop(self.replica_id, None)
        # (A heartbeat without the field is an older version's, which never waits.)
        waiting += [
            f"replica {peer}"
            for peer, beat in sorted(peers.items())
            if beat.get("store_epoch", epoch.epoch_id) != epoch.epoch_id
        ]
        return epoch.epoch_id, waiting


Cluster = LocalCluster  # (RedisCluster is one)
