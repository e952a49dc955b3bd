"""The composition root: the one place where the process's parts are built and wired.

Read top to bottom, `build` says how the program is put together:

    Settings
      ├─ (the state directory's lock: app/state_lock.py; one live server per directory)
      ├─ Supervisor            every background loop and task of every part below, named,
      │                        under one policy; closed last
      ├─ Metrics               the Prometheus registry every part counts into
      ├─ AuditLog              one line per call (audit/), its writer thread; closed last
      ├─ Cluster               alone (LocalCluster) or with Redis (RedisCluster: the mirror,
      │                        the heartbeat, the clock watch): the sessions' records and
      │                        the per-principal running limit
      ├─ BubblewrapBackend     sandboxes: spec -> bwrap argv, the spawner, cgroups, reaping
      ├─ WorkspaceStore        the sessions' /workspace images: quotas, mounts, retention
      ├─ EgressProxy           the allowlist proxy (a separate process), when allowed
      ├─ SandboxPool           sandboxes started ahead of need
      └─ ExecutionManager      one per process for its whole life: executions, their slots,
         │                     events and retention, over the parts above
         ├─ InterpreterManager run_code's kernels, over the manager
         ├─ FileUrlSigner      the key of signed file URLs
         ├─ ServerHost         hosted MCP servers' instances (servers/): catalog, sandboxes,
         │                     idle stop, restarts
         └─ Router             sessions' homes, forwarding to them, control of other
                               replicas' executions; runs the session-bound operations
                               (sessions.operations) with the Parts above

Each part gets what it needs in its constructor; the few links that point back up (the
workspaces asking which are in use, the pool's and the proxy's counts) are made here, by
name. The parts are started in that order inside an AsyncExitStack and closed in reverse
when the server stops. The HTTP edge (server/) reaches them through a `Root`, which the ASGI
lifespan fills: no part is a module global.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.app.roles import API_ROLE, placement_queue, serve_placements
from sandbox_runtime.app.root import Root as Root  # (where the edge finds these parts)
from sandbox_runtime.app.state_lock import holding, needs_lock
from sandbox_runtime.audit.log import AuditLog
from sandbox_runtime.config import Settings
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.egress.secrets import broker_from_settings
from sandbox_runtime.egress.supervisor import EgressProxy
from sandbox_runtime.execution.images import session_images
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.files.urls import FileUrlSigner, url_key
from sandbox_runtime.interpreters.manager import InterpreterManager
from sandbox_runtime.interpreters.runtime import MANIFEST
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.sandbox import BackendConfig, BubblewrapBackend
from sandbox_runtime.sandbox.pool import SandboxPool
from sandbox_runtime.servers.catalog import Entry
from sandbox_runtime.servers.code_mode import BridgeMaker
from sandbox_runtime.servers.host import ServerHost
from sandbox_runtime.sessions.cluster import LocalCluster, RedisCluster
from sandbox_runtime.sessions.operations import Parts
from sandbox_runtime.sessions.router import Router
from sandbox_runtime.snapshots.service import Snapshots
from sandbox_runtime.snapshots.stores import open_store
from sandbox_runtime.snapshots.triggers import Triggers
from sandbox_runtime.supervisor import Supervisor
from sandbox_runtime.workspaces.blanks import TEND_SECONDS
from sandbox_runtime.workspaces.store import WorkspaceStore, loop_devices_under

# Asking the shared store whether this replica is still a session's home before its snapshot
# becomes the session's newest.
HOME_CHECK_SECONDS = 5.0


class Closing:
    """The parts' closes, newest first, run once: by the signal handler's stop or by the
    lifespan's end, whichever comes first (the other waits for it). A close that fails is
    logged and the rest still run."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._closes: list[Callable[[], Awaitable[None]]] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, close: Callable[[], Awaitable[None]]) -> None:
        self._closes.append(close)

    async def run(self) -> None:
        if self._task is None:
            self._task = self.supervisor.spawn("closing the parts", self._run())
        await asyncio.shield(self._task)

    async def _run(self) -> None:
        for close in reversed(self._closes):
            try:
                await close()
            except Exception:
                logger.exception("closing {} failed", getattr(close, "__qualname__", close))


