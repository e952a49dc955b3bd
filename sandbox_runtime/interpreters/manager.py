"""The InterpreterManager: one kernel per (owner, language), its calls, its life and its pool.

Each run_code call is an execution (id, events, status, Redis mirror, cancel) that waits in
its interpreter's bounded queue, then runs there. A timeout or a cancel interrupts the call
and keeps the interpreter; one that does not stop within the grace period is killed, and the
call says its state is lost. Interpreters are bounded per replica and per principal, stopped
when idle, started ahead of need from a small warm pool, and never outlive the server.

Here: the interpreters of this replica (finding, starting, bounding, evicting, reaping and
stopping them) and the calls' entry. Beside it: interpreter (one interpreter; which to evict),
calls (one call's run and end), outputs (a kernel's messages as events), warm_pool (kernels
started ahead) and kernel (one kernel in its sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from sandbox_runtime.config import Settings, cli_name
from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.domain.secrets import for_principal
from sandbox_runtime.errors import (
    InvalidRequestError,
    LimitExceededError,
    SandboxRuntimeError,
    SandboxUnavailableError,
)
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.interpreters import kernel_dirs
from sandbox_runtime.interpreters.calls import CallRun, run_call
from sandbox_runtime.interpreters.env_kernels import pool_spec, session_languages, session_spec
from sandbox_runtime.interpreters.interpreter import (
    Interpreter,
    Key,
    base_language,
    choose_eviction,
    same_limits,
    valid_instance,
)
from sandbox_runtime.interpreters.kernel import SandboxedKernel
from sandbox_runtime.interpreters.kernel_inbox import FLOODED
from sandbox_runtime.interpreters.outputs import env_prelude
from sandbox_runtime.interpreters.runtime import KernelSpec, Runtime, load_runtime
from sandbox_runtime.interpreters.warm_pool import SLOT_PREFIX, WarmPool
from sandbox_runtime.sandbox import SandboxLimits, validate_env
from sandbox_runtime.supervisor import outcome

T = TypeVar("T")
MAX_CODE_BYTES = 1024 * 1024
QUEUE_LIMIT = 16  # calls waiting for one interpreter
REAP_LOOP = "interpreter reaping"
REAP_INTERVAL = 10.0
ENDED_REMEMBERED = 10_000
STOP_WAIT = 10.0  # for interpreters stopped so that their failed workspace can be checked


class InterpreterManager:
    """Owns every interpreter of this replica. Create one per process, after the manager."""

    def __init__(self, settings: Settings, manager: ExecutionManager) -> None:
        self.settings = settings
        self.manager = manager
        self.supervisor = manager.supervisor
        self.metrics = manager.metrics
        self.runtime_dir = settings.runtime_path()
        self.runtime: Runtime | None = load_runtime(self.runtime_dir)
        self.kernels_root = settings.state_dir / "kernels"
        self._interpreters: dict[Key, Interpreter] = {}
        self._starting: dict[Key, asyncio.Task[Interpreter | Exception]] = {}
        # Kernels being stopped, with their workspace: still holding it until they are gone.
        self._stopping: dict[asyncio.Task[None], str] = {}
        self._ended: OrderedDict[Key, str] = OrderedDict()
        spec = lambda key: pool_spec(manager.images, key, self._spec)  # noqa: E731
        self.warm = WarmPool(settings, manager, spec, self._new_kernel)
        self._reaping = False
        self.closed = False  # (the server is stopping: aclose)
        self.metrics.bind_interpreters(self._gauges)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        # A previous server's kernel directories (its kernels died with it).
        kernel_dirs.clear(self.kernels_root)
        workspaces = self.manager.workspaces
        workspaces.remove_all(SLOT_PREFIX)  # a previous server's pooled kernels' workspaces
        workspaces.busy.append(self._busy_workspaces)
        workspaces.release_idle.append(self.stop_idle_in)
        self.supervisor.every(REAP_LOOP, REAP_INTERVAL, self._reap)
        self._reaping = True
        if self.runtime is not None and self.manager.backend.unavailable_reason is None:
            for language, count in self.settings.warm_interpreters().items():
                if language in self.runtime.kernels or "@" in language:
                    for _ in range(count):
                        self.warm.fill(language)

    def _busy_workspaces(self) -> set[str]:
        """Workspaces an interpreter (or a pooled one) runs in: not to unmount or remove."""
        names = {workspace_name(owner) for owner, _ in self._interpreters}
        # (A start adopting a warm kernel is not a user of its own workspace: adopt checks that
        # nothing else uses it. Another language's start for the same session is one.)
        adopting = self.warm.adopting
        names |= {workspace_name(key[0]) for key in self._starting if key not in adopting}
        names |= self.warm.workspaces()
        names |= set(self._stopping.values())
        return names

    async def aclose(self) -> None:
        """Stop every interpreter (the server is stopping). Idempotent."""
        self.closed = True
        if self._reaping:
            await self.supervisor.stop(REAP_LOOP)
            self._reaping = False
        refills, kernels = self.warm.close()
        starting: list[asyncio.Task[Any]] = [*refills, *self._starting.values()]
        for task in starting:
            task.cancel()
        kernels = [i.kernel for i in self._interpreters.values()] + kernels
        self._interpreters.clear()
        await asyncio.gather(*(k.stop() for k in kernels), return_exceptions=True)
        # A kernel cancelled while it started may have left its directory: every kernel is
        # stopped now, so none of them is in use.
        await asyncio.gather(*starting, return_exceptions=True)
        with contextlib.suppress(OSError):
            for leftover in self.kernels_root.iterdir():
                kernel_dirs.remove(leftover)

    def _gauges(self) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for interpreter in self._interpreters.values():
            state = "busy" if interpreter.busy else "idle"
            label = (base_language(interpreter.language), state)
            out[label] = out.get(label, 0) + 1
        for language, count in self.warm.counts().items():
            out[(language, "warm")] = count
        return out

    # -- languages ---------------------------------------------------------------------------

    def _spec(self, language: str, owner: Owner | None = None) -> KernelSpec:
        """The kernel of `language` (or of `LANGUAGE:INSTANCE`, one more interpreter of that
        language in the same session: the E2B edge's code contexts); the environment's for
        `owner`'s session on one (env_kernels.py)."""
        base = base_language(language) if isinstance(language, str) else ""
        if owner and (spec := session_spec(self.manager.images, owner, base.lower())):
            return spec
        if self.runtime is None:
            self.runtime = load_runtime(self.runtime_dir)  # installed since we started?
        if self.runtime is None:
            raise SandboxUnavailableError(
                f"no runtime is installed at {self.runtime_dir}: run `{cli_name()} runtime "
                "install` (./scripts/serve does it on first use)"
            )
        if base.lower() not in self.runtime.kernels or not valid_instance(language):
            names = ", ".join(self.runtime.languages)
            raise InvalidRequestError(f"unknown language {language!r}; one of {names}")
        return self.runtime.kernels[base.lower()]

    def languages(self, owner: Owner) -> list[dict[str, Any]]:
        """Every language with its version, packages of note, and whether `owner` has an
        interpreter running (its environment's, for a session on one: env_kernels.py)."""
        runtime = self.runtime or load_runtime(self.runtime_dir)
        if (env := session_languages(self.manager.images, owner, self._interpreters)) is not None:
            return env
        manifest = runtime.manifest if runtime is not None else {}
        out = []
        for language, spec in sorted(runtime.kernels.items()) if runtime is not None else []:
            if spec.kernel == "deno":
                version, packages = manifest.get("deno"), {}
            elif language == "python":
                version, packages = manifest.get("python"), manifest.get("packages", {})
            else:
                version, packages = None, {}
            running = (owner, language) in self._interpreters
            out.append({"language": language, "version": version, "kernel": spec.display_name,
                        "running": running, "packages": packages})  # fmt: skip
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
            same_limits(current, limits)
            return current, None
        if current is not None:  # died since its last call (or the server stopped it)
            flooded = current.kernel.end_reason == FLOODED
            self._forget(key, "flooded" if flooded else "crashed")
            self.metrics.interpreter_events.labels(
                base_language(language), "flood" if flooded else "crash"
            ).inc()
        task = self._starting.get(key)
        if task is None:
            # (Every call asking for it waits for the one start: it outlives the first.)
            work = outcome(self._start(owner, language, limits))
            task = self.supervisor.spawn(f"start a {language} interpreter", work)
            self._starting[key] = task
            task.add_done_callback(lambda _: self._starting.pop(key, None))
        interpreter = await asyncio.shield(task)
        if isinstance(interpreter, Exception):
            raise interpreter
        # A call that found another call starting it: the limits must agree with its own too.
        same_limits(interpreter, limits)
        reason = self._ended.pop(key, "first_call")
        return interpreter, reason

    def _forget(self, key: Key, reason: str) -> None:
        interpreter = self._interpreters.pop(key, None)
        self._ended[key] = reason
        self._ended.move_to_end(key)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        if interpreter is not None:
            name = f"stop a {key[1]} interpreter"
            task = self.supervisor.spawn(name, interpreter.kernel.stop())
            self._stopping[task] = workspace_name(key[0])
            task.add_done_callback(lambda done: self._stopping.pop(done, None))

    def forget_owner(self, owner: Owner, reason: str) -> list[str]:
        """Stop every interpreter of `owner` (its next call says `state_reset: reason`): the
        languages stopped."""
        keys = [key for key in self._interpreters if key[0] == owner]
        for key in keys:
            self._forget(key, reason)
        return [language for _, language in keys]

    async def stop_idle_in(self, workspace: str) -> None:
        """Stop the interpreters idle in `workspace` (its filesystem failed: it is checked
        now) and wait until they are gone; their next call says `state_reset: workspace_failed`."""
        keys = [
            key
            for key, i in self._interpreters.items()
            if i.idle and workspace_name(key[0]) == workspace
        ]
        for key in keys:
            self._forget(key, "workspace_failed")
        stopping = [task for task, name in self._stopping.items() if name == workspace]
        if stopping:
            await asyncio.wait(stopping, timeout=STOP_WAIT)

    def interpreter_died(self, interpreter: Interpreter, killed: bool) -> None:
        """A call found its interpreter's kernel dead (`killed`: by the call's own stop): it
        is forgotten, if it is still the one of its owner and language."""
        key = (interpreter.owner, interpreter.language)
        if self._interpreters.get(key) is interpreter:
            flooded = interpreter.kernel.end_reason == FLOODED
            self._forget(key, "killed" if killed else "flooded" if flooded else "crashed")
            event = "flood" if flooded else "crash"
            self.metrics.interpreter_events.labels(base_language(interpreter.language), event).inc()

    def _make_room(self, owner: Owner, language: str) -> None:
        """At the token's limit of interpreters, stop its least recently used idle one (that
        session's next call says `state_reset: evicted`); refuse only when all are busy."""
        mine = [i for (o, _), i in self._interpreters.items() if o.principal == owner.principal]
        # Other starts in flight hold a slot too.
        starting = sum(
            1
            for key in self._starting
            if key[0].principal == owner.principal and key != (owner, language)
        )
        try:
            victim = choose_eviction(mine, starting, self.settings.max_interpreters_per_principal)
        except LimitExceededError:
            self.metrics.rejections.labels("principal_interpreters").inc()
            raise
        if victim is not None:
            self._forget((victim.owner, victim.language), "evicted")
            self.metrics.interpreter_events.labels(base_language(victim.language), "evicted").inc()
            logger.info("interpreter evicted for room language={}", victim.language)

    async def _start(
        self, owner: Owner, language: str, limits: SandboxLimits | None = None
    ) -> Interpreter:
        spec = self._spec(language, owner)
        limits = limits or self.manager.limits
        if self.closed or not self.manager.accepting:
            raise SandboxRuntimeError("the server is shutting down; retry on another replica")
        if len(self._interpreters) >= self.settings.max_interpreters:
            self.metrics.rejections.labels("interpreters").inc()
            raise LimitExceededError(
                f"this replica runs its maximum of {self.settings.max_interpreters} "
                "interpreters; restart_interpreter one you no longer need, or retry later"
            )
        self._make_room(owner, language)
        name = workspace_name(owner)
        # Pooled kernels run under the server's limits: a caller's tighter ones start a kernel;
        # so does a principal with secret rules (a pooled kernel's proxy socket has none).
        pooled = limits == self.manager.limits and not self._has_secrets(owner)
        kernel = await self.warm.take(spec, owner) if pooled else None
        if warm := kernel is not None:
            self.metrics.interpreter_events.labels(spec.language, "warm_hit").inc()
        else:
            if self.settings.warm_interpreters().get(language):
                self.metrics.interpreter_events.labels(spec.language, "warm_miss").inc()
            workspace, _ = await self.manager.workspaces.ensure(name, owner.principal)
            kernel = self._new_kernel(spec, workspace, limits, owner)
            await kernel.start()
        self.metrics.interpreter_events.labels(spec.language, "start").inc()
        interpreter = Interpreter(owner, language, kernel, limits)
        kernel.on_denied = lambda host, port, reason: self._network_denied(
            interpreter, host, port, reason
        )
        self._interpreters[(owner, language)] = interpreter
        logger.info("interpreter started language={} warm={}", language, warm)
        return interpreter

    def _new_kernel(
        self, spec: KernelSpec, workspace: Path, limits: SandboxLimits, owner: Owner | None = None
    ) -> SandboxedKernel:
        """A kernel (not started yet) of this replica's, in `workspace`, under `limits` (with
        `owner`'s secret rules, if given: a pooled kernel has no owner yet)."""
        return SandboxedKernel(
            self.manager.backend, spec, workspace, limits, self.kernels_root,
            egress=self.manager.egress_of(limits, owner), on_dropped=self._dropped,
            supervisor=self.supervisor,
        )  # fmt: skip

    def _has_secrets(self, owner: Owner) -> bool:
        broker = self.manager.egress.secrets if self.manager.egress is not None else None
        return broker is not None and bool(for_principal(broker.rules, owner.principal))

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

    async def restart(
        self, owner: Owner, language: str, sandbox_config: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Stop the owner's interpreter of `language` and start a fresh one (under the
        caller's tighter limits, if any). Raises PolicyViolationError, InvalidRequestError."""
        spec = self._spec(language, owner)
        language = spec.language if language.lower() == spec.language else language.lower()
        limits = self.manager.limits.tighten(sandbox_config)
        self.manager.egress_of(limits)  # (refuses a widening before anything is stopped)
        key = (owner, language)
        interpreter = self._interpreters.get(key)
        if interpreter is not None:
            self._forget(key, "restarted")
            self.metrics.interpreter_events.labels(spec.language, "restart").inc()
        fresh, _ = await self._interpreter(owner, language, limits)
        self._ended.pop(key, None)
        fresh.last_used = time.monotonic()
        return {"language": language, "restarted": interpreter is not None, "running": True}

    def stop(self, owner: Owner, language: str) -> bool:
        """Stop the owner's interpreter of `language` (a call running there ends failed);
        whether one ran. Raises InvalidRequestError for an unknown language."""
        spec = self._spec(language, owner)
        key = (owner, spec.language if language.lower() == spec.language else language.lower())
        if key not in self._interpreters:
            return False
        self._forget(key, "removed")
        return True

    # -- calls -------------------------------------------------------------------------------

    async def run(
        self,
        owner: Owner,
        language: str,
        code: str,
        timeout_seconds: float | None,
        environment: dict[str, str] | None,
        sandbox_config: dict[str, Any] | None = None,
        servers: list[str] | None = None,
        image: str | None = None,
    ) -> tuple[Execution, str | None]:
        """Queue `code` on the owner's interpreter; the execution and the state_reset reason.
        `sandbox_config` tightens the limits of an interpreter this call starts; `servers`
        are the hosted servers its code may call (code mode: the interpreter's bridge).

        Raises InvalidRequestError, PolicyViolationError, LimitExceededError,
        SandboxUnavailableError, SandboxSpawnError.
        """
        if self.manager.images is not None:  # (the session's environment, fixed now)
            await self.manager.images.for_call(owner, image)
        spec = self._spec(language, owner)
        language = spec.language if language.lower() == spec.language else language.lower()
        if not isinstance(code, str):
            raise InvalidRequestError("code must be a string")
        if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
            raise InvalidRequestError(f"code is over {MAX_CODE_BYTES} bytes")
        env = validate_env(environment)
        if servers is not None and not self.manager.bridges:
            raise InvalidRequestError("this server hosts no MCP servers (servers=[...] needs some)")
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
        run = CallRun(execution)
        run.servers = servers
        execution.runner = run
        work = run_call(self, interpreter, run, env_prelude(spec, env) + code)
        run.task = self.supervisor.spawn(f"run_code {execution.execution_id}", work)
        return execution, reset

    # -- idle reaping --------------------------------------------------------------------------

    def _reap(self) -> None:
        self.reap_idle()

    def reap_idle(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        idle = self.settings.interpreter_idle_seconds
        doomed = [
            key for key, i in self._interpreters.items() if i.idle and i.last_used + idle <= now
        ]
        for key in doomed:
            ended = self._interpreters[key].kernel.end_reason == FLOODED
            self._forget(key, "flooded" if ended else "idle")
            self.metrics.interpreter_events.labels(base_language(key[1]), "reaped").inc()
        return len(doomed)
