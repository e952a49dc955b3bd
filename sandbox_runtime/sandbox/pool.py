"""Sandboxes started ahead of need: one per active workspace, waiting for its next command.

A call that finds one for its workspace pays only for handing over its command and the exec
(`BubblewrapBackend.launch`); the next one is started at once, while that call runs. The
workspace is bound when bwrap starts, so a sandbox started ahead belongs to one workspace (one
session) and the first call of a session finds none.

What a pooled sandbox is, is what the call's own sandbox would have been (on the same
environment, the one the workspace's last call ran on): the same uid,
namespaces, seccomp filter, rlimits and cgroup limits (the server's; a call that tightens
them gets a sandbox of its own, as without the pool), the same workspace, the same network
(the last call's egress policy: its own socket on the proxy and the relay as its init; a call
with another policy, principal or secrets gets a sandbox of its own); its environment,
directory and stdin are set by the stub (or the relay) from the call. It serves one execution
and ends with it.

Bounded: at most `size` sandboxes waiting or starting per replica; one waiting unused for
`idle_seconds` is ended (its workspace may then be unmounted); a full pool takes a new
workspace only in place of one idle for a while. Nothing outlives `close()`.

A new session's first call finds one too when it takes a blank workspace (made ahead of need:
workspaces/blanks.py): `start_ahead` starts a sandbox in each blank as it is made, and `move`
hands it to the session that takes the blank. Those are bounded by the blanks' own count, not
by `size`, and are not ended for waiting (a blank waits for its session as long as it must).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from loguru import logger

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.errors import PolicyViolationError, SandboxSpawnError, SandboxUnavailableError
from sandbox_runtime.sandbox.ahead import StartedSandbox, command_waits, egress_shape
from sandbox_runtime.sandbox.backend import BubblewrapBackend
from sandbox_runtime.sandbox.process import SandboxProcess
from sandbox_runtime.sandbox.spec import ImageRoot, SandboxSpec
from sandbox_runtime.supervisor import Supervisor

SWEEP_LOOP = "sandbox pool sweep"

# The next sandbox of a workspace is started once its call's command has ended, or this long
# after it began if it runs on: the start then does not compete for the CPU with the call.
REFILL_AFTER_SECONDS = 0.05
# A full pool replaces a waiting sandbox with one for another workspace only when the first
# has waited this long (else two busy sessions would keep evicting each other's).
EVICT_AFTER_SECONDS = 10.0
# How long a sandbox started in a blank workspace may take to bind it and wait for a command
# (the blank is handed out only then: handing it out unmounts the path bwrap binds), and how
# often that is looked at meanwhile.
SETTLE_SECONDS = 10.0
SETTLE_STEP_SECONDS = 0.005

# Why a call did not get a pooled sandbox (the label of the misses counter).
MISS_DISABLED = "disabled"  # no pool on this server
MISS_EMPTY = "empty"  # none waiting for this workspace (its first call)
MISS_BUSY = "busy"  # its next one was not started: no spare CPU, or the pool was full
MISS_LIMITS = "limits"  # the call tightened the limits
MISS_UNPOOLABLE = "unpoolable"  # kernel or bridge sockets, installs; egress with no relay
MISS_NETWORK = "network"  # the waiting sandbox's network policy is not the call's
MISS_ENDED = "ended"  # the waiting sandbox had ended
MISS_FAILED = "failed"  # its command could not be handed over


def _sandbox_part(limits: SandboxLimits) -> SandboxLimits:
    """The limits that shape a sandbox (the output cap is the server's business; the network
    ones shape its egress policy, which is compared on its own: `egress_shape`)."""
    return replace(limits, output_bytes=0, network=False, network_allow=None, secrets=None)


class SandboxPool:
    """Sandboxes started ahead, per workspace. `start()` in the event loop, `close()` after."""

    def __init__(
        self,
        backend: BubblewrapBackend,
        limits: SandboxLimits,
        size: int,
        idle_seconds: float,
        workspace_ready: Callable[[Path], bool] = lambda _: True,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.backend = backend
        self.supervisor = supervisor or Supervisor()
        self.limits = limits
        self._shape = _sandbox_part(limits)  # (compared with each call's)
        self.size = size
        self.idle_seconds = idle_seconds
        self.workspace_ready = workspace_ready  # a refill starts only into a mounted workspace
        self._ready: dict[Path, StartedSandbox] = {}  # oldest first
        self._refills: dict[Path, asyncio.Task[None]] = {}
        self._waits: dict[Path, asyncio.Task[None]] = {}  # a refill after a call's command
        # Sandboxes being ended, by workspace; workspaces whose next sandbox was not started
        # (no spare CPU, a full pool): their next call's miss says "busy".
        self._discarding: dict[Path, set[asyncio.Task[None]]] = {}
        self._skipped: set[Path] = set()
        # The environment each workspace's session runs on (its last call's): what its next
        # sandbox is started on.
        self._images: dict[Path, ImageRoot | None] = {}
        # And its network (its last call's egress policy, None: none): a sandbox started
        # ahead with egress has its socket on the proxy under that policy, for a call with
        # the same (the same principal and secrets: EgressGate.assign).
        self._egress: dict[Path, EgressPolicy | None] = {}
        self._blanks: set[Path] = set()  # workspaces made ahead of need, a sandbox in them
        self._fresh: set[Path] = set()  # sessions' workspaces whose sandbox came with the blank
        self._sweeping = False
        self._closed = False
        self.hits = 0
        self.cpus = len(os.sched_getaffinity(0))
        self.misses: dict[str, int] = {}
        # Metric hooks: a hit, a miss (its reason), a refill's duration in seconds.
        self.on_hit: list[Callable[[], None]] = []
        self.on_miss: list[Callable[[str], None]] = []
        self.on_refill: list[Callable[[float], None]] = []

    @property
    def enabled(self) -> bool:
        return self.size > 0 and self.backend.stub_problem is None

    @property
    def ready_count(self) -> int:
        return sum(1 for s in self._ready.values() if s.usable)

    @property
    def session_count(self) -> int:
        """Sandboxes waiting or starting for sessions' workspaces (what `size` bounds)."""
        return len(set(self._ready) - self._blanks) + len(set(self._refills) - self._blanks)

    @property
    def starting_count(self) -> int:
        return len(self._refills)

    def workspaces(self) -> set[str]:
        """Names of the workspaces a sandbox waits in or is being started in (not a session's
        that has run nothing yet: its sandbox came with its blank, and a warm interpreter's
        workspace may still replace it, workspaces/store.py `adopt`)."""
        waiting = (set(self._ready) | set(self._refills)) - self._fresh
        return {p.name for p in waiting}

    def start(self) -> None:
        if self.enabled and not self._sweeping:
            interval = max(0.5, min(self.idle_seconds / 4, 15.0))
            self.supervisor.every(SWEEP_LOOP, interval, self.sweep)
            self._sweeping = True

    # -- serving -----------------------------------------------------------------------------

    async def spawn(self, spec: SandboxSpec) -> SandboxProcess:
        """A sandbox running `spec`: the waiting one of its workspace when it fits, else one
        started now. Raises what `BubblewrapBackend.spawn` raises."""
        self._fresh.discard(spec.workspace)
        reason = self._unpoolable(spec)
        if reason is not None:
            self._missed(reason)
            return await self.backend.spawn(spec)
        self._images[spec.workspace] = spec.image
        network = egress_shape(spec.egress)
        self._egress[spec.workspace] = spec.egress if network is not None else None
        starting = self._refills.get(spec.workspace)
        if spec.workspace not in self._ready and starting is not None:
            await asyncio.wait({starting})  # (partly started already: less to wait for)
        started = self._ready.pop(spec.workspace, None)
        if started is not None and (not started.usable or started.image != spec.image):
            self._discard_later(started)
            started, reason = None, MISS_ENDED
        elif started is not None and egress_shape(started.egress) != network:
            self._discard_later(started)
            started, reason = None, MISS_NETWORK
        if started is not None:
            try:
                proc = self.backend.launch(started, replace(spec, limits=started.limits))
            except SandboxSpawnError as exc:  # (launch ended it)
                logger.warning("a sandbox started ahead could not take its command: {}", exc)
                reason = MISS_FAILED
            else:
                proc.limits = spec.limits
                self.hits += 1
                for hook in self.on_hit:
                    hook()
                self._refill_after(proc, spec.workspace)
                return proc
        if reason is None:
            reason = MISS_BUSY if spec.workspace in self._skipped else MISS_EMPTY
        self._missed(reason)
        proc = await self.backend.spawn(spec)
        self._refill_after(proc, spec.workspace)
        return proc

    def _unpoolable(self, spec: SandboxSpec) -> str | None:
        if not self.enabled or self._closed:
            return MISS_DISABLED
        if not self.backend.can_prestart(spec):
            return MISS_UNPOOLABLE
        if spec.limits != self.limits and _sandbox_part(spec.limits) != self._shape:
            return MISS_LIMITS
        return None

    def _missed(self, reason: str) -> None:
        self.misses[reason] = self.misses.get(reason, 0) + 1
        for hook in self.on_miss:
            hook(reason)

    # -- filling -----------------------------------------------------------------------------

    def _refill_after(self, proc: SandboxProcess, workspace: Path) -> None:
        """`refill(workspace)` once `proc` has ended or has run REFILL_AFTER_SECONDS."""

        async def later() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.ended(), REFILL_AFTER_SECONDS)
            self.refill(workspace)

        if self.enabled and not self._closed and workspace not in self._waits:
            task = self.supervisor.spawn(f"sandbox pool refill after {workspace.name}", later())
            self._waits[workspace] = task
            task.add_done_callback(lambda done: self._forget(self._waits, workspace, done))

    def refill(self, workspace: Path) -> None:
        """Start a sandbox for `workspace` in the background, if there is room and spare CPU."""
        if not self.enabled or self._closed:
            return
        if workspace in self._ready or workspace in self._refills:
            return
        if not self.workspace_ready(workspace) or not self._spare_cpu(starting=0):
            self._skipped.add(workspace)
            return
        if self.session_count >= self.size and not self._evict_one():
            self._skipped.add(workspace)
            return
        self._skipped.discard(workspace)
        task = self.supervisor.spawn(
            f"sandbox pool refill {workspace.name}", self._refill(workspace)
        )
        self._refills[workspace] = task
        task.add_done_callback(lambda done: self._forget(self._refills, workspace, done))

    def _spare_cpu(self, starting: int) -> bool:
        """Whether a core is free for one more start: a sandbox started ahead on a busy
        replica would take CPU from the running ones (and cost its stub's start on top).
        Starts in blanks are not counted: they are few at once (workspaces/blanks.py), and a
        session's next call must not wait for a burst's blanks to be made."""
        starts = len(set(self._refills) - self._blanks)
        return self.backend.running_count + starts - starting < self.cpus

    @staticmethod
    def _forget(
        tasks: dict[Path, asyncio.Task[None]], workspace: Path, task: asyncio.Task[None]
    ) -> None:
        if tasks.get(workspace) is task:  # (not a newer one for the same workspace)
            del tasks[workspace]

    def _evict_one(self) -> bool:
        """Make room: end a waiting sandbox that has ended, else the one that has waited
        longest if it has waited long."""
        victim = next((w for w, s in self._ready.items() if not s.usable), None)
        if victim is None:
            oldest = next((i for i in self._ready.items() if i[0] not in self._blanks), None)
            if oldest is None or time.monotonic() - oldest[1].started_at < EVICT_AFTER_SECONDS:
                return False
            victim = oldest[0]
        self._discard_later(self._ready.pop(victim))
        return True

    async def _refill(self, workspace: Path, ahead: bool = False) -> None:
        """Start a sandbox for `workspace`; `ahead`: in a blank, whatever the CPU (its maker
        starts one at a time: workspaces/blanks.py)."""
        if not self.workspace_ready(workspace) or not (ahead or self._spare_cpu(starting=1)):
            self._skipped.add(workspace)
            return
        began = time.perf_counter()
        try:
            image = self._images.get(workspace)
            egress = self._egress.get(workspace)
            started = await self.backend.prestart(workspace, self.limits, image, egress)
        except (SandboxSpawnError, SandboxUnavailableError, PolicyViolationError) as exc:
            logger.warning("could not start a sandbox ahead of need: {}", exc)
            return
        if self._closed or not self.workspace_ready(workspace):  # (being released meanwhile)
            await self.backend.discard(started)
            return
        elapsed = time.perf_counter() - began
        for hook in self.on_refill:
            hook(elapsed)
        self._ready[workspace] = started

    # -- blanks: workspaces made ahead of need ------------------------------------------------

    async def start_ahead(self, workspace: Path) -> bool:
        """Start a sandbox in the blank `workspace` and wait until it has bound the workspace
        and waits for a command; whether one waits there now (no: the pool is off, or the
        start failed or took too long: the blank is then handed out without one)."""
        if not self.enabled or self._closed or workspace in self._ready:
            return workspace in self._ready
        self._blanks.add(workspace)
        task = self.supervisor.spawn(
            f"sandbox pool blank {workspace.name}", self._refill(workspace, ahead=True)
        )
        self._refills[workspace] = task
        task.add_done_callback(lambda done: self._forget(self._refills, workspace, done))
        await asyncio.wait({task})
        started = self._ready.get(workspace)
        deadline = time.monotonic() + SETTLE_SECONDS
        while started is not None and started.usable and time.monotonic() < deadline:
            if command_waits(started):
                return True
            await asyncio.sleep(SETTLE_STEP_SECONDS)
        if self._ready.get(workspace) is started and started is not None:
            self._discard_later(self._ready.pop(workspace))
        self._blanks.discard(workspace)
        return False

    def move(self, old: Path, new: Path) -> None:
        """The blank workspace `old` is the session's workspace `new` now (renamed, its
        filesystem the same): the sandbox waiting there serves that session's first call."""
        self._blanks.discard(old)
        self._images.pop(old, None)
        started = self._ready.pop(old, None)
        if started is None:
            return
        if new in self._ready or new in self._refills or self._closed:
            self._discard_later(started)
            return
        started.workspace = new
        self._ready[new] = started
        self._fresh.add(new)

    # -- ending ------------------------------------------------------------------------------

    async def discard_workspace(self, workspace: Path) -> None:
        """End the sandbox waiting (or starting) in `workspace` and wait until it has ended:
        before the workspace is unmounted, removed or replaced, nothing may hold it. (The
        caller holds the workspace's lock: no new one starts there meanwhile.)"""
        self._skipped.discard(workspace)
        self._images.pop(workspace, None)
        self._egress.pop(workspace, None)
        self._blanks.discard(workspace)
        self._fresh.discard(workspace)
        while True:
            cancelled = [
                task
                for task in (self._waits.pop(workspace, None), self._refills.pop(workspace, None))
                if task is not None
            ]
            for task in cancelled:
                task.cancel()
            started = self._ready.pop(workspace, None)
            if started is not None:
                self._discard_later(started)
            pending = cancelled + list(self._discarding.get(workspace, ()))
            if not pending:
                return
            await asyncio.wait(pending)  # (not raising theirs; our own cancellation propagates)

    def _discard_later(self, started: StartedSandbox) -> asyncio.Task[None]:
        task = self.supervisor.spawn(
            f"sandbox pool discard {started.workspace.name}", self.backend.discard(started)
        )
        tasks = self._discarding.setdefault(started.workspace, set())
        tasks.add(task)

        def done(_: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not tasks and self._discarding.get(started.workspace) is tasks:
                del self._discarding[started.workspace]

        task.add_done_callback(done)
        return task

    def sweep(self) -> int:
        """End the sandboxes that waited `idle_seconds` unused (or ended): how many."""
        now = time.monotonic()
        stale = [
            w
            for w, s in self._ready.items()
            if not s.usable or (now - s.started_at >= self.idle_seconds and w not in self._blanks)
        ]
        for workspace in stale:
            self._discard_later(self._ready.pop(workspace))
        self._fresh &= set(self._ready)
        return len(stale)

    async def aclose(self) -> None:
        """End every sandbox waiting or starting; wait until they are gone."""
        self._closed = True
        if self._sweeping:
            await self.supervisor.stop(SWEEP_LOOP)
            self._sweeping = False
        refills = [*self._waits.values(), *self._refills.values()]
        for task in refills:
            task.cancel()
        await asyncio.gather(*refills, return_exceptions=True)
        ready, self._ready = list(self._ready.values()), {}
        ending = [t for tasks in self._discarding.values() for t in tasks]
        await asyncio.gather(
            *(self.backend.discard(s) for s in ready), *ending, return_exceptions=True
        )
