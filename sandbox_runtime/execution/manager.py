"""The ExecutionManager: one per process; owns every execution, its slot and its retention."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.errors import (
    ExecutionNotFoundError,
    InvalidRequestError,
    LimitExceededError,
    SandboxRuntimeError,
    SandboxSpawnError,
    SandboxUnavailableError,
)
from sandbox_runtime.execution.execution import Execution, Owner
from sandbox_runtime.execution.models import ExecutionInfo, ExecutionStatus, OutputEvent
from sandbox_runtime.sandbox import (
    BackendConfig,
    BubblewrapBackend,
    SandboxSpec,
    sandbox_cwd,
    shell_argv,
    validate_command,
    validate_env,
)

MAX_EVENTS_PER_READ = 1000
MAX_BYTES_PER_READ = 1024 * 1024


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

    def __init__(self, settings: Settings, backend: BubblewrapBackend | None = None) -> None:
        self.settings = settings
        self.limits = settings.limits()
        self.backend = backend or BubblewrapBackend(
            BackendConfig(
                limits=self.limits,
                sandbox_user=settings.sandbox_user,
                workspace_root=settings.state_dir / "workspaces",
                bwrap_path=settings.bwrap_path,
                group_name=f"srt-{settings.replica_id}",
            )
        )
        self.replica_id = settings.replica_id
        self.started_at = time.time()
        self._executions: dict[str, Execution] = {}
        self._running: dict[str, Execution] = {}
        self._reserved = 0
        self._per_owner: dict[Owner, int] = {}
        self._accepting = False
        self._evictor: asyncio.Task[None] | None = None
        self._shutdown: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[Execution, list[OutputEvent]], None]] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.backend.start()
        self._accepting = True
        self._evictor = asyncio.get_running_loop().create_task(self._evict_forever())

    async def shutdown(self) -> None:
        """Stop accepting, stop every execution (politely, then by force), record final states.

        Idempotent: a second call waits for the first.
        """
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(self._shutdown_once())
        await asyncio.shield(self._shutdown)

    async def _shutdown_once(self) -> None:
        self._accepting = False
        running = list(self._running.values())
        if running:
            logger.info("shutdown: stopping {} running executions", len(running))
        for execution in running:
            if execution.process is not None:
                execution.process.stop_in_background(self.settings.shutdown_grace, "shutdown")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(e.finished.wait() for e in running)),
                self.settings.shutdown_grace + 5,
            )
        if self._evictor is not None:
            self._evictor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._evictor
        await self.backend.close()

    @property
    def sandbox_status(self) -> str:
        return "ok" if self.backend.unavailable_reason is None else "unavailable"

    @property
    def running_count(self) -> int:
        return len(self._running)

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
        if self.backend.unavailable_reason is not None:
            raise SandboxUnavailableError(
                f"sandbox unavailable: {self.backend.unavailable_reason} "
                "(run `srt-mcp-server doctor`)"
            )

        # Take the slot before the first await: no lock is held across the spawn.
        if len(self._running) + self._reserved >= self.settings.max_concurrent:
            raise LimitExceededError(
                f"the server is running its maximum of {self.settings.max_concurrent} "
                "executions; wait for one to finish or cancel one"
            )
        if self._per_owner.get(owner, 0) >= self.settings.max_per_session:
            raise LimitExceededError(
                f"this session is running its maximum of {self.settings.max_per_session} "
                "executions; wait for one to finish or cancel one"
            )
        self._reserved += 1
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        execution_id = uuid.uuid4().hex
        info = ExecutionInfo(
            execution_id=execution_id,
            status=ExecutionStatus.PENDING,
            principal=owner.principal,
            session_id=owner.session_id,
            replica_id=self.replica_id,
            command=command,
            interactive=request.interactive,
            working_directory=cwd,
            timeout_seconds=timeout,
            limits=limits.as_dict(),
            created_at=time.time(),
        )
        execution = Execution(info, owner, limits.output_bytes)
        execution.listeners.extend(self.listeners)
        try:
            workspace = self.backend.create_workspace(workspace_name(owner))
            process = await self.backend.spawn(
                SandboxSpec(
                    argv=argv,
                    workspace=workspace,
                    limits=limits,
                    env=env,
                    cwd=cwd,
                    interactive=request.interactive,
                    timeout=timeout,
                )
            )
        except BaseException:
            self._reserved -= 1
            self._release_owner(owner)
            raise
        self._reserved -= 1
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

    def _release_owner(self, owner: Owner) -> None:
        left = self._per_owner.get(owner, 0) - 1
        if left > 0:
            self._per_owner[owner] = left
        else:
            self._per_owner.pop(owner, None)

    async def _release_when_done(self, execution: Execution) -> None:
        await execution.finished.wait()
        self._running.pop(execution.execution_id, None)
        self._release_owner(execution.owner)
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
        """The caller's execution. Raises ExecutionNotFoundError (also for other owners' ids)."""
        execution = self._executions.get(execution_id) if isinstance(execution_id, str) else None
        if execution is None or execution.owner != owner:
            raise ExecutionNotFoundError(f"execution {execution_id!r} not found")
        return execution

    async def read_output(
        self,
        owner: Owner,
        execution_id: str,
        after: int = 0,
        limit: int = MAX_EVENTS_PER_READ,
        wait: float = 0,
    ) -> OutputPage:
        """Events after the cursor; with `wait`, block up to that long for new ones."""
        execution = self.get(owner, execution_id)
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidRequestError("the cursor (after / last_event_id) must be an integer >= 0")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequestError("limit must be a positive integer")
        limit = min(limit, MAX_EVENTS_PER_READ)
        if wait:
            await execution.wait_for_events(after, min(float(wait), self.settings.max_wait))
        events, has_more = execution.events_after(after, limit, MAX_BYTES_PER_READ)
        next_cursor = events[-1].seq if events else max(after, execution.first_seq - 1)
        if next_cursor > execution.info.last_seq:
            next_cursor = execution.info.last_seq
        return OutputPage(
            info=execution.info,
            events=events,
            next_cursor=next_cursor,
            has_more=has_more,
            first_available=execution.first_seq,
        )

    async def send_stdin(self, owner: Owner, execution_id: str, data: str, close: bool) -> int:
        execution = self.get(owner, execution_id)
        if not isinstance(data, str):
            raise InvalidRequestError("input_data must be a string")
        return await execution.write_stdin(data, close)

    async def cancel(self, owner: Owner, execution_id: str, force: bool = False) -> Execution:
        """Stop an execution and its whole tree; a finished one is returned as it is."""
        execution = self.get(owner, execution_id)
        await execution.cancel(force=force, grace=self.settings.cancel_grace)
        return execution

    def list(
        self, owner: Owner, status: str | None = None, limit: int = 100
    ) -> list[ExecutionInfo]:
        if status is not None:
            try:
                wanted: ExecutionStatus | None = ExecutionStatus(status)
            except ValueError:
                names = ", ".join(s.value for s in ExecutionStatus)
                raise InvalidRequestError(f"unknown status {status!r}; one of {names}") from None
        else:
            wanted = None
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequestError("limit must be a positive integer")
        out = [
            e.info
            for e in self._executions.values()
            if e.owner == owner and (wanted is None or e.status == wanted)
        ]
        out.sort(key=lambda i: i.created_at, reverse=True)
        return out[: min(limit, 1000)]

    # -- retention ---------------------------------------------------------------------------

    def evict(self, now: float | None = None) -> int:
        """Drop finished executions past retention (or past the count cap); returns how many."""
        now = time.time() if now is None else now
        finished = [e for e in self._executions.values() if e.status.finished]
        finished.sort(key=lambda e: e.info.finished_at or 0)
        excess = len(finished) - self.settings.max_retained
        dropped = 0
        for i, execution in enumerate(finished):
            expired = (execution.info.finished_at or 0) + self.settings.retention_seconds <= now
            if expired or i < excess:
                del self._executions[execution.execution_id]
                dropped += 1
        if dropped:
            self._remove_idle_workspaces()
        return dropped

    def _remove_idle_workspaces(self) -> None:
        live = {workspace_name(e.owner) for e in self._executions.values()}
        root = self.backend.config.workspace_root
        with contextlib.suppress(OSError):
            for path in root.iterdir():
                if path.name not in live:
                    self.backend.remove_workspace(path)

    async def _evict_forever(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, max(1.0, self.settings.retention_seconds / 4)))
            try:
                self.evict()
            except SandboxRuntimeError:
                logger.exception("eviction failed")


def workspace_name(owner: Owner) -> str:
    """The directory name of an owner's workspace: a hash, so ids never reach the filesystem."""
    digest = hashlib.sha256(f"{owner.principal}\0{owner.session_id}".encode()).hexdigest()
    return f"ws-{digest[:32]}"


_manager: ExecutionManager | None = None


def get_manager() -> ExecutionManager:
    """The process's ExecutionManager (created in the ASGI lifespan)."""
    if _manager is None:
        raise SandboxRuntimeError("the execution manager is not running")
    return _manager


def set_manager(manager: ExecutionManager | None) -> None:
    global _manager
    _manager = manager
