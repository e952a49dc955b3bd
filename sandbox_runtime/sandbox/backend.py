"""The bubblewrap backend: starts sandboxes as an unprivileged uid and sees them off.

Its parts, each in a module of its own: what a sandbox is asked to be (spec.py), readying the
host (prepare.py, host.py), bwrap's command line (argv.py), the descriptors a sandbox starts
with (pipes.py), the spawner that starts it (spawn_client.py, spawner.py), one running
sandbox (process.py), its cgroup (cgroups.py) and reaping orphans (reaping.py). This module
holds them together: start and close, the workspaces, spawning (now, or ahead of need and
launched later) and what follows a sandbox's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.errors import InvalidRequestError, SandboxSpawnError, SandboxUnavailableError
from sandbox_runtime.fds import is_exhaustion
from sandbox_runtime.sandbox import argv, prepare, relayed
from sandbox_runtime.sandbox.ahead import StartedSandbox, command_payload
from sandbox_runtime.sandbox.argv import STUB_PROGRAM
from sandbox_runtime.sandbox.cgroups import CgroupLayout, ExecutionCgroup
from sandbox_runtime.sandbox.egress_port import EgressGate, EgressLease
from sandbox_runtime.sandbox.host import build_root, make_workspace, relay_problem, stub_problem
from sandbox_runtime.sandbox.image_root import ImageRoot, ImageRoots
from sandbox_runtime.sandbox.pipes import Streams, close_all, open_streams, sandbox_fds
from sandbox_runtime.sandbox.process import SandboxProcess, close_streams, pidfd_of_child
from sandbox_runtime.sandbox.reaping import children_of as _children  # noqa: F401 (bench/)
from sandbox_runtime.sandbox.reaping import reap_orphans, set_child_subreaper
from sandbox_runtime.sandbox.seccomp import compile_filter
from sandbox_runtime.sandbox.spawn_client import SpawnerManager, spawn_failure
from sandbox_runtime.sandbox.spec import BackendConfig, SandboxSpec, validate_command, validate_env
from sandbox_runtime.supervisor import Supervisor

REAP_LOOP = "orphan reaping"


class BubblewrapBackend:
    """Starts sandboxes with bubblewrap. One per process; `start()` before use, `close()` after."""

    def __init__(self, config: BackendConfig, supervisor: Supervisor | None = None) -> None:
        self.config = config
        self.supervisor = supervisor or Supervisor()
        self.unavailable_reason: str | None = "sandbox backend not started"
        self.cgroups: CgroupLayout = CgroupLayout()
        self._bwrap = ""
        self._spawner: SpawnerManager | None = None
        self._uid = self._gid = -1
        self._private_dir: Path | None = None
        self._private_lock: int | None = None  # held while the private dir is in use
        self._seccomp_path: Path | None = None
        self._seccomp_inet_path: Path | None = None
        self._root_dir: Path | None = None
        self._dev_dir: Path | None = None  # a prebuilt /dev, when the host allows one
        self.dev_problem: str | None = None  # why there is none
        self._fixed: list[str] | None = None
        self._running: set[SandboxProcess] = set()
        self._waiting: set[SandboxProcess] = set()  # started ahead, not yet given a command
        self.stub_problem: str | None = None  # why sandboxes cannot be started ahead here
        self._sweeping = False
        self._cleanups: set[asyncio.Task[None]] = set()  # close() waits for them
        # The egress proxy (set by the owner once started; None: no sandbox has network).
        self.egress: EgressGate[Any] | None = None
        self.relay_problem: str | None = None  # why sandboxes cannot have egress here
        self.images: ImageRoots | None = None  # the roots of environments' sandboxes

    # -- setup -------------------------------------------------------------------------------

    def start(self) -> None:
        """Check the host and prepare shared pieces. Never raises: `unavailable_reason` says."""
        try:
            self._prepare()
            self.unavailable_reason = None
        except SandboxUnavailableError as exc:
            self.unavailable_reason = str(exc)
            logger.error("sandbox unavailable: {}", exc)
            return
        with contextlib.suppress(RuntimeError):  # (no loop: a test's backend, reaped by hand)
            self.supervisor.every(REAP_LOOP, 2.0, self.reap_orphans)
            self._sweeping = True

    def _prepare(self) -> None:
        """prepare.py's steps, in order; what each made is the backend's at once (`close`
        removes it even if a later step fails)."""
        self._bwrap = prepare.find_bwrap(self.config.bwrap_path)
        self._uid, self._gid = prepare.sandbox_ids(self.config)
        program = compile_filter(network=False)
        self._private_dir = prepare.new_private_dir()
        self._private_lock = prepare.lock_private(self._private_dir)
        self._seccomp_path, self._seccomp_inet_path = prepare.write_seccomp(
            self._private_dir, program
        )
        self._root_dir = self._private_dir / "root"
        build_root(self._root_dir)
        self.images = ImageRoots(self._private_dir / "images", self.config.runtime_dir)
        self.relay_problem = relay_problem()
        self.stub_problem = stub_problem()
        self._dev_dir, self.dev_problem = prepare.prebuilt_dev(self._root_dir, self._private_dir)
        prepare.ready_workspace_root(self.config, self._uid, self._gid)
        if os.geteuid() == 0:
            set_child_subreaper()
        prepare.raise_nofile_limit()
        self.cgroups = prepare.cgroup_layout(self.config)
        self._spawner = prepare.start_spawner(self._uid, self._gid)

    @property
    def private_dir(self) -> Path | None:
        """The backend's private directory (root's, 0711), while it runs."""
        return self._private_dir

    @property
    def spawner_pid(self) -> int | None:
        """The spawner process (it runs as the sandbox user, outside every sandbox)."""
        return self._spawner.pid if self._spawner is not None else None

    async def aclose(self) -> None:
        """Kill every sandbox still running and remove the backend's private files."""
        for proc in list(self._running):
            proc.kill("shutdown")
        for proc in list(self._running):
            await proc.aclose()
        # Let pending cgroup removals finish: the loop may close right after us.
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        self.cgroups.close()
        if self._sweeping:
            await self.supervisor.stop(REAP_LOOP)
            self._sweeping = False
        if self._spawner is not None:
            await self._spawner.aclose()
            self._spawner = None
        self.reap_orphans()
        prepare.remove_private_dir(self._private_dir, self._private_lock)
        self._private_dir = self._private_lock = None
        self.unavailable_reason = "sandbox backend closed"

    @property
    def running_count(self) -> int:
        """Sandboxes running a command (not those started ahead and waiting for one)."""
        return len(self._running) - len(self._waiting)

    # -- workspaces --------------------------------------------------------------------------

    @property
    def sandbox_uid(self) -> int:
        """The host uid sandboxes run as."""
        return self._uid

    sandbox_gid = property(lambda self: self._gid)

    def create_workspace(self, name: str) -> Path:
        """A workspace directory owned by the sandbox user (created if missing)."""
        return make_workspace(self.config.workspace_root, name, self._uid, self._gid)

    def remove_workspace(self, path: Path) -> None:
        if path.parent == self.config.workspace_root:
            shutil.rmtree(path, ignore_errors=True)

    # -- spawning ----------------------------------------------------------------------------

    def bwrap_args(
        self, spec: SandboxSpec, lease: EgressLease | None = None
    ) -> tuple[list[str], list[str]]:
        """bubblewrap's options for `spec` and the command it runs (through the egress relay
        when `lease` is this sandbox's socket on the proxy)."""
        if spec.image is not None and self.images is not None:  # (built by spawn)
            return self.images.bwrap_args(spec, self._dev_dir, lease)
        if self._fixed is None:  # (the options every sandbox shares: computed once)
            assert self._root_dir is not None
            self._fixed = argv.fixed_args(self._root_dir, self.config.runtime_dir, argv.root_tops())
        return argv.bwrap_args(spec, self._fixed, self._dev_dir, self.config.runtime_dir, lease)

    def rlimits(self, limits: SandboxLimits) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) the command runs under (argv.rlimits)."""
        return argv.rlimits(limits, memory_cgroup="memory" in self.cgroups.controllers)

    async def spawn(self, spec: SandboxSpec) -> SandboxProcess:
        """Start a sandbox.

        Raises SandboxUnavailableError, SandboxSpawnError, InvalidRequestError.
        """
        if self.unavailable_reason is not None or self._spawner is None:
            raise SandboxUnavailableError(self.unavailable_reason or "sandbox backend not started")
        validate_command(spec.argv)
        spec.env = validate_env(spec.env)
        assert self._seccomp_path is not None and self.images is not None
        await self.images.ready(spec.image)  # (built once, then shared by its sandboxes)
        lease = await relayed.egress_lease(self, spec)
        if lease is None:
            return await self.spawn_with(spec, None)
        # The relay is the sandbox's init and reads the command on its fd, as it does when
        # started ahead (there, when a call takes it).
        proc, _ = await relayed.spawn_relayed(self, spec, lease, command_payload(spec))
        return proc

    def can_prestart(self, spec: SandboxSpec) -> bool:
        """Whether a sandbox like `spec`'s can be started ahead of need: plain executions
        (with egress when the relay can run: it waits for the command as the stub does)
        without kernel sockets, inet sockets or installs."""
        egress = spec.egress is not None and spec.egress.enabled
        return (
            self.stub_problem is None
            and (not egress or (self.egress is not None and self.relay_problem is None))
            and spec.kernel_dir is None is spec.server_dir is spec.bridge_dir
            and not spec.loopback_inet
            and (spec.image is None or bool(self.images and self.images.stub_perl))
        )

    async def prestart(
        self,
        workspace: Path,
        limits: SandboxLimits,
        image: ImageRoot | None = None,
        egress: EgressPolicy | None = None,
    ) -> StartedSandbox:
        """Start a sandbox for `workspace` under `limits` ahead of need: everything an
        execution's sandbox is but its command (`launch` gives it one); with `egress`, its
        socket on the proxy under that policy and the relay, for a call with the same policy.

        Raises SandboxUnavailableError, SandboxSpawnError, PolicyViolationError.
        """
        if self.unavailable_reason is not None or self._spawner is None:
            raise SandboxUnavailableError(self.unavailable_reason or "sandbox backend not started")
        if self.stub_problem is not None:
            raise SandboxUnavailableError(self.stub_problem)
        assert self.images is not None
        await self.images.ready(image)
        stub = [*self.images.stub(image), "-e", STUB_PROGRAM]
        # (stdin is a pipe; the stub opens /dev/null for the others)
        template = SandboxSpec(stub, workspace, limits, interactive=True, image=image)
        template.egress = egress
        lease = await relayed.egress_lease(self, template)  # (None: no network)
        if lease is not None:
            proc, command_w = await relayed.spawn_relayed(self, template, lease, None)
        else:
            try:
                command_r, command_w = os.pipe2(os.O_CLOEXEC)
            except OSError as exc:
                raise SandboxSpawnError(spawn_failure("could not make a pipe", exc)) from exc
            try:
                proc = await self.spawn_with(template, None, command_r)
            except BaseException:
                os.close(command_w)
                raise
        if proc.running:  # (one that ended already has been seen off by its exit)
            self._waiting.add(proc)
        egress = egress if lease is not None else None
        return StartedSandbox(proc, command_w, workspace, limits, image=image, lease=lease,
                              egress=egress)  # fmt: skip

    def launch(self, started: StartedSandbox, spec: SandboxSpec) -> SandboxProcess:
        """Hand `spec`'s command to a sandbox started ahead (for the same workspace, limits
        and environment); it serves this execution only. The wall-clock timeout, duration and
        CPU time count from now.

        Raises InvalidRequestError, SandboxSpawnError (it had ended, or is not for this call,
        or the command could not be handed over); the sandbox started ahead is ended then.
        """
        proc = started.proc
        try:
            validate_command(spec.argv)
            spec.env = validate_env(spec.env)
            if "\0" in spec.cwd:
                raise InvalidRequestError("working_directory must not contain NUL")
            if (spec.workspace, spec.limits, spec.image) != started.shape:
                raise SandboxSpawnError("the sandbox started ahead is for another workspace")
            if not self.can_prestart(spec):
                raise SandboxSpawnError("this execution cannot run in a sandbox started ahead")
            if not relayed.egress_fits(self, started, spec):
                raise SandboxSpawnError("the sandbox started ahead has another network policy")
            started.hand_over(spec)
        except BaseException:
            proc.kill("cancelled")  # first: a command cut short must never get to run
            started.close_command()
            self.track(f"sandbox {proc.pid} close", proc.aclose())
            raise
        started.close_command()
        self._waiting.discard(proc)
        if not spec.interactive and proc.stdin is not None:
            proc.stdin.close()
            proc.stdin = None
        proc.begin(spec.timeout)
        return proc

    async def discard(self, started: StartedSandbox) -> None:
        """End a sandbox started ahead that will serve nothing."""
        started.close_command()
        started.proc.kill("cancelled")
        await started.proc.aclose()

    async def spawn_with(
        self, spec: SandboxSpec, lease: EgressLease | None, command_r: int | None = None
    ) -> SandboxProcess:
        """Start `spec` (with `command_r` as its fd COMMAND_FD, consumed, when it is the stub
        of a sandbox started ahead)."""
        spawner = self._spawner
        assert spawner is not None
        options, command = self.bwrap_args(spec, lease)
        blob = argv.nul_terminated(options)
        cgroup: ExecutionCgroup | None = None
        cgroup_procs: list[int] = []
        ours: list[int] = []  # the server's ends: [stdin_w,] stdout_r, stderr_r, status_r
        theirs: list[int] = []  # bwrap's fds 0..5 and the options pipe's write end
        # Until the spawner has the request, everything taken here is released on any error
        # (EMFILE, ENOMEM, a cancellation): the fds, `command_r` and the cgroup.
        try:
            if self.cgroups.version != "none" or self.cgroups.v2_base is not None:
                try:
                    cgroup = self.cgroups.acquire(spec.limits)
                    cgroup_procs = cgroup.procs_fds()
                except OSError as exc:
                    raise SandboxSpawnError(
                        spawn_failure("could not create the execution's cgroup", exc)
                    ) from exc
            inet = spec.loopback_inet or lease is not None  # (TCP to the relay on loopback)
            seccomp = self._seccomp_inet_path if inet else self._seccomp_path
            assert seccomp is not None
            given, command_r = command_r, None  # (sandbox_fds consumes it, failing or not)
            try:
                fds = sandbox_fds(spec.interactive, seccomp, len(blob), given, self._give_pipe)
            except OSError as exc:
                raise SandboxSpawnError(
                    spawn_failure("could not prepare the sandbox's pipes", exc)
                ) from exc
            ours, theirs = fds.ours, fds.theirs
            spawning = spawner.request(
                argv.bwrap_command(self._bwrap, command),
                blob,
                self.rlimits(spec.limits),
                theirs,
                cgroup_procs,
            )
        except BaseException as exc:
            close_all(ours + ([command_r] if command_r is not None else []))
            if cgroup is not None:
                self._release_later(cgroup, "unstarted sandbox")
            if is_exhaustion(exc.__cause__ or exc):
                self.cgroups.trim_idle()  # pooled groups hold descriptors: give them back
            raise
        finally:
            close_all(theirs)
        # From here the spawner starts bwrap, sets its rlimits, moves it into the cgroup and
        # hands it its options, all before it answers. A start abandoned before the answer is
        # ended once the answer comes (_abandon_start); the cgroup is not reused before then.
        stdin_fd = ours.pop(0) if spec.interactive else None
        stdout_r, stderr_r, status_r = ours
        streams: Streams | None = None
        pid: int | None = None
        pidfd: int | None = None
        proc: SandboxProcess | None = None
        try:
            streams = await open_streams(stdout_r, stderr_r, stdin_fd)  # meanwhile
            stdout, stderr, stdin = streams
            try:
                pid = await asyncio.shield(spawning)
            except SandboxSpawnError as exc:
                raise SandboxSpawnError(f"could not start the sandbox: {exc}") from exc
            # None: bwrap has already ended and been reaped; the spawner reports its end.
            pidfd = pidfd_of_child(pid, spawner.pid)
            proc = SandboxProcess(
                pid=pid,
                pidfd=pidfd,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                status_fd=status_r,
                cgroup=cgroup,
                limits=spec.limits,
                timeout=spec.timeout,
                on_exit=self._on_exit,
                supervisor=self.supervisor,
            )
            pidfd = None  # the process owns it and the status pipe now
            self._running.add(proc)
            spawner.watch(pid, proc.on_outer_status)
        except BaseException as exc:
            if proc is not None:
                proc.kill("cancelled")
                await proc.aclose()  # its exit releases the cgroup
            else:
                if pidfd is not None:
                    os.close(pidfd)  # (_abandon_start kills bwrap)
                if streams is not None:  # (open_streams closes the fds itself when it fails)
                    close_streams(*streams)
                os.close(status_r)
                self.track(
                    "abandoned sandbox start", self._abandon_start(spawner, spawning, cgroup)
                )
            if isinstance(exc, OSError):
                if is_exhaustion(exc):
                    self.cgroups.trim_idle()
                raise SandboxSpawnError(
                    spawn_failure("could not confine the sandbox", exc)
                ) from exc
            raise
        return proc

    def _give_pipe(self, fd: int) -> None:
        """Make a stdio pipe the sandbox user's: a pipe the server (root) made is mode 0600
        and root's, and reopening it through /proc/self/fd, as `> /dev/stdout` does, would
        fail. Raises OSError."""
        if os.geteuid() != self._uid:
            os.fchown(fd, self._uid, self._gid)

    async def _abandon_start(
        self,
        spawner: SpawnerManager,
        spawning: asyncio.Future[int],
        cgroup: ExecutionCgroup | None,
    ) -> None:
        """End what an abandoned start set going: its bwrap, once the spawner has answered
        (until then it may still move a process into the cgroup), then release the cgroup."""
        pid = await spawner.abandon(spawning)
        if cgroup is not None:
            cgroup.kill()
            await self.cgroups.release_when_empty(cgroup, f"abandoned sandbox {pid}")

    # -- after a sandbox's end ---------------------------------------------------------------

    def _on_exit(self, proc: SandboxProcess) -> None:
        self._running.discard(proc)
        self._waiting.discard(proc)
        self.track(f"sandbox {proc.pid} end", self._after_exit(proc))

    async def _after_exit(self, proc: SandboxProcess) -> None:
        await proc.wait()  # reads the cgroup's counters before the cgroup goes
        if proc._cgroup is not None:
            await self.cgroups.release_when_empty(proc._cgroup, f"sandbox {proc.pid}")

    def _release_later(self, cgroup: ExecutionCgroup, what: str) -> None:
        self.track(f"cgroup release of {what}", self.cgroups.release_when_empty(cgroup, what))

    def track(self, name: str, cleanup: Coroutine[object, object, None]) -> None:
        """Run `cleanup` in the background under the supervisor; close() waits for it."""
        task = self.supervisor.spawn(name, cleanup)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def reap_orphans(self) -> int:
        """Reap zombie bwraps reparented to this server (a child subreaper) when their spawner
        died under them; normally the spawner reaps everything it starts."""
        return reap_orphans(self._uid if os.geteuid() == 0 else os.geteuid())
