"""The bubblewrap backend: builds the sandbox, launches it as an unprivileged uid, reaps it."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import os
import posixpath
import pwd
import re
import resource
import shutil
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.limits import MIB, SandboxLimits
from sandbox_runtime.egress.supervisor import (
    RELAY_PORT,
    SOCKET_DIR,
    SOCKET_NAME,
    DeniedHandler,
    EgressProxy,
    Lease,
)
from sandbox_runtime.errors import InvalidRequestError, SandboxSpawnError, SandboxUnavailableError
from sandbox_runtime.fds import is_exhaustion
from sandbox_runtime.sandbox.cgroups import CgroupLayout, ExecutionCgroup
from sandbox_runtime.sandbox.host import (
    DEFAULT_SANDBOX_USER,
    KERNEL_DIR,
    PRIVATE_PREFIX,
    RELAY_PATH,
    RELAY_PYTHON,
    ROOT_TOPS,
    RUNTIME,
    SANDBOX_UID,
    STUB_PERL,
    WORKSPACE,
    build_dev,
    build_root,
    ensure_system_user,
    first_unsearchable,
    lock_private_dir,
    relay_problem,
    remove_stale_private_dirs,
    stub_problem,
)
from sandbox_runtime.sandbox.process import (
    SandboxProcess,
    close_streams,
    kill_if_child,
    pidfd_of_child,
)
from sandbox_runtime.sandbox.seccomp import compile_filter
from sandbox_runtime.sandbox.spawn_client import SpawnerManager, spawn_failure
from sandbox_runtime.supervisor import Supervisor

MAX_COMMAND_BYTES = 120 * 1024  # the kernel refuses one argument over 128 KiB
MAX_ENV_BYTES = 64 * 1024
MAX_ENV_VARS = 256
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")  # fullmatch: no trailing newline
PR_SET_CHILD_SUBREAPER = 36
F_SETPIPE_SZ = 1031

# How a sandbox starts: the spawner (spawner.py, already the unprivileged sandbox uid with
# no capabilities and no_new_privs) starts bwrap with fds the server made; bwrap first waits
# for its options (--args: host paths, the caller's environment and code never show in a
# command line). Meanwhile the spawner lowers bwrap's rlimits and moves it into the
# execution's cgroups (through cgroup.procs files the server opened), and only then writes
# the options: everything bwrap starts inherits the limits and the cgroups. One turn of the
# spawner, no round trip through the server before bwrap may go on.
# Fds of bwrap as the spawner sets them up: 0-2 stdio, then these.
SECCOMP_FD, STATUS_FD, ARGS_FD = 3, 4, 5
# A shell command is run by /bin/sh like `sh -c CMD`, but CMD comes in __srt_cmd, which is
# gone from the environment before it runs (and CMD never shows in a command line).
SHELL_SCRIPT = '__srt_c=$__srt_cmd; unset __srt_cmd; eval "$__srt_c"'

# A sandbox started ahead of need (sandbox/pool.py) runs this stub, Perl's (perl-base is
# essential on Debian and Ubuntu: every host has it, and it starts in ~1 ms): it waits on fd
# COMMAND_FD for its command, then does what bwrap would have done with it (stdin from
# /dev/null unless interactive, chdir, the caller's variables, PWD set to the directory after
# them as bwrap sets it, execvp) with bwrap's own errors and exit code. The command comes as
# NUL-terminated fields: the directory, "i" or "n" (interactive), the number of variables,
# the number of argv items, then each name and value, then the argv; anything but exactly
# that (a command cut short) runs nothing (exit 125). Nothing else runs in the sandbox before
# it has the command; fd COMMAND_FD is closed before the exec.
COMMAND_FD = 6
STUB_PROGRAM = (
    'open(my $c, "<&=", 6) or exit 125; local $/; my $d = <$c>; close $c;'
    " defined $d and length $d or exit 125; my @f = split /\\0/, $d, -1; pop @f;"
    " my ($cwd, $in, $n, $m) = splice @f, 0, 4;"
    " defined $m and $m > 0 and @f == 2 * $n + $m or exit 125;"
    ' if ($in ne "i") { open(STDIN, "<", "/dev/null") or exit 125 }'
    ' chdir $cwd or do { print STDERR "bwrap: Can\\x27t chdir to $cwd: $!\\n"; exit 1 };'
    " for (1 .. $n) { my $k = shift @f; $ENV{$k} = shift @f } $ENV{PWD} = $cwd;"
    ' exec { $f[0] } @f; print STDERR "bwrap: execvp $f[0]: $!\\n"; exit 1;'
)

RELAY_ENV = "__srt_env"  # (validate_env refuses caller names starting with __srt)
_PROXY_URL = f"http://127.0.0.1:{RELAY_PORT}"
# What programs read to find a proxy: curl, wget, pip, git, requests, Deno, npm, Node (24+).
EGRESS_ENV = {
    **{name: _PROXY_URL for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
                                     "https_proxy", "all_proxy", "npm_config_proxy",
                                     "npm_config_https_proxy")},
    "NO_PROXY": "localhost,127.0.0.1,::1",
    "no_proxy": "localhost,127.0.0.1,::1",
    "NODE_USE_ENV_PROXY": "1",
}  # fmt: skip

# What a program inside finds in its environment before the caller's variables.
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKSPACE,
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    "SHELL": "/bin/sh",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "TERM": "dumb",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class BackendConfig:
    """What the backend needs from the server's settings."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    # None: DEFAULT_SANDBOX_USER (created if missing) for a root server, else its own user.
    sandbox_user: str | None = None
    workspace_root: Path = Path("/var/lib/sandbox-runtime/workspaces")
    bwrap_path: str | None = None
    group_name: str = "srt"
    cgroup_favordynmods: bool = True
    cgroup_pool: int = 32  # idle execution cgroups kept for reuse
    # A runtime tree (bound read-only at RUNTIME in every sandbox); None: the host's /usr only.
    runtime_dir: Path | None = None


