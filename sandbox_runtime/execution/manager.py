"""The ExecutionManager: one per process; owns every execution, its slot and its retention."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import ctypes
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from loguru import logger

from sandbox_runtime.config import Settings, cli_name
from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.domain.models import (
    ExecutionInfo,
    ExecutionStatus,
    is_execution_id,
    shown_id,
)
from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.egress.supervisor import DeniedHandler, EgressProxy
from sandbox_runtime.errors import (
    ExecutionNotFoundError,
    SandboxSpawnError,
    SandboxUnavailableError,
)
from sandbox_runtime.execution.cluster import Cluster
from sandbox_runtime.execution.code_mode import Bridges, OpenBridge, bridged_env, open_bridge
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.images import SessionImages
from sandbox_runtime.execution.network import denied_to, egress_of, granted
from sandbox_runtime.execution.reading import (
    MAX_EVENTS_PER_READ,
    OutputPage,
    checked_read,
    read_page,
)
from sandbox_runtime.execution.requests import ExecuteRequest, checked_timeout, command_argv
from sandbox_runtime.execution.retention import evicted
from sandbox_runtime.execution.slots import Slots
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.sandbox import (
    BubblewrapBackend,
    SandboxSpec,
    sandbox_cwd,
    validate_env,
)
from sandbox_runtime.sandbox.pool import SandboxPool
from sandbox_runtime.supervisor import Supervisor
from sandbox_runtime.workspaces.store import WorkspaceStore

EVICT_LOOP = "eviction"
TRIM_AFTER_BYTES = 4 * 1024 * 1024


class ExecutionManager:
    """Creates, runs, reads, controls and evicts executions. One per process (the composition
    root, app/services.py, builds it and the parts it is given)."""

    def __init__(
        self,
        settings: Settings,
        *,
        backend: BubblewrapBackend,
        workspaces: WorkspaceStore,
        pool: SandboxPool,
        cluster: Cluster,
        metrics: Metrics,
        supervisor: Supervisor,
        egress: EgressProxy | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.workspaces = workspaces
        self.pool = pool
        self.cluster = cluster
        self.metrics = metrics
        self.supervisor = supervisor  # the owner of every background loop
        self.egress = egress
        self.egress_policy = settings.egress_policy()
        self.bridges: list[Bridges] = []  # code mode's, from the composition root (or none)
        self.images: SessionImages | None = None  # sessions' environments (from the root)
        self.limits = settings.limits()
        # An execution's info copies it (most run with the server's limits: asdict is slow).
        self._limits_dict = self.limits.as_dict()
        self.replica_id = settings.replica_id
        self.started_at = time.time()
        # This process among those that run (or ran) as `replica_id`: liveness is per process.
        self.incarnation = uuid.uuid4().hex
        self._executions: dict[str, Execution] = {}
        self._evicted_at = 0.0  # (monotonic) the last eviction
        self._running: dict[str, Execution] = {}
        self.slots = Slots(settings, metrics, cluster, lambda: len(self._running))
        self._spawning: dict[Owner, int] = {}  # executions between workspace and _running
        self._accepting = False
        self.draining = False  # a worker stopping: its sessions' new calls go elsewhere later
        self._shutdown: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start taking executions (the backend has started: its sandbox user is known)."""
        self.metrics.bind_running(lambda: len(self._running))
        if self.backend.unavailable_reason is None:
            try:
                self.workspaces.start(self.backend.sandbox_uid, self.backend.sandbox_gid)
            except SandboxUnavailableError as exc:
                self.backend.unavailable_reason = str(exc)
                logger.error("sandbox unavailable: {}", exc)
        if self.backend.unavailable_reason is None:
            if self.pool.size and self.backend.stub_problem is not None:
                logger.warning("no sandboxes started ahead of need: {}", self.backend.stub_problem)
            self.pool.start()
        self._accepting = True
        if self.backend.unavailable_reason is None:
            await self.workspaces.sweep()  # a previous run's, unused for the retention
        retention = self.settings.retention_seconds
        self.supervisor.every(EVICT_LOOP, min(60.0, max(1.0, retention / 4)), self._evict_step)

    def workspaces_in_use(self) -> set[str]:
        """An owner's workspace is in use from the moment an execution asks for it (before
        its sandbox starts) until the execution has ended: nothing may replace or unmount it.
        (A sandbox waiting in a workspace does not keep it: see the pool.)"""
        return {
            workspace_name(e.owner) for e in self._running.values() if not e.finished.is_set()
        } | {workspace_name(owner) for owner in self._spawning}

    def known(self) -> builtins.list[Execution]:
        """Every execution held here (the mirror writes them again after a store loss)."""
        return list(self._executions.values())

    async def shutdown(self, meanwhile: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        """Stop accepting, stop every execution (politely, then by force), record final states;
        run `meanwhile` (the session layer's part: release the homes, stop the interpreters)
        while the executions spend their grace period.

        Idempotent: a second call waits for the first.
        """
        if self._shutdown is None:
            self._shutdown = self.supervisor.spawn("shutdown", self._shutdown_once(meanwhile))
        await asyncio.shield(self._shutdown)

    async def _shutdown_once(self, meanwhile: Sequence[Callable[[], Awaitable[None]]]) -> None:
        self._accepting = False
        await self.pool.aclose()  # first: executions stopped now must not start more
        running = list(self._running.values())
        if running:
            logger.info("shutdown: stopping {} running executions", len(running))
        for execution in running:
            if execution.process is not None:
                execution.process.stop_in_background(self.settings.shutdown_grace, "shutdown")
        outcomes = await asyncio.gather(*(work() for work in meanwhile), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):  # must not keep executions running
                logger.opt(exception=outcome).error("shutdown work failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(e.finished.wait() for e in running)),
                self.settings.shutdown_grace + 5,
            )
        await self.supervisor.stop(EVICT_LOOP)

    def egress_of(self, limits: SandboxLimits, owner: Owner | None = None) -> EgressPolicy | None:
        """The egress policy under `limits`, with `owner`'s secret rules if given (network.py)."""
        return granted(egress_of(self.egress_policy, limits), owner, limits, None)

    def network_denied(self, execution: Execution) -> DeniedHandler:
        """Where the proxy's denials for `execution`'s sandbox go (see network.denied_to)."""
        return denied_to(execution)

    @property
    def sandbox_status(self) -> str:
        return "ok" if self.backend.unavailable_reason is None else "unavailable"

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def accepting(self) -> bool:
        """False once shutdown began: no new executions or sessions here."""
        return self._accepting

    # -- starting ----------------------------------------------------------------------------

    async def start_execution(self, owner: Owner, request: ExecuteRequest) -> Execution:
        """Validate, take a slot and start the sandbox.

        Raises InvalidRequestError, PolicyViolationError, LimitExceededError,
        SandboxUnavailableError, SandboxSpawnError.
        """
        if not self._accepting:
            raise SandboxSpawnError("the server is shutting down; retry on another replica")
        command = request.command
        argv = command_argv(command)
        env = validate_env(request.environment)
        cwd = sandbox_cwd(request.working_directory)
        timeout = checked_timeout(request.timeout_seconds, self.settings)
        limits = self.limits.tighten(request.sandbox_config)
        egress = self.egress_of(limits)
        if self.backend.unavailable_reason is not None:
            raise SandboxUnavailableError(
                f"sandbox unavailable: {self.backend.unavailable_reason} "
                f"(run `{cli_name()} doctor`)"
            )

        execution_id = await self.slots.take(owner)
        execution = self._pending(
            owner,
            execution_id,
            limits,
            command=command,
            interactive=request.interactive,
            working_directory=cwd,
            timeout_seconds=timeout,
        )
        spawn_started = time.perf_counter()
        self._spawning[owner] = self._spawning.get(owner, 0) + 1  # (no await since: see busy)
        bridge: OpenBridge | None = None
        try:
            workspace, _ = await self.workspaces.ensure(workspace_name(owner), owner.principal)
            bridge = await open_bridge(self.bridges, owner, request.servers, execution)
            image = await self.images.for_call(owner, request.image) if self.images else None
            process = await self.pool.spawn(
                SandboxSpec(
                    argv=argv,
                    workspace=workspace,
                    limits=limits,
                    env=bridged_env(env, bridge),
                    cwd=cwd,
                    interactive=request.interactive,
                    timeout=timeout,
                    egress=granted(egress, owner, limits, execution),
                    on_denied=self.network_denied(execution),
                    bridge_dir=bridge.directory if bridge is not None else None,
                    image=image,
                )
            )
            if bridge is not None:
                process.add_closer(bridge.aclose)
        except BaseException:
            if bridge is not None:
                await asyncio.shield(bridge.aclose())
            self.slots.give_back(owner)
            self.cluster.finished(execution)
            self.workspaces.check_damage(workspace_name(owner))  # (what failed may be its disk)
            raise
        finally:  # (in _running below before any await)
            left = self._spawning[owner] - 1
            if left:
                self._spawning[owner] = left
            else:
                del self._spawning[owner]
        self.metrics.spawn.observe(time.perf_counter() - spawn_started)
        self.metrics.started.inc()
        self.slots.started()
        self._evict_soon()
        self._executions[execution_id] = execution
        self._running[execution_id] = execution
        with logger.contextualize(execution_id=execution_id):
            logger.info("execution started principal={} interactive={} timeout={:g}s",
                        owner.principal, request.interactive, timeout)  # fmt: skip
        self.supervisor.spawn("execution output", execution.attach(process))
        self.supervisor.spawn("execution release", self._release_when_done(execution))
        return execution

    async def register_call(
        self, owner: Owner, language: str, code: str, timeout_seconds: float | None
    ) -> Execution:
        """An interpreter call as an execution: listed, polled, mirrored and cancelled like
        any; pending until its interpreter takes it (interpreters/manager.py runs it).

        Raises InvalidRequestError, LimitExceededError, SandboxSpawnError (shutting down).
        """
        if not self._accepting:
            raise SandboxSpawnError("the server is shutting down; retry on another replica")
        timeout = checked_timeout(timeout_seconds, self.settings)
        execution_id = await self.slots.take(owner)
        self.slots.started()
        execution = self._pending(
            owner,
            execution_id,
            self.limits,
            command=code,
            language=language,
            timeout_seconds=timeout,
        )
        self._evict_soon()
        self._executions[execution_id] = execution
        self._running[execution_id] = execution
        self.metrics.started.inc()
        self.supervisor.spawn("execution release", self._release_when_done(execution))
        return execution

    def _pending(
        self, owner: Owner, execution_id: str, limits: SandboxLimits, **fields: Any
    ) -> Execution:
        """A new execution, pending, told to the cluster whenever it changes."""
        info = ExecutionInfo(
            execution_id=execution_id,
            status=ExecutionStatus.PENDING,
            principal=owner.principal,
            session_id=owner.session_id,
            replica_id=self.replica_id,
            incarnation=self.incarnation,
            limits=self._limits_dict if limits is self.limits else limits.as_dict(),
            created_at=time.time(),
            **fields,
        )
        execution = Execution(info, owner, limits.output_bytes)
        execution.listeners.append(self.cluster.changed)
        return execution

    async def _release_when_done(self, execution: Execution) -> None:
        await execution.finished.wait()
        self._running.pop(execution.execution_id, None)
        self.slots.ended(execution.owner)
        self.cluster.finished(execution)
        # (A sandbox's own writes that met a failing filesystem turn its mount read-only:
        # found when the execution ends, not at the session's next call.)
        self.workspaces.check_damage(workspace_name(execution.owner))
        self.metrics.count_finished(execution.info)
        if execution.info.stdout_bytes + execution.info.stderr_bytes > TRIM_AFTER_BYTES:
            _release_freed_memory()  # big outputs leave freed heap behind; give it back
        with logger.contextualize(execution_id=execution.execution_id):
            logger.info(
                "execution finished status={} exit_code={} reason={} duration_ms={}",
                execution.status.value,
                execution.info.exit_code,
                execution.info.reason,
                execution.info.duration_ms,
            )

    # -- reading and control -----------------------------------------------------------------

    def get(self, owner: Owner, execution_id: str) -> Execution:
        """The caller's execution on this replica.

        Raises ExecutionNotFoundError (also for other owners' ids: they look unknown).
        """
        execution = self._executions.get(execution_id) if is_execution_id(execution_id) else None
        if execution is None or execution.owner != owner:
            raise ExecutionNotFoundError(f"execution {shown_id(execution_id)} not found")
        return execution

    def lookup(self, owner: Owner, execution_id: str) -> Execution | None:
        """The caller's execution if this replica holds it (None: not here, or another
        owner's); refreshes its TTLs in the store."""
        local = self._executions.get(execution_id) if is_execution_id(execution_id) else None
        if local is None:
            return None
        if local.owner != owner:
            raise ExecutionNotFoundError(f"execution {shown_id(execution_id)} not found")
        self.cluster.changed(local)
        return local

    async def read_output(
        self,
        owner: Owner,
        execution_id: str,
        after: int = 0,
        limit: int = MAX_EVENTS_PER_READ,
        wait: float = 0,
    ) -> OutputPage:
        """Events of a local execution after the cursor; with `wait`, block up to that long
        for new ones. Raises ExecutionNotFoundError, InvalidRequestError."""
        after, limit, wait = checked_read(after, limit, wait, self.settings.max_wait)
        return await read_page(self.get(owner, execution_id), after, limit, wait)

    async def status(self, owner: Owner, execution_id: str) -> ExecutionInfo:
        """A local execution's metadata. Raises ExecutionNotFoundError."""
        return self.get(owner, execution_id).info

    async def write_stdin(self, execution: Execution, data: str, close: bool) -> int:
        """Write to a local interactive execution's stdin (see Execution.write_stdin)."""
        written = await execution.write_stdin(data, close)
        self.cluster.changed(execution)
        return written

    async def cancel_local(self, execution: Execution, force: bool) -> bool:
        """Stop a local execution and its whole tree; whether it had already finished."""
        was_finished = execution.status.finished
        await execution.cancel(force=force, grace=self.settings.cancel_grace)
        return was_finished

    def local_infos(self, owner: Owner) -> builtins.list[ExecutionInfo]:
        """The owner's executions this replica holds."""
        return [e.info for e in self._executions.values() if e.owner == owner]

    def running(self) -> builtins.list[Execution]:
        return list(self._running.values())

    async def list(self, owner: Owner, status: str | None = None) -> builtins.list[ExecutionInfo]:
        """The owner's local executions, newest first (optionally of one status)."""
        infos = [i for i in self.local_infos(owner) if status is None or i.status == status]
        return sorted(infos, key=lambda i: i.created_at, reverse=True)

    def heartbeat(self) -> dict[str, Any]:
        """This replica's part of its heartbeat."""
        return {
            "replica_id": self.replica_id,
            "address": f"{self.settings.host}:{self.settings.port}",
            "started_at": self.started_at,
            "incarnation": self.incarnation,
            "running_executions": len(self._running),
            "last_seen": time.time(),
        }

    # -- retention ---------------------------------------------------------------------------

    def _evict_soon(self) -> None:
        """Evict now if the last eviction is over a second old: between the periodic sweeps,
        executions that each keep their output limit must not add up past the byte bound."""
        now = time.monotonic()
        if now - self._evicted_at >= 1.0:
            self._evicted_at = now
            self.evict()

    def evict(self, now: float | None = None) -> int:
        """Drop finished executions past retention, and past the count cap (taking from the
        principal that holds the most first, so no one can push out another's); returns how
        many were dropped."""
        now = time.time() if now is None else now
        settings = self.settings
        doomed = evicted(
            self._executions.values(),
            now,
            settings.retention_seconds,
            settings.max_retained,
            settings.retained_output_mb * 1024 * 1024,
        )
        for execution_id in doomed:
            del self._executions[execution_id]
            self.cluster.forgotten(execution_id)
        return len(doomed)

    async def _evict_step(self) -> None:
        self.evict()
        self.workspaces.disk.status()  # (logs a crossing of the free-space floor)
        await self.workspaces.sweep()


def _release_freed_memory() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
