"""The InterpreterManager: one kernel per (owner, language), its calls, its life and its pool.

Each run_code call is an execution (id, events, status, Redis mirror, cancel) that waits in
its interpreter's bounded queue, then runs there. A timeout or a cancel interrupts the call
and keeps the interpreter; one that does not stop within the grace period is killed, and the
call says its state is lost. Interpreters are bounded per replica and per principal, stopped
when idle, started ahead of need from a small warm pool, and never outlive the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.models import EventType, ExecutionStatus
from sandbox_runtime.domain.owner import Owner, session_name, workspace_name
from sandbox_runtime.errors import (
    InvalidRequestError,
    LimitExceededError,
    SandboxRuntimeError,
    SandboxUnavailableError,
)
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.interpreters.kernel import (
    FLOODED,
    MESSAGE_MAX_BYTES,
    KernelDiedError,
    SandboxedKernel,
)
from sandbox_runtime.interpreters.runtime import KernelSpec, Runtime, load_runtime
from sandbox_runtime.sandbox import SandboxLimits, validate_env

MAX_CODE_BYTES = 1024 * 1024
QUEUE_LIMIT = 16  # calls waiting for one interpreter
# One MIME value kept in an execution's events. A reply carries it about twice, and the
# official MCP client refuses a message over 1 MiB: a plot is tens of KB.
MAX_BUNDLE_BYTES = 256 * 1024
MAX_BUNDLE_ENTRIES = 32  # MIME types of one result
MAX_TEXT_CHARS = 8192  # an exception's name, value and each traceback line; a prompt
REAP_LOOP = "interpreter reaping"
REAP_INTERVAL = 10.0
ENDED_REMEMBERED = 10_000
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
SLOT_PREFIX = "slot-"  # workspaces of pooled interpreters, before a session takes one

Key = tuple[Owner, str]


@dataclass
class Interpreter:
    """A running kernel of one (owner, language) and its queue."""

    owner: Owner
    language: str
    kernel: SandboxedKernel
    limits: SandboxLimits
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    calls: int = 0
    current: Execution | None = None  # the call running now


class CallRun:
    """One run_code call's runner: stdin answers its input requests; cancel interrupts it."""

    def __init__(self, manager: InterpreterManager, execution: Execution) -> None:
        self.manager = manager
        self.execution = execution
        self.interpreter: Interpreter | None = None
        self.awaiting_input = False
        self.stop_reason: str | None = None  # "cancelled" / "timeout" once asked to stop
        self.task: asyncio.Task[None] | None = None
        self.call: asyncio.Future[Any] | None = None  # the kernel's execute, once it runs
        self.lost_state = False

    async def write_stdin(self, data: str, close: bool) -> int:
        if not isinstance(data, str):
            raise InvalidRequestError("input_data must be a string")
        if self.interpreter is None or not self.awaiting_input:
            raise InvalidRequestError(
                f"execution {self.execution.execution_id} is not waiting for input "
                "(an input_request event says when it is)"
            )
        self.awaiting_input = False
        try:
            self.interpreter.kernel.input_reply(data[:-1] if data.endswith("\n") else data)
        except KernelDiedError as exc:
            raise InvalidRequestError(
                f"execution {self.execution.execution_id}'s interpreter is gone: {exc}"
            ) from exc
        return len(data.encode("utf-8", "surrogatepass"))

    async def cancel(self, force: bool, grace: float) -> None:
        await self.manager.stop_call(self, "cancelled", force, grace)