@dataclass
class SandboxSpec:
    """One sandbox to start."""

    argv: list[str]
    workspace: Path
    limits: SandboxLimits
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = WORKSPACE
    interactive: bool = False
    timeout: float | None = None
    # A host directory bound read-write at KERNEL_DIR (an interpreter's sockets and its
    # connection file); None for plain executions.
    kernel_dir: Path | None = None
    # AF_INET/AF_INET6 sockets allowed, inside the sandbox's own network namespace (loopback
    # only, no route out): Jupyter kernels need them. Plain executions: AF_UNIX only.
    loopback_inet: bool = False
    # Egress through the host proxy under this policy (None, or one allowing nothing: none),
    # and who hears of its denials.
    egress: EgressPolicy | None = None
    on_denied: DeniedHandler | None = None


@dataclass(eq=False)
class StartedSandbox:
    """A sandbox started ahead of need (`BubblewrapBackend.prestart`): bwrap, its limits,
    cgroup, seccomp filter and workspace in place, the stub waiting for a command on the
    pipe whose write end is `command_fd`. Serves one execution (`launch`), or is discarded."""

    proc: SandboxProcess
    command_fd: int | None
    workspace: Path
    limits: SandboxLimits
    started_at: float = field(default_factory=time.monotonic)

    @property
    def usable(self) -> bool:
        return self.command_fd is not None and self.proc.running

    def close_command(self) -> None:
        if self.command_fd is not None:
            os.close(self.command_fd)
            self.command_fd = None