@dataclass(frozen=True)
class Services:
    """The process's running parts."""

    settings: Settings
    supervisor: Supervisor
    metrics: Metrics
    cluster: LocalCluster
    manager: ExecutionManager
    interpreters: InterpreterManager
    signer: FileUrlSigner
    servers: ServerHost
    router: Router
    snapshots: Snapshots
    triggers: Triggers
    closing: Closing
    audit: AuditLog
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def stop(self) -> None:
        """Stop the executions (politely, then by force), meanwhile snapshotting this
        replica's changed sessions (with Redis: others will take them over) and then
        releasing them, and stopping its interpreters; then close the sandboxes, the egress
        proxy, the workspaces and the cluster (the mirror's final flush, the heartbeat
        dropped). Idempotent: the signal handler calls it before the server drains its
        connections, the lifespan's end again."""

        self.stopping.set()
        if self.settings.role == "worker":
            self.manager.draining = True  # (stdin, cancel and reads still reach it)
            await self._let_executions_finish()

        async def release() -> None:
            try:
                if self.settings.redis_url:
                    await self.triggers.drain()
            finally:
                await self.cluster.release_homes()

        meanwhile = [release, self.interpreters.aclose, self.servers.aclose]
        await self.manager.shutdown(meanwhile)
        await self.closing.run()

    async def _let_executions_finish(self) -> None:
        """A draining worker takes no new session; what runs on it may finish, within
        SANDBOX_WORKER_DRAIN_SECONDS (then it is stopped as on any replica)."""
        deadline = time.monotonic() + self.settings.worker_drain_seconds
        running = self.manager.running_count
        if running:
            logger.info("draining: {} executions may finish first", running)
        while self.manager.running_count and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def build(settings: Settings, cluster_address: str = "") -> AsyncIterator[Services]:
    """Build and start the parts in dependency order; stop them in reverse on the way out.

    `cluster_address`: where other replicas reach this one's cluster listener ("": none).
    """
    async with contextlib.AsyncExitStack() as stack:
        if needs_lock(settings.role):  # (the CLI took it already: shared within a process)
            stack.enter_context(holding(settings.state_dir))
        supervisor = Supervisor()
        stack.push_async_callback(supervisor.aclose)  # last: whatever is left ends here
        closing = Closing(supervisor)  # (the parts below, in reverse; see Services.stop)
        stack.push_async_callback(closing.run)
        metrics = Metrics()
        audit = AuditLog.of(settings, metrics.registry)
        audit.start()  # (closed after every other part: their last calls are said)
        stack.push_async_callback(audit.aclose)
        cluster = _cluster(settings, metrics, supervisor, cluster_address)
        # After the executions have stopped: the mirror's final flush records their ends.
        closing.add(cluster.aclose)

        limits = settings.limits()
        backend = BubblewrapBackend(
            BackendConfig(
                limits=limits,
                sandbox_user=settings.sandbox_user,
                workspace_root=settings.state_dir / "workspaces",
                bwrap_path=settings.bwrap_path,
                group_name=f"srt-{settings.replica_id}",
                cgroup_favordynmods=settings.cgroup_favordynmods,
                runtime_dir=_installed_runtime(settings.runtime_path()),
            ),
            supervisor,
        )
        workspaces = WorkspaceStore(
            backend.config.workspace_root,
            size_mb=settings.workspace_mb,
            inodes=settings.workspace_inode_count(),
            quota=settings.workspace_quota,
            retention_seconds=settings.workspace_retention_seconds,
            max_mounted=settings.max_mounted_workspaces,
            max_mounted_per_principal=settings.max_mounted_workspaces_per_principal,
            reserve=settings.workspace_reserve,
            min_free_mb=settings.min_free_disk_mb,
            headroom_mb=settings.workspace_headroom_mb,
            blanks=settings.workspace_pool,
            blanks_max=settings.workspace_pool_max,
            idle_budget_mb=settings.idle_workspaces_mb,
            idle_budget_mb_per_principal=settings.idle_workspaces_mb_per_principal,
            idle_after_seconds=settings.idle_workspace_seconds,
        )
        closing.add(workspaces.aclose)
        if settings.role == "api":  # (an api replica runs nothing: its sessions live on workers)
            backend.unavailable_reason = API_ROLE
            # Never started, the workspaces would not make their root; /health and /ready
            # measure the state filesystem there (a missing root reads as a full disk).
            workspaces.root.mkdir(parents=True, exist_ok=True)
        else:
            backend.start()  # finds the sandbox user, or says why sandboxes cannot run
        egress = await _egress(settings, backend, metrics, supervisor)
        if egress is not None:
            closing.add(egress.aclose)
        closing.add(backend.aclose)
        pool = SandboxPool(
            backend,
            limits,
            size=settings.pool_size,
            idle_seconds=settings.pool_idle_seconds,
            workspace_ready=lambda path: workspaces.is_ready(path.name),
            supervisor=supervisor,
        )
        manager = ExecutionManager(
            settings,
            backend=backend,
            workspaces=workspaces,
            pool=pool,
            cluster=cluster,
            metrics=metrics,
            supervisor=supervisor,
            egress=egress,
        )
        _link(workspaces, pool, manager, metrics)
        manager.images = images = session_images(settings)  # (sessions' environments)

        interpreters = InterpreterManager(settings, manager)
        signer = FileUrlSigner(url_key(settings))
        servers = ServerHost(settings, manager, metrics, supervisor)
        manager.workspaces.busy.append(servers.workspaces_in_use)
        manager.workspaces.release_idle.append(servers.stop_idle_in)
        snapshots = Snapshots(
            open_store(
                settings.snapshot_store,
                settings.state_dir / "snapshots",
                endpoint=settings.snapshot_s3_endpoint,
                region=settings.snapshot_s3_region,
                timeout=settings.snapshot_store_timeout,
            ),
            workspaces,
            settings.state_dir / "snapshot-staging",
            metrics.registry,
            keep=settings.snapshot_keep,
            ttl_seconds=settings.snapshot_ttl_seconds,
            quota_bytes=settings.snapshot_quota_mb * 1024 * 1024,
            max_per_principal=settings.snapshot_max_per_principal,
            restore_seconds=settings.snapshot_store_timeout * 4,
            supervisor=supervisor,
            replica_id=settings.replica_id,
            store_epoch=_store_epoch(cluster),
        )
        parts = Parts(manager, interpreters, signer, servers, snapshots)
        queue = placement_queue(settings, cluster)
        if queue is not None:
            closing.add(queue.redis.aclose)
        router = Router(settings, parts, cluster, queue if settings.role == "api" else None)
        snapshots.still_home = _still_home(cluster, router)
        images.attach(snapshots, settings.environment_max_mb)  # (they travel with snapshots)
        triggers = Triggers(
            snapshots,
            lambda: [owner for _, owner in router.placements.homed_at(settings.replica_id)],
            manager.workspaces_in_use,
            settings.snapshot_idle_seconds,
            settings.snapshot_drain_seconds,
        )
        workspaces.before_budget_removal.append(triggers.before_removal)
        workspaces.kept_elsewhere.append(triggers.kept)
        manager.bridges.append(_bridges(settings, servers, router))
        stack.push_async_callback(router.aclose)
        services = Services(
            settings,
            supervisor,
            metrics,
            cluster,
            manager,
            interpreters,
            signer,
            servers,
            router,
            snapshots,
            triggers,
            closing,
            audit,
        )
        await cluster.start(manager)
        await manager.start()
        stack.push_async_callback(services.stop)
        await cluster.check(starting=True)
        router.start()
        if settings.role != "api":
            interpreters.start()
            servers.start()
        if queue is not None:
            serve_placements(settings, supervisor, queue, router, services)
        if snapshots.enabled and settings.snapshot_idle_seconds > 0:
            supervisor.every("idle snapshots", triggers.interval, triggers.idle_pass)
        if workspaces.blanks_on:  # (and after every take: workspaces/blanks.py)
            supervisor.every("blank workspaces", TEND_SECONDS, workspaces.refill, at_once=True)
        if workspaces.mode == "image":
            guard = workspaces.guard
            supervisor.every("workspace disk guard", guard.interval, guard.step)
        yield services


