"""The ExecutionManager: one per process; owns every execution, its slot and its retention."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import ctypes
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.domain.models import (
    EventType,
    ExecutionInfo,
    ExecutionStatus,
    OutputEvent,
    is_execution_id,
    new_execution_id,
    shown_id,
)
from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.egress.supervisor import DeniedHandler, EgressProxy
from sandbox_runtime.errors import (
    ExecutionNotFoundError,
    InvalidRequestError,
    LimitExceededError,
    SandboxSpawnError,
    SandboxUnavailableError,
)
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.files.workspaces import WorkspaceStore, loop_devices_under
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.sandbox import (
    BackendConfig,
    BubblewrapBackend,
    SandboxSpec,
    sandbox_cwd,
    shell_argv,
    validate_command,
    validate_env,
)
from sandbox_runtime.sandbox.pool import SandboxPool
from sandbox_runtime.state.keys import session_key
from sandbox_runtime.state.mirror import Mirror
from sandbox_runtime.state.store import StateStore
from sandbox_runtime.supervisor import Supervisor

EVICT_LOOP = "eviction"
MAX_EVENTS_PER_READ = 1000
# JSON bytes of events per page. A tool reply carries them twice (structured content, and its
# JSON text escaped once more: up to 3x in all) and the official MCP client refuses an SSE
# event over 1 MiB, so a page stays well below a third of that.
MAX_BYTES_PER_READ = 256 * 1024
TRIM_AFTER_BYTES = 4 * 1024 * 1024

Admission = Callable[[Owner, str], Awaitable[None]]


@dataclass
class ExecuteRequest:
    command: str | list[str]
    timeout_seconds: float | None = None
    interactive: bool = False
    working_directory: str | None = None
    environment: dict[str, str] | None = None
    sandbox_config: dict[str, Any] | None = None


@dataclass
class OutputPage:
    info: ExecutionInfo
    events: list[OutputEvent]
    next_cursor: int
    has_more: bool
    first_available: int


class ExecutionManager:
    """Creates, runs, reads, controls and evicts executions. Create one per process."""

    def __init__(
        self,
        settings: Settings,
        backend: BubblewrapBackend | None = None,
        store: StateStore | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.settings = settings
        # The owner of every background loop of the manager and the parts it holds.
        self.supervisor = supervisor = supervisor or Supervisor()
        self.limits = settings.limits()
        # An execution's info copies it (most run with the server's limits: asdict is slow).
        self._limits_dict = self.limits.as_dict()
        self.backend = backend or BubblewrapBackend(
            BackendConfig(
                limits=self.limits,
                sandbox_user=settings.sandbox_user,
                workspace_root=settings.state_dir / "workspaces",
                bwrap_path=settings.bwrap_path,
                group_name=f"srt-{settings.replica_id}",
                cgroup_favordynmods=settings.cgroup_favordynmods,
                runtime_dir=_installed_runtime(settings.runtime_path()),
            ),
            supervisor,
        )
        self.workspaces = WorkspaceStore(
            self.backend.config.workspace_root,
            size_mb=settings.workspace_mb,
            inodes=settings.workspace_inode_count(),
            quota=settings.workspace_quota,
            retention_seconds=settings.workspace_retention_seconds,
            max_mounted=settings.max_mounted_workspaces,
            max_mounted_per_principal=settings.max_mounted_workspaces_per_principal,
            reserve=settings.workspace_reserve,
            min_free_mb=settings.min_free_disk_mb,
        )
        self.pool = SandboxPool(
            self.backend,
            self.limits,
            size=settings.pool_size,
            idle_seconds=settings.pool_idle_seconds,
            workspace_ready=lambda path: self.workspaces.is_ready(path.name),
            supervisor=supervisor,
        )
        self.egress_policy = settings.egress_policy()
        self.egress: EgressProxy | None = None
        self.replica_id = settings.replica_id
        self.started_at = time.time()
        # This process among those that run (or ran) as `replica_id`: liveness is per process.
        self.incarnation = uuid.uuid4().hex
        self._executions: dict[str, Execution] = {}
        self._evicted_at = 0.0  # (monotonic) the last eviction
        self._running: dict[str, Execution] = {}
        self._reserved = 0
        self._per_owner: dict[Owner, int] = {}
        self._spawning: dict[Owner, int] = {}  # executions between workspace and _running
        self._accepting = False
        self._shutdown: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[Execution, list[OutputEvent]], None]] = []
        # Hooks of the session layer (sessions/router.py): a cluster-wide admission check
        # before a sandbox starts, calls when one ends, work to do first on shutdown, and
        # fields to add to the heartbeat.
        self.admission: Admission | None = None
        self.on_finished: list[Callable[[Execution], None]] = []
        self.before_shutdown: list[Callable[[], Awaitable[None]]] = []
        self.heartbeat_fields: Callable[[], dict[str, Any]] = dict
        # Called when the shared store turns out to have lost what this replica wrote (Redis
        # restarted empty); the mirror writes the executions back itself.
        self.on_store_lost: list[Callable[[], None]] = []
        self.metrics = Metrics()
        if store is None and settings.redis_url:
            from sandbox_runtime.state.redis_store import RedisStore

            store = RedisStore(settings.redis_url, ttl_seconds=settings.retention_seconds)
        self.store = store
        self.mirror: Mirror | None = None
        if store is not None:
            self.mirror = Mirror(
                store,
                self.replica_id,
                session_key=lambda e: session_key(e.owner.principal, e.owner.session_id),
                heartbeat_payload=self._heartbeat_payload,
                heartbeat_ttl=settings.heartbeat_ttl,
                known=lambda: list(self._executions.values()),
                observe_lag=self.metrics.mirror_lag.observe,
                on_store_lost=lambda: [hook() for hook in self.on_store_lost],
                supervisor=supervisor,
            )
            self.listeners.append(self.mirror.on_events)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.backend.start()
        if self.mirror is not None:
            self.mirror.start()
        mirror = self.mirror
        self.metrics.bind(
            running=lambda: len(self._running),
            backlog=lambda: mirror.backlog if mirror is not None else 0,
            connected=lambda: 1 if mirror is not None and mirror.connected else 0,
        )
        if self.backend.unavailable_reason is None:
            try:
                self.workspaces.start(self.backend.sandbox_uid, self.backend.sandbox_gid)
            except SandboxUnavailableError as exc:
                self.backend.unavailable_reason = str(exc)
                logger.error("sandbox unavailable: {}", exc)
        # An owner's workspace is in use from the moment an execution asks for it (before its
        # sandbox starts) until the execution has ended: nothing may replace or unmount it.
        self.workspaces.busy.append(
            lambda: (
                {workspace_name(e.owner) for e in self._running.values() if not e.finished.is_set()}
                | {workspace_name(owner) for owner in self._spawning}
            )
        )
        # (A sandbox waiting in a workspace does not keep it: it is ended before the workspace
        # is unmounted or removed; but no warm interpreter takes it over.)
        self.workspaces.standby.append(self.pool.workspaces)
        self.workspaces.before_release.append(
            lambda name: self.pool.discard_workspace(self.workspaces.path(name))
        )
        self.workspaces.on_refused.append(lambda cap: self.metrics.rejections.labels(cap).inc())
        self.workspaces.on_damage.append(lambda event: self.metrics.damage.labels(event).inc())
        # (A sandbox's own writes that met a failing filesystem turn its mount read-only: found
        # when the execution ends, not at the session's next call.)
        self.on_finished.append(self._check_workspace)
        self.metrics.bind_disk(
            lambda: self.workspaces.disk.status().free_bytes,
            lambda: 1 if self.workspaces.disk.status().low else 0,
        )
        self.metrics.bind_workspaces(
            self.workspaces.mounted_by_kind, lambda: loop_devices_under(self.workspaces.root)
        )
        self.pool.on_hit.append(self.metrics.pool_hits.inc)
        self.pool.on_miss.append(lambda reason: self.metrics.pool_misses.labels(reason).inc())
        self.pool.on_refill.append(self.metrics.pool_refill.observe)
        self.metrics.pool_ready.set_function(lambda: self.pool.ready_count)
        if self.backend.unavailable_reason is None:
            if self.pool.size and self.backend.stub_problem is not None:
                logger.warning("no sandboxes started ahead of need: {}", self.backend.stub_problem)
            self.pool.start()
        if self.egress_policy.enabled and self.backend.private_dir is not None:
            await self._start_egress(self.backend.private_dir / "egress")
        self._accepting = True
        if self.backend.unavailable_reason is None:
            await self.workspaces.sweep()  # a previous run's, unused for the retention
        retention = self.settings.retention_seconds
        self.supervisor.every(EVICT_LOOP, min(60.0, max(1.0, retention / 4)), self._evict_step)

    async def shutdown(self) -> None:
        """Stop accepting, stop every execution (politely, then by force), record final states.

        Idempotent: a second call waits for the first.
        """
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(self._shutdown_once())
        await asyncio.shield(self._shutdown)

    async def _shutdown_once(self) -> None:
        self._accepting = False
        await self.pool.close()  # first: executions stopped now must not start more
        running = list(self._running.values())
        if running:
            logger.info("shutdown: stopping {} running executions", len(running))
        for execution in running:
            if execution.process is not None:
                execution.process.stop_in_background(self.settings.shutdown_grace, "shutdown")
        # Meanwhile the session layer's hooks (release the homes, stop the interpreters, whose
        # calls end with them): the executions' grace period is not spent waiting for them.
        outcomes = await asyncio.gather(
            *(hook() for hook in self.before_shutdown), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):  # must not keep executions running
                logger.opt(exception=outcome).error("shutdown hook failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(e.finished.wait() for e in running)),
                self.settings.shutdown_grace + 5,
            )
        await self.supervisor.stop(EVICT_LOOP)
        await self.backend.close()
        if self.egress is not None:
            await self.egress.close()
        await self.workspaces.close()
        if self.mirror is not None:
            try:
                await asyncio.wait_for(self.mirror.stop(), 15)
            except TimeoutError:
                logger.error("redis: the final flush did not finish in 15 s; giving up")

    async def _start_egress(self, base_dir: Path) -> None:
        egress = EgressProxy(
            self.settings.egress_settings(),
            base_dir,
            self.backend.sandbox_uid,
            self.backend.sandbox_gid,
        )
        egress.on_event.append(self._egress_event)
        await egress.start()
        self.egress = self.backend.egress = egress
        logger.info("egress allowed: {}", self.egress_policy.describe())

    def _egress_event(self, op: str, message: dict[str, Any]) -> None:
        if op == "denied":
            self.metrics.egress_denied.labels(str(message.get("reason"))).inc()
        elif op == "connected":
            self.metrics.egress_connections.inc()
        elif op == "closed":
            self.metrics.egress_bytes.inc(int(message.get("bytes") or 0))

    def egress_of(self, limits: SandboxLimits) -> EgressPolicy | None:
        """The egress policy of a sandbox under `limits`: the server's, narrowed as the caller
        asked. Raises InvalidRequestError, PolicyViolationError (asking for more)."""
        if not self.egress_policy.enabled or not limits.network:
            return None
        if limits.network_allow is None:
            return self.egress_policy
        narrowed = self.egress_policy.narrow(list(limits.network_allow))
        return narrowed if narrowed.enabled else None

    def network_denied(self, execution: Execution) -> DeniedHandler:
        """Where the proxy's denials for `execution`'s sandbox go: an event, and a log line."""

        def denied(host: str, port: int, reason: str) -> None:
            with logger.contextualize(execution_id=execution.execution_id):
                logger.info("network denied host={} port={} reason={}", host, port, reason)
            if not execution.status.finished:
                execution.emit(
                    EventType.NETWORK_DENIED,
                    host=host,
                    port=port,
                    reason=reason,
                    message=f"egress denied: {reason} ({host}:{port})",
                )

        return denied

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

    def _timeout(self, requested: float | None) -> float:
        if requested is None:
            return self.settings.timeout
        if isinstance(requested, bool) or not isinstance(requested, int | float):
            raise InvalidRequestError("timeout_seconds must be a number")
        if not math.isfinite(requested) or requested <= 0:
            raise InvalidRequestError(f"timeout_seconds must be positive, got {requested}")
        if requested > self.settings.max_timeout:
            raise InvalidRequestError(
                f"timeout_seconds={requested:g} exceeds the server's maximum of "
                f"{self.settings.max_timeout:g} seconds"
            )
        return float(requested)

    async def start_execution(self, owner: Owner, request: ExecuteRequest) -> Execution:
        """Validate, take a slot and start the sandbox.

        Raises InvalidRequestError, PolicyViolationError, LimitExceededError,
        SandboxUnavailableError, SandboxSpawnError.
        """
        if not self._accepting:
            raise SandboxSpawnError("the server is shutting down; retry on another replica")
        command = request.command
        if isinstance(command, str):
            if not command.strip():
                raise InvalidRequestError("command must not be empty")
            argv = shell_argv(command)
        elif isinstance(command, list):
            argv = command
        else:
            raise InvalidRequestError("command must be a string or a list of strings")
        validate_command(argv)
        env = validate_env(request.environment)
        cwd = sandbox_cwd(request.working_directory)
        timeout = self._timeout(request.timeout_seconds)
        limits = self.limits.tighten(request.sandbox_config)
        egress = self.egress_of(limits)
        if self.backend.unavailable_reason is not None:
            raise SandboxUnavailableError(
                f"sandbox unavailable: {self.backend.unavailable_reason} "
                "(run `srt-mcp-server doctor`)"
            )

        execution_id = await self._take_slot(owner)
        info = ExecutionInfo(
            execution_id=execution_id,
            status=ExecutionStatus.PENDING,
            principal=owner.principal,
            session_id=owner.session_id,
            replica_id=self.replica_id,
            incarnation=self.incarnation,
            command=command,
            interactive=request.interactive,
            working_directory=cwd,
            timeout_seconds=timeout,
            limits=self._limits_dict if limits is self.limits else limits.as_dict(),
            created_at=time.time(),
        )
        execution = Execution(info, owner, limits.output_bytes)
        execution.listeners.extend(self.listeners)
        spawn_started = time.perf_counter()
        self._spawning[owner] = self._spawning.get(owner, 0) + 1  # (no await since: see busy)
        try:
            workspace, _ = await self.workspaces.ensure(workspace_name(owner), owner.principal)
            process = await self.pool.spawn(
                SandboxSpec(
                    argv=argv,
                    workspace=workspace,
                    limits=limits,
                    env=env,
                    cwd=cwd,
                    interactive=request.interactive,
                    timeout=timeout,
                    egress=egress,
                    on_denied=self.network_denied(execution),
                )
            )
        except BaseException:
            self._reserved -= 1
            self._release_owner(owner)
            for hook in self.on_finished:
                hook(execution)
            raise
        finally:  # (in _running below before any await)
            left = self._spawning[owner] - 1
            if left:
                self._spawning[owner] = left
            else:
                del self._spawning[owner]
        self.metrics.spawn.observe(time.perf_counter() - spawn_started)
        self.metrics.started.inc()
        self._reserved -= 1
        self._evict_soon()
        self._executions[execution_id] = execution
        self._running[execution_id] = execution
        with logger.contextualize(execution_id=execution_id):
            logger.info(
                "execution started principal={} interactive={} timeout={:g}s",
                owner.principal,
                request.interactive,
                timeout,
            )
        execution.attach(process)
        asyncio.get_running_loop().create_task(self._release_when_done(execution))
        return execution

    async def _take_slot(self, owner: Owner) -> str:
        """Reserve a running slot (this replica's, the owner's, the principal's); a new id.

        The local slots are taken before the first await: no lock is held across a spawn.
        Raises LimitExceededError.
        """
        if len(self._running) + self._reserved >= self.settings.max_concurrent:
            self.metrics.rejections.labels("global").inc()
            raise LimitExceededError(
                f"the server is running its maximum of {self.settings.max_concurrent} "
                "executions; wait for one to finish or cancel one"
            )
        if self._per_owner.get(owner, 0) >= self.settings.max_per_session:
            self.metrics.rejections.labels("session").inc()
            shared = (
                " (the default session, shared by every connection of this token that names "
                "none: pass `session` to work apart)"
                if owner.session_id == "default"
                else ""
            )
            raise LimitExceededError(
                f"this session is running its maximum of {self.settings.max_per_session} "
                f"executions{shared}; wait for one to finish or cancel one"
            )
        self._reserved += 1
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        execution_id = new_execution_id()
        if self.admission is not None:
            try:
                await self.admission(owner, execution_id)
            except BaseException:
                self._reserved -= 1
                self._release_owner(owner)
                raise
        return execution_id

    async def register_call(
        self, owner: Owner, language: str, code: str, timeout_seconds: float | None
    ) -> Execution:
        """An interpreter call as an execution: listed, polled, mirrored and cancelled like
        any; pending until its interpreter takes it (interpreters/manager.py runs it).

        Raises InvalidRequestError, LimitExceededError, SandboxSpawnError (shutting down).
        """
        if not self._accepting:
            raise SandboxSpawnError("the server is shutting down; retry on another replica")
        timeout = self._timeout(timeout_seconds)
        execution_id = await self._take_slot(owner)
        self._reserved -= 1
        info = ExecutionInfo(
            execution_id=execution_id,
            status=ExecutionStatus.PENDING,
            principal=owner.principal,
            session_id=owner.session_id,
            replica_id=self.replica_id,
            incarnation=self.incarnation,
            command=code,
            language=language,
            timeout_seconds=timeout,
            limits=self._limits_dict,
            created_at=time.time(),
        )
        execution = Execution(info, owner, self.limits.output_bytes)
        execution.listeners.extend(self.listeners)
        self._evict_soon()
        self._executions[execution_id] = execution
        self._running[execution_id] = execution
        self.metrics.started.inc()
        asyncio.get_running_loop().create_task(self._release_when_done(execution))
        return execution

    def _release_owner(self, owner: Owner) -> None:
        left = self._per_owner.get(owner, 0) - 1
        if left > 0:
            self._per_owner[owner] = left
        else:
            self._per_owner.pop(owner, None)

    def _check_workspace(self, execution: Execution) -> None:
        self.workspaces.check_damage(workspace_name(execution.owner))

    async def _release_when_done(self, execution: Execution) -> None:
        await execution.finished.wait()
        self._running.pop(execution.execution_id, None)
        self._release_owner(execution.owner)
        for hook in self.on_finished:
            hook(execution)
        self._count_finished(execution.info)
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

    def _count_finished(self, info: ExecutionInfo) -> None:
        m = self.metrics
        m.finished.labels(info.status.value).inc()
        m.duration.observe((info.duration_ms or 0) / 1000)
        if info.reason in ("memory", "cpu", "file_size", "timeout"):
            m.limit_kills.labels(info.reason).inc()
        m.output_bytes.labels("stdout").inc(info.stdout_bytes)
        m.output_bytes.labels("stderr").inc(info.stderr_bytes)
        m.output_dropped.inc(info.dropped_bytes)

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
        if self.mirror is not None:
            self.mirror.mark(local)
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
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidRequestError("the cursor (after / last_event_id) must be an integer >= 0")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequestError("limit must be a positive integer")
        limit = min(limit, MAX_EVENTS_PER_READ)
        wait = min(max(0.0, float(wait or 0)), self.settings.max_wait)
        execution = self.get(owner, execution_id)
        if wait:
            await execution.wait_for_events(after, wait)
        events, has_more = execution.events_after(after, limit, MAX_BYTES_PER_READ)
        next_cursor = events[-1].seq if events else max(after, execution.first_seq - 1)
        next_cursor = min(next_cursor, execution.info.last_seq)
        return OutputPage(
            info=execution.info,
            events=events,
            next_cursor=next_cursor,
            has_more=has_more,
            first_available=execution.first_seq,
        )

    async def status(self, owner: Owner, execution_id: str) -> ExecutionInfo:
        """A local execution's metadata. Raises ExecutionNotFoundError."""
        return self.get(owner, execution_id).info

    async def write_stdin(self, execution: Execution, data: str, close: bool) -> int:
        """Write to a local interactive execution's stdin (see Execution.write_stdin)."""
        written = await execution.write_stdin(data, close)
        if self.mirror is not None:
            self.mirror.mark(execution)
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

    def _heartbeat_payload(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "address": f"{self.settings.host}:{self.settings.port}",
            "started_at": self.started_at,
            "incarnation": self.incarnation,
            "running_executions": len(self._running),
            "last_seen": time.time(),
            **self.heartbeat_fields(),
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
        finished = [e for e in self._executions.values() if e.status.finished]
        doomed = {
            e.execution_id
            for e in finished
            if (e.info.finished_at or 0) + self.settings.retention_seconds <= now
        }
        kept = [e for e in finished if e.execution_id not in doomed]
        by_principal: dict[str, builtins.list[Execution]] = {}
        for e in sorted(kept, key=lambda e: e.info.finished_at or 0):
            by_principal.setdefault(e.owner.principal, []).append(e)
        for _ in range(len(kept) - self.settings.max_retained):
            heaviest = max(by_principal.values(), key=len)
            doomed.add(heaviest.pop(0).execution_id)
        # Then bytes: in all, and per principal (half the total, so no one pushes out all).
        budget = self.settings.retained_output_mb * 1024 * 1024
        held = {p: sum(e.retained_bytes for e in es) for p, es in by_principal.items()}
        total = sum(held.values())
        while total > budget or max(held.values(), default=0) > budget // 2:
            principal = max(held, key=lambda p: held[p])
            oldest = by_principal[principal].pop(0)
            doomed.add(oldest.execution_id)
            held[principal] -= oldest.retained_bytes
            total -= oldest.retained_bytes
        for execution_id in doomed:
            del self._executions[execution_id]
            if self.mirror is not None:
                self.mirror.forget(execution_id)
        return len(doomed)

    async def _evict_step(self) -> None:
        self.evict()
        self.workspaces.disk.status()  # (logs a crossing of the free-space floor)
        await self.workspaces.sweep()


def _installed_runtime(path: Path) -> Path | None:
    """The runtime directory if a runtime is installed there (bound into every sandbox)."""
    from sandbox_runtime.interpreters.runtime import MANIFEST

    return path if (path / MANIFEST).is_file() else None


def _release_freed_memory() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