def command_of(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """What bwrap execs for `argv`, and the variables it needs: a shell command's text goes in
    __srt_cmd (never in a command line)."""
    if len(argv) == 3 and argv[:2] == ["/bin/sh", "-c"]:
        return ["/bin/sh", "-c", SHELL_SCRIPT], {"__srt_cmd": argv[2]}
    return list(argv), {}


def shell_argv(command: str) -> list[str]:
    """argv that runs `command` with /bin/sh -c inside the sandbox."""
    return ["/bin/sh", "-c", command]


def validate_command(argv: list[str]) -> None:
    """Raise InvalidRequestError for argv the kernel or bwrap would refuse."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidRequestError("command must be a non-empty string or list of strings")
    if not argv[0]:
        raise InvalidRequestError("command must not be empty")
    total = 0
    for arg in argv:
        if "\x00" in arg:
            raise InvalidRequestError("command must not contain NUL bytes")
        size = len(arg.encode("utf-8", "surrogatepass"))
        if size > MAX_COMMAND_BYTES:
            raise InvalidRequestError(
                f"command is {size} bytes; the maximum is {MAX_COMMAND_BYTES} bytes "
                "(write longer programs to a file in the workspace, or send them on stdin)"
            )
        total += size
    if total > 4 * MAX_COMMAND_BYTES:
        raise InvalidRequestError(
            f"command is {total} bytes in all; at most {4 * MAX_COMMAND_BYTES}"
        )


def validate_env(env: dict[str, str] | None) -> dict[str, str]:
    """The caller's environment, checked. Raises InvalidRequestError."""
    if not env:
        return {}
    if not isinstance(env, dict):
        raise InvalidRequestError("environment must be an object of names to strings")
    if len(env) > MAX_ENV_VARS:
        raise InvalidRequestError(f"environment has {len(env)} variables; at most {MAX_ENV_VARS}")
    size = 0
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key) or key.startswith("__srt"):
            raise InvalidRequestError(f"environment variable name {key!r} is not valid")
        if not isinstance(value, str) or "\x00" in value:
            raise InvalidRequestError(f"environment variable {key} must be a string without NUL")
        size += len(key) + len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_ENV_BYTES:
        raise InvalidRequestError(f"environment is {size} bytes; at most {MAX_ENV_BYTES}")
    return dict(env)