def _still_home(cluster: LocalCluster, router: Router) -> Callable[[Owner], Awaitable[bool]]:
    """Whether this replica is still a session's home, before its snapshot becomes the
    session's newest: not once its heartbeat lapsed (others may have taken the session) or
    its id is another process's; else as the shared store's record says (the store down or
    slow: the home it last knew, this one, as for any call it serves without the store)."""
    mirror = cluster.mirror if isinstance(cluster, RedisCluster) else None

    async def still_home(owner: Owner) -> bool:
        if cluster.evicted is not None or (mirror is not None and mirror.lapsed()):
            return False
        if not cluster.shared:
            return True
        try:
            return await asyncio.wait_for(router.fence.is_home(owner), HOME_CHECK_SECONDS)
        except Exception:
            return True

    return still_home


def _store_epoch(cluster: LocalCluster) -> Callable[[], str | None]:
    """The shared store's epoch the cluster's records are in (see Snapshots.store_epoch)."""
    epochs = getattr(cluster, "epochs", None)  # (a RedisCluster's; alone: none)
    return (lambda: epochs.synced) if epochs is not None else (lambda: None)


def _cluster(
    settings: Settings, metrics: Metrics, supervisor: Supervisor, address: str
) -> LocalCluster:
    if not settings.redis_url:
        return LocalCluster(settings, metrics, supervisor, address=address)
    from sandbox_runtime.state.redis_store import RedisStore

    store = RedisStore(settings.redis_url, ttl_seconds=settings.retention_seconds)
    return RedisCluster(settings, metrics, supervisor, store, address=address)