class InterpreterManager:
    """Owns every interpreter of this replica. Create one per process, after the manager."""

    def __init__(self, settings: Settings, manager: ExecutionManager) -> None:
        self.settings = settings
        self.manager = manager
        self.metrics = manager.metrics
        self.runtime_dir = settings.runtime_path()
        self.runtime: Runtime | None = load_runtime(self.runtime_dir)
        self.kernels_root = settings.state_dir / "kernels"
        self._interpreters: dict[Key, Interpreter] = {}
        self._starting: dict[Key, asyncio.Task[Interpreter]] = {}
        # Starts handing a warm kernel their workspace, with the kernel's slot (out of the
        # pool meanwhile, still the kernel's: in use).
        self._adopting: dict[Key, str] = {}
        # Kernels being stopped, with their workspace: still holding it until they are gone.
        self._stopping: dict[asyncio.Task[None], str] = {}
        self._ended: OrderedDict[Key, str] = OrderedDict()
        self._warm: dict[str, list[tuple[SandboxedKernel, Path]]] = {}
        self._refills: set[asyncio.Task[None]] = set()
        self._reaping = False
        self._closed = False
        self.metrics.bind_interpreters(self._gauges)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        # A previous server's kernel directories (its kernels died with it).
        shutil.rmtree(self.kernels_root, ignore_errors=True)
        workspaces = self.manager.workspaces
        workspaces.remove_all(SLOT_PREFIX)  # a previous server's pooled kernels' workspaces
        workspaces.busy.append(self._busy_workspaces)
        self.manager.supervisor.every(REAP_LOOP, REAP_INTERVAL, self._reap)
        self._reaping = True
        if self.runtime is not None and self.manager.backend.unavailable_reason is None:
            for language, count in self.settings.warm_interpreters().items():
                if language in self.runtime.kernels:
                    for _ in range(count):
                        self._refill(language)

    def _busy_workspaces(self) -> set[str]:
        """Workspaces an interpreter (or a pooled one) runs in: not to unmount or remove."""
        names = {workspace_name(owner) for owner, _ in self._interpreters}
        # (A start adopting a warm kernel is not a user of its own workspace: adopt checks that
        # nothing else uses it. Another language's start for the same session is one.)
        names |= {workspace_name(key[0]) for key in self._starting if key not in self._adopting}
        names |= {slot.name for pool in self._warm.values() for _, slot in pool}
        names |= set(self._adopting.values())
        names |= set(self._stopping.values())
        return names

    async def aclose(self) -> None:
        """Stop every interpreter (the server is stopping). Idempotent."""
        self._closed = True
        if self._reaping:
            await self.manager.supervisor.stop(REAP_LOOP)
            self._reaping = False
        starting = [*self._refills, *self._starting.values()]
        for task in starting:
            task.cancel()
        kernels = [i.kernel for i in self._interpreters.values()]
        kernels += [k for pool in self._warm.values() for k, _ in pool]
        self._interpreters.clear()
        self._warm.clear()
        await asyncio.gather(*(k.stop() for k in kernels), return_exceptions=True)
        # A kernel cancelled while it started may have left its directory: every kernel is
        # stopped now, so none of them is in use.
        await asyncio.gather(*starting, return_exceptions=True)
        with contextlib.suppress(OSError):
            for leftover in self.kernels_root.iterdir():
                shutil.rmtree(leftover, ignore_errors=True)

    def _gauges(self) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for interpreter in self._interpreters.values():
            state = "busy" if interpreter.busy else "idle"
            out[(interpreter.language, state)] = out.get((interpreter.language, state), 0) + 1
        for language, pool in self._warm.items():
            out[(language, "warm")] = len(pool)
        return out

    # -- languages ---------------------------------------------------------------------------

    def _spec(self, language: str) -> KernelSpec:
        if self.runtime is None:
            self.runtime = load_runtime(self.runtime_dir)  # installed since we started?
        if self.runtime is None:
            raise SandboxUnavailableError(
                f"no runtime is installed at {self.runtime_dir}: run `srt-mcp-server runtime "
                "install` (./scripts/serve does it on first use)"
            )
        if not isinstance(language, str) or language.lower() not in self.runtime.kernels:
            names = ", ".join(self.runtime.languages)
            raise InvalidRequestError(f"unknown language {language!r}; one of {names}")
        return self.runtime.kernels[language.lower()]

    def languages(self, owner: Owner) -> list[dict[str, Any]]:
        """Every language with its version, packages of note, and whether `owner` has an
        interpreter running."""
        runtime = self.runtime or load_runtime(self.runtime_dir)
        if runtime is None:
            return []
        manifest = runtime.manifest
        out = []
        for language in runtime.languages:
            spec = runtime.kernels[language]
            if spec.kernel == "deno":
                version, packages = manifest.get("deno"), {}
            elif language == "python":
                version, packages = manifest.get("python"), manifest.get("packages", {})
            else:
                version, packages = None, {}
            running = (owner, language) in self._interpreters
            out.append(
                {
                    "language": language,
                    "version": version,
                    "kernel": spec.display_name,
                    "running": running,
                    "packages": packages,
                }
            )
        return out

    # -- interpreters ------------------------------------------------------------------------

    async def _interpreter(
        self, owner: Owner, language: str, limits: SandboxLimits | None = None
    ) -> tuple[Interpreter, str | None]:
        """The owner's interpreter of `language`, started if need be (with `limits`, default
        the server's); with why this call did not find the one it expected (None: it did).

        Raises InvalidRequestError when a running interpreter has other limits than asked.
        """
        key = (owner, language)
        current = self._interpreters.get(key)
        if current is not None and current.kernel.alive:
            self._same_limits(current, limits)
            return current, None
        if current is not None:  # died since its last call (or the server stopped it)
            flooded = current.kernel.end_reason == FLOODED
            self._forget(key, "flooded" if flooded else "crashed")
            self.metrics.interpreter_events.labels(language, "flood" if flooded else "crash").inc()
        task = self._starting.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._start(owner, language, limits))
            self._starting[key] = task
            task.add_done_callback(lambda _: self._starting.pop(key, None))
        interpreter = await asyncio.shield(task)
        # A call that found another call starting it: the limits must agree with its own too.
        self._same_limits(interpreter, limits)
        reason = self._ended.pop(key, "first_call")
        return interpreter, reason

    @staticmethod
    def _same_limits(interpreter: Interpreter, limits: SandboxLimits | None) -> None:
        """Raises InvalidRequestError when `limits` (a caller's) differ from the running
        interpreter's: a tighter sandbox_config is never silently ignored."""
        if limits is not None and limits != interpreter.limits:
            raise InvalidRequestError(
                f"this session's {interpreter.language} interpreter runs with other limits "
                "than this sandbox_config; restart_interpreter with it (the state is lost) or "
                "leave sandbox_config out"
            )

    def _forget(self, key: Key, reason: str) -> None:
        interpreter = self._interpreters.pop(key, None)
        self._ended[key] = reason
        self._ended.move_to_end(key)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        if interpreter is not None:
            task = asyncio.get_running_loop().create_task(interpreter.kernel.stop())
            self._stopping[task] = workspace_name(key[0])
            task.add_done_callback(lambda done: self._stopping.pop(done, None))

    def _make_room(self, owner: Owner, language: str) -> None:
        """At the token's limit of interpreters, stop its least recently used idle one (that
        session's next call says `state_reset: evicted`); refuse only when all are busy."""
        limit = self.settings.max_interpreters_per_principal
        mine = [i for (o, _), i in self._interpreters.items() if o.principal == owner.principal]
        # Other starts in flight hold a slot too.
        starting = sum(
            1
            for key in self._starting
            if key[0].principal == owner.principal and key != (owner, language)
        )
        if len(mine) + starting < limit:
            return
        idle = [i for i in mine if not i.busy and i.waiting == 0]
        if idle and len(mine) + starting - 1 < limit:
            victim = min(idle, key=lambda i: i.last_used)
            self._forget((victim.owner, victim.language), "evicted")
            self.metrics.interpreter_events.labels(victim.language, "evicted").inc()
            logger.info("interpreter evicted for room language={}", victim.language)
            return
        self.metrics.rejections.labels("principal_interpreters").inc()
        held = ", ".join(sorted(f"{_session_of(i.owner)} ({i.language})" for i in mine)[:MAX_NAMED])
        raise LimitExceededError(
            f"this token runs its maximum of {limit} interpreters and all are running code or "
            f"starting: {held}; wait for one to finish, cancel_execution one of their calls, or "
            "restart_interpreter / a named session's idle timeout frees a slot"
        )

    async def _start(
        self, owner: Owner, language: str, limits: SandboxLimits | None = None
    ) -> Interpreter:
        spec = self._spec(language)
        limits = limits or self.manager.limits
        if self._closed or not self.manager.accepting:
            raise SandboxRuntimeError("the server is shutting down; retry on another replica")
        if len(self._interpreters) >= self.settings.max_interpreters:
            self.metrics.rejections.labels("interpreters").inc()
            raise LimitExceededError(
                f"this replica runs its maximum of {self.settings.max_interpreters} "
                "interpreters; restart_interpreter one you no longer need, or retry later"
            )
        self._make_room(owner, language)
        backend = self.manager.backend
        name = workspace_name(owner)
        # Pooled kernels run under the server's limits: a caller's tighter ones start a kernel.
        kernel = await self._adopt_warm(spec, owner) if limits == self.manager.limits else None
        warm = kernel is not None
        if kernel is not None:
            self.metrics.interpreter_events.labels(language, "warm_hit").inc()
        else:
            if self.settings.warm_interpreters().get(language):
                self.metrics.interpreter_events.labels(language, "warm_miss").inc()
            workspace, _ = await self.manager.workspaces.ensure(name, owner.principal)
            kernel = SandboxedKernel(
                backend, spec, workspace, limits, self.kernels_root,
                egress=self.manager.egress_of(limits), on_dropped=self._dropped,
            )  # fmt: skip
            await kernel.start()
        self.metrics.interpreter_events.labels(language, "start").inc()
        interpreter = Interpreter(owner, language, kernel, limits)
        kernel.on_denied = lambda host, port, reason: self._network_denied(
            interpreter, host, port, reason
        )
        self._interpreters[(owner, language)] = interpreter
        logger.info("interpreter started language={} warm={}", language, warm)
        return interpreter

    def _dropped(self, reason: str, size: int) -> None:
        self.metrics.interpreter_dropped.labels(reason).inc(size)

    def _network_denied(self, interpreter: Interpreter, host: str, port: int, reason: str) -> None:
        """A denial of the egress proxy for `interpreter`'s kernel: an event on the call it
        runs (only a log line between calls)."""
        if interpreter.current is not None:
            self.manager.network_denied(interpreter.current)(host, port, reason)
        else:
            logger.info("network denied host={} port={} reason={} (between calls)", host, port,
                        reason)  # fmt: skip

    async def _adopt_warm(self, spec: KernelSpec, owner: Owner) -> SandboxedKernel | None:
        """A pooled kernel, made this owner's by turning its slot workspace into the owner's:
        only for a session whose workspace is empty (a new session) and that nothing uses
        (no execution, other interpreter, file operation or sandbox waiting in it)."""
        pool = self._warm.get(spec.language)
        workspaces = self.manager.workspaces
        name = workspace_name(owner)
        key = (owner, spec.language)
        while pool:
            kernel, slot = pool.pop()
            self._refill(spec.language)
            if not kernel.alive or kernel.egress_lost:  # (dead, or its proxy socket died)
                asyncio.get_running_loop().create_task(kernel.stop())
                continue
            self._adopting[key] = slot.name
            try:
                adopted = await workspaces.adopt(slot.name, name, owner.principal)
            except (OSError, SandboxRuntimeError) as exc:
                logger.warning("could not hand a warm interpreter its workspace: {}", exc)
                adopted = False
            finally:
                self._adopting.pop(key, None)
            if not adopted:
                pool.append((kernel, slot))
                return None
            kernel.workspace = workspaces.path(name)
            return kernel
        return None

    def _refill(self, language: str) -> None:
        if self._closed or self.runtime is None:
            return
        wanted = self.settings.warm_interpreters().get(language, 0)
        pool = self._warm.setdefault(language, [])
        pending = sum(1 for t in self._refills if t.get_name() == language)
        if len(pool) + pending >= wanted:
            return
        task = asyncio.get_running_loop().create_task(self._warm_one(language), name=language)
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _warm_one(self, language: str) -> None:
        started = time.monotonic()
        backend = self.manager.backend
        try:
            slot, _ = await self.manager.workspaces.ensure(
                f"{SLOT_PREFIX}{secrets.token_hex(8)}", ahead=True
            )  # (at the replica's mount cap: no warm one, and no refusal counted)
        except SandboxRuntimeError as exc:
            logger.warning("no workspace for a warm {} interpreter: {}", language, exc)
            return
        kernel = SandboxedKernel(
            backend, self._spec(language), slot, self.manager.limits, self.kernels_root,
            egress=self.manager.egress_of(self.manager.limits), on_dropped=self._dropped,
        )  # fmt: skip
        try:
            await kernel.start()
        except Exception as exc:  # the pool stays short; calls start kernels themselves
            logger.warning("could not start a warm {} interpreter: {}", language, exc)
            with contextlib.suppress(OSError, SandboxRuntimeError):
                await self.manager.workspaces.remove(slot.name)
            return
        if self._closed:
            await kernel.stop()
            return
        self._warm.setdefault(language, []).append((kernel, slot))
        self.metrics.warm_refill.observe(time.monotonic() - started)

    async def restart(
        self, owner: Owner, language: str, sandbox_config: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Stop the owner's interpreter of `language` and start a fresh one (under the
        caller's tighter limits, if any). Raises PolicyViolationError, InvalidRequestError."""
        spec = self._spec(language)
        language = spec.language if language.lower() == spec.language else language.lower()
        limits = self.manager.limits.tighten(sandbox_config)
        self.manager.egress_of(limits)  # (refuses a widening before anything is stopped)
        key = (owner, language)
        interpreter = self._interpreters.get(key)
        if interpreter is not None:
            self._forget(key, "restarted")
            self.metrics.interpreter_events.labels(language, "restart").inc()
        fresh, _ = await self._interpreter(owner, language, limits)
        self._ended.pop(key, None)
        fresh.last_used = time.monotonic()
        return {"language": language, "restarted": interpreter is not None, "running": True}

    # -- calls -------------------------------------------------------------------------------

    async def run(
        self,
        owner: Owner,
        language: str,
        code: str,
        timeout_seconds: float | None,
        environment: dict[str, str] | None,
        sandbox_config: dict[str, Any] | None = None,
    ) -> tuple[Execution, str | None]:
        """Queue `code` on the owner's interpreter; the execution and the state_reset reason.
        `sandbox_config` tightens the limits of an interpreter this call starts.

        Raises InvalidRequestError, PolicyViolationError, LimitExceededError,
        SandboxUnavailableError, SandboxSpawnError.
        """
        spec = self._spec(language)
        language = spec.language if language.lower() == spec.language else language.lower()
        if not isinstance(code, str):
            raise InvalidRequestError("code must be a string")
        if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
            raise InvalidRequestError(f"code is over {MAX_CODE_BYTES} bytes")
        env = validate_env(environment)
        limits = self.manager.limits.tighten(sandbox_config) if sandbox_config else None
        if limits is not None:
            self.manager.egress_of(limits)  # (refuses a widening before anything starts)
        while True:
            interpreter, reset = await self._interpreter(owner, language, limits)
            # (Another start may have evicted it before this call resumed: start it again.)
            if self._interpreters.get((owner, language)) is interpreter:
                break
        if interpreter.waiting >= QUEUE_LIMIT:
            raise LimitExceededError(
                f"{QUEUE_LIMIT} calls already wait for this {language} interpreter; wait for "
                "them or cancel one"
            )
        interpreter.waiting += 1  # claimed before any await: _make_room never evicts it now
        try:
            execution = await self.manager.register_call(owner, language, code, timeout_seconds)
        except BaseException:
            interpreter.waiting -= 1
            raise
        run = CallRun(self, execution)
        execution.runner = run
        run.task = asyncio.get_running_loop().create_task(
            self._run_call(interpreter, run, _env_prelude(spec, env) + code)
        )
        return execution, reset

    async def _run_call(self, interpreter: Interpreter, run: CallRun, code: str) -> None:
        execution = run.execution
        try:
            async with interpreter.lock:
                interpreter.waiting -= 1
                if run.stop_reason is not None or execution.status.finished:
                    return  # cancelled while it waited
                interpreter.busy = True
                run.interpreter = interpreter
                interpreter.current = execution
                execution.begin_call()
                try:
                    await self._execute(interpreter, run, code)
                finally:
                    interpreter.current = None
                    interpreter.busy = False
                    interpreter.last_used = time.monotonic()
                    interpreter.calls += 1
        except Exception as exc:  # the root of a call's task: record, never lose the end
            logger.exception("interpreter call {} failed", execution.execution_id)
            if not execution.status.finished:
                execution.end_call(ExecutionStatus.FAILED, None, "error", f"internal error: {exc}")

    async def _execute(self, interpreter: Interpreter, run: CallRun, code: str) -> None:
        execution = run.execution
        errors: list[bool] = []

        def on_message(kind: str, content: dict[str, Any]) -> None:
            # (Everything here comes from code the server does not trust: bounded, counted.)
            if kind == "stream":
                stream = EventType.STDERR if content.get("name") == "stderr" else EventType.STDOUT
                execution.record_output(stream, str(content.get("text", "")))
            elif kind in ("display_data", "execute_result", "update_display_data"):
                data = content.get("data")
                bundle, size = _bounded_bundle(data if isinstance(data, dict) else {})
                count = content.get("execution_count")
                execution.record_event(
                    EventType.RESULT,
                    size,
                    bundle=bundle,
                    execution_count=count if isinstance(count, int) else None,
                )
            elif kind == "error":
                trace = content.get("traceback")
                lines = trace[-100:] if isinstance(trace, list) else []
                error = {
                    "name": _text(content.get("ename")),
                    "value": _text(content.get("evalue")),
                    "traceback": [ANSI.sub("", _text(t)) for t in lines],
                }
                if not errors:
                    errors.append(True)
                size = len(error["name"]) + len(error["value"]) + sum(map(len, error["traceback"]))
                execution.record_event(EventType.EXCEPTION, size, **error)
            elif kind == "input_request":
                run.awaiting_input = True
                prompt = _text(content.get("prompt"))
                execution.record_event(
                    EventType.INPUT_REQUEST,
                    len(prompt),
                    prompt=prompt,
                    password=bool(content.get("password")),
                )
            elif kind == "dropped":
                execution.record_dropped(
                    int(content["bytes"]),
                    "the interpreter sent output faster than it could be taken, or a message "
                    f"over {MESSAGE_MAX_BYTES} bytes: {content['bytes']} bytes of it dropped",
                )

        call = asyncio.ensure_future(interpreter.kernel.execute(code, on_message))
        run.call = call
        timeout = execution.info.timeout_seconds
        done, _ = await asyncio.wait({call}, timeout=timeout)
        if not done and run.stop_reason is None:
            await self.stop_call(run, "timeout", False, self.settings.cancel_grace)
        try:
            reply = await call
        except KernelDiedError as exc:
            if self._closed and run.stop_reason is None:  # stopped with the server (aclose)
                execution.end_call(
                    ExecutionStatus.CANCELLED, None, "shutdown", "server shutting down"
                )
                return
            key = (interpreter.owner, interpreter.language)
            if self._interpreters.get(key) is interpreter:
                flooded = interpreter.kernel.end_reason == FLOODED
                reason = "killed" if run.lost_state else "flooded" if flooded else "crashed"
                self._forget(key, reason)
                event = "flood" if flooded else "crash"
                self.metrics.interpreter_events.labels(interpreter.language, event).inc()
            message = (
                "the interpreter did not stop within the grace period and was killed: its "
                "state (variables, imports) is lost"
                if run.lost_state
                else str(exc)
                if interpreter.kernel.end_reason
                else f"the interpreter died: {exc}; its state is lost"
            )
            status = {
                "timeout": ExecutionStatus.TIMEOUT,
                "cancelled": ExecutionStatus.CANCELLED,
            }.get(run.stop_reason or "", ExecutionStatus.FAILED)
            execution.end_call(status, None, run.stop_reason or "crashed", message)
            return
        count = reply.get("execution_count")
        if isinstance(count, int):
            execution.info.execution_count = count
        if run.stop_reason == "timeout":
            execution.end_call(
                ExecutionStatus.TIMEOUT,
                None,
                "timeout",
                f"timed out after {execution.info.timeout_seconds:g} seconds and was "
                "interrupted; the interpreter keeps its state",
            )
        elif run.stop_reason == "cancelled":
            execution.end_call(ExecutionStatus.CANCELLED, None, "cancelled", "interrupted")
        else:
            failed = reply.get("status") == "error" or bool(errors)
            execution.end_call(ExecutionStatus.COMPLETED, 1 if failed else 0)

    async def stop_call(self, run: CallRun, reason: str, force: bool, grace: float) -> None:
        """Interrupt a call (or drop it from the queue); kill its interpreter if it does not
        stop within `grace` seconds, or at once with `force`."""
        if run.stop_reason is not None or run.execution.status.finished:
            return
        run.stop_reason = reason
        interpreter = run.interpreter
        if interpreter is None:  # still queued: it ends now, and is skipped when its turn comes
            run.execution.begin_call()
            status = ExecutionStatus.TIMEOUT if reason == "timeout" else ExecutionStatus.CANCELLED
            run.execution.end_call(status, None, reason, f"{reason} before it started")
            return
        call = run.call
        if not force and call is not None:
            interpreter.kernel.interrupt()
            await asyncio.wait({call}, timeout=grace)
        if call is None or not call.done():
            run.lost_state = True
            await interpreter.kernel.stop()

    # -- idle reaping --------------------------------------------------------------------------

    def _reap(self) -> None:
        self.reap_idle()

    def reap_idle(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        idle = self.settings.interpreter_idle_seconds
        doomed = [
            key
            for key, i in self._interpreters.items()
            if not i.busy and i.waiting == 0 and i.last_used + idle <= now
        ]
        for key in doomed:
            ended = self._interpreters[key].kernel.end_reason == FLOODED
            self._forget(key, "flooded" if ended else "idle")
            self.metrics.interpreter_events.labels(key[1], "reaped").inc()
        return len(doomed)


MAX_NAMED = 16


def _session_of(owner: Owner) -> str:
    """A session as callers name it, for messages."""
    return f"session {session_name(owner.session_id)!r}"


def _text(value: object) -> str:
    text = value if isinstance(value, str) else "" if value is None else str(value)
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + " [...]"


def _bounded_bundle(data: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A result's MIME bundle within bounds (MAX_BUNDLE_ENTRIES types, each value at most
    MAX_BUNDLE_BYTES, types' names at most 255 characters), and about how many bytes it holds."""
    out: dict[str, Any] = {}
    size = 0
    for mime, value in list(data.items())[:MAX_BUNDLE_ENTRIES]:
        mime = str(mime)[:255]
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > MAX_BUNDLE_BYTES:
            note = f"[{mime} output of {len(text)} bytes dropped: over {MAX_BUNDLE_BYTES} bytes]"
            out["text/plain"] = note
            size += len(note)
            continue
        out[mime] = value
        size += len(mime) + len(text)
    if len(data) > MAX_BUNDLE_ENTRIES:
        out["text/plain"] = f"[{len(data) - MAX_BUNDLE_ENTRIES} more MIME types dropped]"
    return out, size + 64 * len(out)


def _env_prelude(spec: KernelSpec, env: dict[str, str]) -> str:
    """Code that sets the caller's environment variables in the interpreter first."""
    if not env:
        return ""
    if spec.language == "python":
        return f"import os as _srt_os; _srt_os.environ.update({json.dumps(env)}); del _srt_os\n"
    if spec.language == "bash":
        return "".join(f"export {k}={_shell_quote(v)}\n" for k, v in env.items())
    if spec.kernel == "deno":
        return "".join(f"Deno.env.set({json.dumps(k)}, {json.dumps(v)});\n" for k, v in env.items())
    raise InvalidRequestError(f"environment is not supported for {spec.language}")


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"