def sandbox_cwd(working_directory: str | None) -> str:
    """The directory inside the sandbox to start in; must lie in /workspace or /tmp."""
    if not working_directory:
        return WORKSPACE
    if not isinstance(working_directory, str) or "\x00" in working_directory:
        raise InvalidRequestError("working_directory must be a string without NUL")
    path = posixpath.normpath(posixpath.join(WORKSPACE, working_directory))
    for root in (WORKSPACE, "/tmp"):
        if path == root or path.startswith(root + "/"):
            return path
    raise InvalidRequestError(
        f"working_directory {working_directory!r} is outside the sandbox's /workspace and /tmp"
    )


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
        self._cleanups: set[asyncio.Task[None]] = set()  # referenced so they are not collected
        # The egress proxy (set by the owner once started; None: no sandbox has network) and
        # each running sandbox's socket on it.
        self.egress: EgressProxy | None = None
        self.relay_problem: str | None = None  # why sandboxes cannot have egress here

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
        bwrap = self.config.bwrap_path or shutil.which("bwrap")
        if not bwrap or not os.access(bwrap, os.X_OK):
            raise SandboxUnavailableError(
                "bubblewrap (bwrap) is not installed; install it: apt-get install bubblewrap"
            )
        self._bwrap = bwrap
        user = self.config.sandbox_user
        if user is None:
            if os.geteuid() == 0:
                user = ensure_system_user(DEFAULT_SANDBOX_USER)
            else:  # a server that is not root can only run sandboxes as itself
                user = pwd.getpwuid(os.geteuid()).pw_name
            self.config.sandbox_user = user
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise SandboxUnavailableError(
                f"sandbox user {user!r} does not exist; create it "
                "(useradd --system --no-create-home srt-sandbox) or set SANDBOX_SANDBOX_USER"
            ) from None
        if entry.pw_uid == 0:
            raise SandboxUnavailableError("the sandbox user must not be root")
        self._uid, self._gid = entry.pw_uid, entry.pw_gid
        if os.geteuid() != 0 and os.geteuid() != self._uid:
            raise SandboxUnavailableError(
                f"the server runs as uid {os.geteuid()}, not root: it cannot switch to sandbox "
                f"user {self.config.sandbox_user!r}; run it as root or set SANDBOX_SANDBOX_USER "
                "to the server's own user"
            )
        program = compile_filter(network=False)
        self._private_dir = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))
        os.chmod(self._private_dir, 0o711)
        try:
            self._private_lock = lock_private_dir(self._private_dir)
        except OSError as exc:
            raise SandboxUnavailableError(
                f"cannot lock the private directory {self._private_dir}: {exc}"
            ) from exc
        try:
            removed = remove_stale_private_dirs(self._private_dir)
        except OSError as exc:  # an unreadable TMPDIR: nothing removed, nothing else wrong
            logger.warning("could not look for stale private directories: {}", exc)
        else:
            if removed:
                logger.info("removed {} private directories of servers that are gone", removed)
        self._seccomp_path = self._private_dir / "seccomp.bpf"
        self._seccomp_path.write_bytes(program)
        os.chmod(self._seccomp_path, 0o600)
        self._seccomp_inet_path = self._private_dir / "seccomp-inet.bpf"
        self._seccomp_inet_path.write_bytes(compile_filter(inet=True))
        os.chmod(self._seccomp_inet_path, 0o600)
        self._root_dir = self._private_dir / "root"
        build_root(self._root_dir)
        self.relay_problem = relay_problem()
        self.stub_problem = stub_problem()
        if os.geteuid() == 0:
            try:
                self._dev_dir = build_dev(self._root_dir / "dev")
            except OSError as exc:
                self.dev_problem = f"device nodes cannot be made in {self._private_dir}: {exc}"
        else:
            self.dev_problem = "device nodes can only be made by a server running as root"
        if self.dev_problem is not None:
            logger.info("no prebuilt /dev ({}); bwrap builds one per sandbox", self.dev_problem)
        self.config.workspace_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.config.workspace_root, 0o711)
        blocked = first_unsearchable(self.config.workspace_root, self._uid, self._gid)
        if blocked is not None:
            raise SandboxUnavailableError(
                f"the sandbox user {self.config.sandbox_user!r} cannot reach the workspaces "
                f"under {self.config.workspace_root}: {blocked} is not searchable by it; "
                f"run `chmod o+x {blocked}` or choose another SANDBOX_STATE_DIR"
            )
        if os.geteuid() == 0:
            _set_child_subreaper()
        # Every running or pooled sandbox holds a few fds here: lift the soft limit (often 1024).
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        self.cgroups = CgroupLayout.setup(
            self.config.group_name, favordynmods=self.config.cgroup_favordynmods
        )
        self.cgroups.pool_size = self.config.cgroup_pool
        self.cgroups.cleanup_stale()
        for problem in self.cgroups.problems:
            logger.warning("cgroups: {}", problem)
        if os.geteuid() == 0:
            spawner = SpawnerManager(self._uid, self._gid)
        else:  # the server already is the sandbox user
            spawner = SpawnerManager(os.geteuid(), os.getegid())
        spawner.start()
        self._spawner = spawner

    @property
    def private_dir(self) -> Path | None:
        """The backend's private directory (root's, 0711), while it runs."""
        return self._private_dir

    @property
    def spawner_pid(self) -> int | None:
        """The spawner process (it runs as the sandbox user, outside every sandbox)."""
        return self._spawner.pid if self._spawner is not None else None

    async def close(self) -> None:
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
            await self._spawner.close()
            self._spawner = None
        self.reap_orphans()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        if self._private_lock is not None:
            os.close(self._private_lock)
            self._private_lock = None
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

    @property
    def sandbox_gid(self) -> int:
        return self._gid

    def create_workspace(self, name: str) -> Path:
        """A workspace directory owned by the sandbox user (created if missing)."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", name) or name in (".", ".."):
            raise InvalidRequestError(f"invalid workspace name {name!r}")
        path = self.config.workspace_root / name
        path.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() == 0:
            os.chown(path, self._uid, self._gid)
        return path

    def remove_workspace(self, path: Path) -> None:
        if path.parent == self.config.workspace_root:
            shutil.rmtree(path, ignore_errors=True)

    # -- spawning ----------------------------------------------------------------------------

    def _fixed_args(self) -> list[str]:
        """The options every sandbox shares (computed once)."""
        if self._fixed is not None:
            return self._fixed
        args = [
            "--unshare-user",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            # No --disable-userns: the seccomp filter already refuses every way to a new
            # user namespace (unshare, clone with CLONE_NEWUSER, clone3), and the nested
            # namespace bwrap would make for it costs ~0.35 ms per start.
            "--die-with-parent",
            "--new-session",
            "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_UID),
            "--hostname", "sandbox",
            # The root is a read-only bind of a directory built at start: /etc, the merged-usr
            # symlinks and the mount points, in one mount (each mount costs bwrap ~0.1-0.3 ms
            # per sandbox; a read-only root needs no remount).
            "--ro-bind", str(self._root_dir), "/",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        if self.config.runtime_dir is not None:
            args += ["--ro-bind", str(self.config.runtime_dir), RUNTIME]
        for top in ROOT_TOPS:
            host = f"/{top}"
            if os.path.isdir(host) and not os.path.islink(host):
                args += ["--ro-bind", host, host]
        args += ["--proc", "/proc"]
        self._fixed = args
        return args

    def bwrap_args(
        self, spec: SandboxSpec, lease: Lease | None = None
    ) -> tuple[list[str], list[str]]:
        """bubblewrap's options for `spec` and the command it runs (through the egress relay
        when `lease` is this sandbox's socket on the proxy)."""
        tmp_size = str(spec.limits.tmp_size_mb * MIB)
        args = self._fixed_args().copy()
        if self._dev_dir is not None and not spec.limits.pseudo_terminals:
            # A /dev built at start (root-owned: the sandbox user cannot change it; the only
            # device nodes on it are ours; /dev/shm links to /tmp): one bind, where --dev
            # costs bwrap a tmpfs, six binds and a devpts, ~1.5 ms of CPU per sandbox.
            args += ["--dev-bind", str(self._dev_dir), "/dev"]
        else:
            # --dev's tmpfs (and /dev/shm in it) is writable and as big as half the RAM:
            # bound /dev/shm like /tmp and make the rest of /dev read-only.
            args += ["--dev", "/dev", "--size", tmp_size, "--tmpfs", "/dev/shm"]
            args += ["--remount-ro", "/dev"]
            if not spec.limits.pseudo_terminals:  # (a server that could not prebuild /dev)
                # An empty read-only tmpfs hides --dev's devpts: /dev/ptmx leads nowhere.
                args += ["--size", "4096", "--tmpfs", "/dev/pts", "--remount-ro", "/dev/pts"]
        args += [
            "--size", tmp_size, "--tmpfs", "/tmp",
            "--bind", str(spec.workspace), WORKSPACE,
        ]  # fmt: skip
        if spec.kernel_dir is not None:
            args += ["--bind", str(spec.kernel_dir), KERNEL_DIR]
        if lease is not None:
            # Read-only: the socket is connectable (a socket's permission is not the mount's)
            # but the sandbox cannot put another in its place. The relay is init: no bwrap
            # init above it, so the relay is what the command cannot signal.
            args += ["--ro-bind", str(lease.host_dir), SOCKET_DIR, "--as-pid-1"]
        args += ["--chdir", spec.cwd, "--clearenv"]
        for key, value in self._base_env().items():
            args += ["--setenv", key, value]
        if lease is not None:
            for key, value in EGRESS_ENV.items():
                args += ["--setenv", key, value]
        # The caller's variables act on the command only: bwrap execs nothing else, and the
        # rlimits are in place before the command starts. With egress, bwrap execs the relay:
        # the variables go to it as one JSON value it sets only in the command's process (an
        # LD_PRELOAD of the caller's must not load into the relay).
        if lease is not None:
            if spec.env:
                args += ["--setenv", RELAY_ENV, json.dumps(spec.env)]
        else:
            for key, value in spec.env.items():
                args += ["--setenv", key, value]
        command, extra = command_of(spec.argv)
        for key, value in extra.items():
            args += ["--setenv", key, value]
        if lease is not None:
            socket_path = f"{SOCKET_DIR}/{SOCKET_NAME}"
            command = [RELAY_PYTHON, "-I", "-S", "-B", RELAY_PATH, socket_path, str(RELAY_PORT),
                       *command]  # fmt: skip
        args += ["--seccomp", str(SECCOMP_FD), "--json-status-fd", str(STATUS_FD)]
        return args, command

    def _base_env(self) -> dict[str, str]:
        if self.config.runtime_dir is None:
            return BASE_ENV
        return {**BASE_ENV, "PATH": f"{RUNTIME}/bin:{BASE_ENV['PATH']}"}

    def rlimits(self, limits: SandboxLimits) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) the command runs under; the second layer under the cgroup.

        The spawner sets them on bwrap before bwrap reads its options, so the whole sandbox
        inherits them; the sandbox user cannot raise them again.
        """
        nofile = limits.open_files
        nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if nofile_hard != resource.RLIM_INFINITY:
            nofile = min(nofile, nofile_hard)
        out = [
            (resource.RLIMIT_CPU, limits.cpu_time_seconds, limits.cpu_time_seconds + 1),
            (resource.RLIMIT_FSIZE, limits.file_size_mb * MIB, limits.file_size_mb * MIB),
            (resource.RLIMIT_NOFILE, nofile, nofile),
            (resource.RLIMIT_CORE, 0, 0),
        ]
        if "memory" not in self.cgroups.controllers:  # no memory cgroup: address space instead
            out.append((resource.RLIMIT_AS, limits.memory_mb * MIB, limits.memory_mb * MIB))
        return out

    async def spawn(self, spec: SandboxSpec) -> SandboxProcess:
        """Start a sandbox.

        Raises SandboxUnavailableError, SandboxSpawnError, InvalidRequestError.
        """
        if self.unavailable_reason is not None or self._spawner is None:
            raise SandboxUnavailableError(self.unavailable_reason or "sandbox backend not started")
        validate_command(spec.argv)
        spec.env = validate_env(spec.env)
        assert self._seccomp_path is not None
        lease = await self._egress_lease(spec)
        try:
            proc = await self._spawn(spec, lease)
        except BaseException:
            if lease is not None and self.egress is not None:
                self._track(self.egress.close_lease(lease))
            raise
        if lease is not None:
            egress = self.egress
            assert egress is not None
            proc.add_closer(lambda: egress.close_lease(lease))
        return proc

    def can_prestart(self, spec: SandboxSpec) -> bool:
        """Whether a sandbox like `spec`'s can be started ahead of need: plain executions
        without egress (a relay is pid 1 of those), kernel sockets or inet sockets."""
        return (
            self.stub_problem is None
            and (spec.egress is None or not spec.egress.enabled)
            and spec.kernel_dir is None
            and not spec.loopback_inet
        )

    async def prestart(self, workspace: Path, limits: SandboxLimits) -> StartedSandbox:
        """Start a sandbox for `workspace` under `limits` ahead of need: everything an
        execution's sandbox is but its command (`launch` gives it one).

        Raises SandboxUnavailableError, SandboxSpawnError.
        """
        if self.unavailable_reason is not None or self._spawner is None:
            raise SandboxUnavailableError(self.unavailable_reason or "sandbox backend not started")
        if self.stub_problem is not None:
            raise SandboxUnavailableError(self.stub_problem)
        template = SandboxSpec(
            argv=[STUB_PERL, "-e", STUB_PROGRAM],
            workspace=workspace,
            limits=limits,
            interactive=True,  # stdin is a pipe; the stub opens /dev/null for the others
        )
        try:
            command_r, command_w = os.pipe2(os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxSpawnError(spawn_failure("could not make the command pipe", exc)) from exc
        try:
            proc = await self._spawn(template, None, command_r)
        except BaseException:
            os.close(command_w)
            raise
        if proc.running:  # (one that ended already has been seen off by its exit)
            self._waiting.add(proc)
        return StartedSandbox(proc, command_w, workspace, limits)

    def launch(self, started: StartedSandbox, spec: SandboxSpec) -> SandboxProcess:
        """Hand `spec`'s command to a sandbox started ahead (for the same workspace and
        limits); it serves this execution only. The wall-clock timeout, duration and CPU time
        count from now.

        Raises InvalidRequestError, SandboxSpawnError (it had ended, or is not for this call,
        or the command could not be handed over); the sandbox started ahead is ended then.
        """
        proc = started.proc
        try:
            validate_command(spec.argv)
            spec.env = validate_env(spec.env)
            if "\0" in spec.cwd:
                raise InvalidRequestError("working_directory must not contain NUL")
            if spec.workspace != started.workspace or spec.limits != started.limits:
                raise SandboxSpawnError("the sandbox started ahead is for another workspace")
            if not self.can_prestart(spec):
                raise SandboxSpawnError("this execution cannot run in a sandbox started ahead")
            command, extra = command_of(spec.argv)
            env = {**spec.env, **extra}
            fields = [spec.cwd, "i" if spec.interactive else "n", str(len(env)), str(len(command))]
            for key, value in env.items():
                fields += [key, value]
            payload = b"".join(f.encode("utf-8", "surrogatepass") + b"\0" for f in fields + command)
            fd = started.command_fd
            if fd is None or not proc.running:
                raise SandboxSpawnError("the sandbox started ahead has ended")
            try:
                if len(payload) > 65536:  # all of it at once: the stub reads only then
                    fcntl.fcntl(fd, F_SETPIPE_SZ, len(payload))
                os.set_blocking(fd, False)
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:  # (BlockingIOError: the pipe could not be made big enough)
                raise SandboxSpawnError(f"could not hand the sandbox its command: {exc}") from exc
        except BaseException:
            proc.kill("cancelled")  # first: a command cut short must never get to run
            started.close_command()
            self._track(proc.aclose())
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

    async def _egress_lease(self, spec: SandboxSpec) -> Lease | None:
        """This sandbox's socket on the egress proxy, if its policy allows anything.
        Raises SandboxUnavailableError, SandboxSpawnError (fails closed: no sandbox starts
        with a network it was to have but without the proxy between)."""
        if spec.egress is None or not spec.egress.enabled:
            return None
        if self.relay_problem is not None:
            raise SandboxUnavailableError(f"egress unavailable: {self.relay_problem}")
        if self.egress is None:
            raise SandboxUnavailableError("egress unavailable: the egress proxy is not running")
        return await self.egress.open(spec.egress, spec.on_denied)

    async def _spawn(
        self, spec: SandboxSpec, lease: Lease | None, command_r: int | None = None
    ) -> SandboxProcess:
        """Start `spec` (with `command_r` as its fd COMMAND_FD, consumed, when it is the stub
        of a sandbox started ahead)."""
        spawner = self._spawner
        assert spawner is not None
        options, command = self.bwrap_args(spec, lease)
        blob = b"".join(a.encode("utf-8", "surrogatepass") + b"\0" for a in options)
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
            try:
                if spec.interactive:
                    stdin_r, stdin_w = os.pipe()
                    ours.append(stdin_w)
                    theirs.append(stdin_r)
                    self._give_pipe(stdin_r)
                else:
                    theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
                for _ in range(2):  # stdout, stderr
                    r, w = os.pipe()
                    ours.append(r)
                    theirs.append(w)
                    self._give_pipe(w)
                inet = spec.loopback_inet or lease is not None  # (TCP to the relay on loopback)
                seccomp = self._seccomp_inet_path if inet else self._seccomp_path
                assert seccomp is not None
                theirs.append(os.open(seccomp, os.O_RDONLY | os.O_CLOEXEC))
                status_r, status_w = os.pipe()
                ours.append(status_r)
                theirs.append(status_w)
                args_r, args_w = os.pipe()
                theirs.append(args_r)
                if command_r is not None:
                    theirs.append(command_r)
                    command_r = None  # (closed with theirs from here)
                theirs.append(args_w)
                if len(blob) > 65536:  # all of it must fit: the spawner's write must not block
                    fcntl.fcntl(args_w, F_SETPIPE_SZ, len(blob))
            except OSError as exc:
                raise SandboxSpawnError(
                    spawn_failure("could not prepare the sandbox's pipes", exc)
                ) from exc
            bwrap_argv = [self._bwrap, "--args", str(ARGS_FD), "--", *command]
            spawning = spawner.request(
                bwrap_argv, blob, self.rlimits(spec.limits), theirs, cgroup_procs
            )
        except BaseException as exc:
            _close_all(ours + ([command_r] if command_r is not None else []))
            if cgroup is not None:
                self._release_later(cgroup, "unstarted sandbox")
            if is_exhaustion(exc.__cause__ or exc):
                self.cgroups.trim_idle()  # pooled groups hold descriptors: give them back
            raise
        finally:
            _close_all(theirs)
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
            streams = await _streams(stdout_r, stderr_r, stdin_fd)  # meanwhile
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
                if streams is not None:  # (_streams closes the fds itself when it fails)
                    close_streams(*streams)
                os.close(status_r)
                self._track(self._abandon_start(spawner, spawning, cgroup))
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
        """End what an abandoned start set going: wait for the spawner's answer (until then it
        may still move a process into the cgroup), kill that bwrap, then release the cgroup."""
        try:
            pid: int | None = await spawning
        except SandboxSpawnError:
            pid = None  # nothing runs: the spawner killed it, or died and took it along
        if pid is not None:
            spawner.forget(pid)
            kill_if_child(pid, spawner.pid)
        if cgroup is not None:
            cgroup.kill()
            await self._release_cgroup(cgroup, f"abandoned sandbox {pid}")

    def _on_exit(self, proc: SandboxProcess) -> None:
        self._running.discard(proc)
        self._waiting.discard(proc)
        self._track(self._after_exit(proc))

    async def _after_exit(self, proc: SandboxProcess) -> None:
        await proc.wait()  # reads the cgroup's counters before the cgroup goes
        if proc._cgroup is not None:
            await self._release_cgroup(proc._cgroup, f"sandbox {proc.pid}")

    def _release_later(self, cgroup: ExecutionCgroup, what: str) -> None:
        self._track(self._release_cgroup(cgroup, what))

    def _track(self, cleanup: Coroutine[object, object, None]) -> None:
        """Run `cleanup` in the background; close() waits for it."""
        task = asyncio.get_running_loop().create_task(cleanup)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _release_cgroup(self, cgroup: ExecutionCgroup, what: str) -> None:
        """Back to the pool (or removed) once its processes are gone; killed if they linger."""
        for delay in (0.0, 0.02, 0.1, 0.5, 2.0):
            await asyncio.sleep(delay)
            if self.cgroups.release(cgroup):
                return
            cgroup.kill()
        logger.warning("cgroup of {} could not be removed", what)

    def reap_orphans(self) -> int:
        """Reap zombie bwraps reparented to this server (a child subreaper) when their spawner
        died under them; normally the spawner reaps everything it starts."""
        reaped = 0
        for pid in _children(os.getpid()):
            if not self._is_orphaned_sandbox(pid):
                continue  # someone else's child: its owner waits for it
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            reaped += done != 0
        return reaped

    def _is_orphaned_sandbox(self, pid: int) -> bool:
        """A zombie bwrap running as the sandbox uid: only those were reparented to us."""
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uids = fields.get("Uid", "").split()
        return (
            fields.get("Name", "").strip() == "bwrap"
            and fields.get("State", "").strip().startswith("Z")
            and bool(uids)
            and int(uids[0]) == (self._uid if os.geteuid() == 0 else os.geteuid())
        )


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# A sandbox's stdout, stderr and (interactive) stdin, as the server sees them.
Streams = tuple[asyncio.StreamReader, asyncio.StreamReader, asyncio.StreamWriter | None]


async def _streams(stdout_r: int, stderr_r: int, stdin_w: int | None) -> Streams:
    """Streams over the server's ends of a sandbox's stdio pipes (the fds are consumed; on
    failure everything is closed)."""
    loop = asyncio.get_running_loop()
    # closefd=False: the transport closes the fd (libuv, under uvloop); uvloop then also
    # closes the file object it was given, expecting EBADF. A file object that owned the fd
    # would close that number a second time, and by then another thread (a ZeroMQ I/O
    # thread of an interpreter's client) may have been given it: that thread's fd would go.
    # (asyncio's own loop closes only the file object: there it must own the fd.)
    owns = not type(loop).__module__.startswith("uvloop")
    fds = [stdout_r, stderr_r, *([stdin_w] if stdin_w is not None else [])]
    files = [os.fdopen(fd, "rb" if i < 2 else "wb", 0, closefd=owns) for i, fd in enumerate(fds)]
    readers: list[asyncio.StreamReader] = []
    stdin: asyncio.StreamWriter | None = None
    try:
        for f in files[:2]:
            readers.append(await _reader(loop, f))
        if stdin_w is not None:
            stdin = await _writer(loop, files[2])
    except BaseException:
        close_streams(*readers, stdin)
        if owns:
            for f in files:  # (a file object a transport closed already is left as it is)
                f.close()
        else:
            _close_all(fds[len(readers) + (1 if stdin is not None else 0) :])  # no transport's
        raise
    return readers[0], readers[1], stdin


async def _reader(loop: asyncio.AbstractEventLoop, pipe: object) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=256 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader


async def _writer(loop: asyncio.AbstractEventLoop, pipe: object) -> asyncio.StreamWriter:
    protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
    transport, _ = await loop.connect_write_pipe(lambda: protocol, pipe)
    return asyncio.StreamWriter(transport, protocol, None, loop)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def _set_child_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno {}", ctypes.get_errno())