async def _egress(
    settings: Settings, backend: BubblewrapBackend, metrics: Metrics, supervisor: Supervisor
) -> EgressProxy | None:
    """The egress proxy, started, when the server allows any network (None: none)."""
    policy = settings.egress_policy()
    if not policy.enabled or backend.private_dir is None:
        return None
    egress = EgressProxy(
        settings.egress_settings(),
        backend.private_dir / "egress",
        backend.sandbox_uid,
        backend.sandbox_gid,
        supervisor=supervisor,
    )
    egress.on_event.append(metrics.count_egress)
    assert backend.private_dir is not None
    egress.secrets = broker_from_settings(settings, backend.private_dir / "egress-trust")
    if egress.secrets is not None:
        logger.info("secret rules: {}", [r["rule"] for r in egress.secrets.describe()])
    await egress.start()
    backend.egress = egress
    logger.info("egress allowed: {}", policy.describe())
    return egress


def _bridges(settings: Settings, servers: ServerHost, router: Router) -> BridgeMaker:
    """Code mode's bridges: a call from code reaches an instance the way its endpoint does
    (a stdio server's on its home replica through the Router, a remote one from here)."""

    async def route(
        owner: Owner, entry: Entry, method: str, params: dict[str, Any], progress: Any
    ) -> dict[str, Any]:
        if entry.kind == "remote":
            return await servers.request(owner, entry.name, method, params, progress)
        args = {"server": entry.name, "method": method, "params": params}
        return await router.run(owner, "server_request", args, progress)

    maker = BridgeMaker(servers, settings.state_dir / "bridges", route)
    backend = servers.manager.backend
    if backend.unavailable_reason is None:
        maker.owner_ids = (backend.sandbox_uid, backend.sandbox_gid)
    return maker


def _link(
    workspaces: WorkspaceStore, pool: SandboxPool, manager: ExecutionManager, metrics: Metrics
) -> None:
    """The links that point back up: what the workspaces and the pool ask and report."""
    # A workspace is in use while an execution wants it; a sandbox started ahead in it does
    # not keep it (it is ended before the workspace is unmounted or removed).
    workspaces.busy.append(manager.workspaces_in_use)
    workspaces.standby.append(pool.workspaces)
    workspaces.before_release.append(lambda name: pool.discard_workspace(workspaces.path(name)))
    workspaces.spawn, workspaces.start_ahead = pool.supervisor.spawn, pool.start_ahead
    workspaces.blank_taken.append(pool.move)
    workspaces.on_refused.append(lambda cap: metrics.rejections.labels(cap).inc())
    workspaces.on_damage.append(lambda event: metrics.damage.labels(event).inc())
    workspaces.on_removed.append(lambda reason: metrics.workspaces_removed.labels(reason).inc())
    metrics.bind_disk(
        lambda: workspaces.disk.status().free_bytes,
        lambda: 1 if workspaces.disk.status().low else 0,
    )
    metrics.bind_workspaces(workspaces.mounted_by_kind, lambda: loop_devices_under(workspaces.root))
    pool.on_hit.append(metrics.pool_hits.inc)
    pool.on_miss.append(lambda reason: metrics.pool_misses.labels(reason).inc())
    pool.on_refill.append(metrics.pool_refill.observe)
    metrics.pool_ready.set_function(lambda: pool.ready_count)


def _installed_runtime(path: Path) -> Path | None:
    """The runtime directory if a runtime is installed there (bound into every sandbox)."""
    return path if (path / MANIFEST).is_file() else None
