"""The bubblewrap sandbox, end to end: isolation, limits, stopping and reaping (real bwrap)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import getpass
import itertools
import json
import os
import pwd
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from conftest import new_sandbox_backend, started_backend
from mcp_harness import traversable_by_others

import sandbox_runtime
from sandbox_runtime.config import Settings
from sandbox_runtime.errors import InvalidRequestError, PolicyViolationError, SandboxSpawnError
from sandbox_runtime.sandbox import (
    BubblewrapBackend,
    SandboxLimits,
    SandboxOutcome,
    SandboxProcess,
    SandboxSpec,
    shell_argv,
)
from sandbox_runtime.sandbox.argv import BASE_ENV
from sandbox_runtime.sandbox.cgroups import ExecutionCgroup

pytestmark = pytest.mark.integration

PYTHON = "/usr/bin/python3"
REPO_DIR = Path(sandbox_runtime.__file__).resolve().parent.parent


# -- helpers ----------------------------------------------------------------------------------


@dataclass
class Run:
    outcome: SandboxOutcome
    stdout: str
    stderr: str


async def spawn(
    backend: BubblewrapBackend,
    workspace: Path,
    command: str | list[str],
    *,
    limits: SandboxLimits | None = None,
    env: dict[str, str] | None = None,
    interactive: bool = False,
    wall_timeout: float | None = 20.0,
) -> SandboxProcess:
    argv = shell_argv(command) if isinstance(command, str) else command
    return await backend.spawn(
        SandboxSpec(
            argv=argv,
            workspace=workspace,
            limits=limits or backend.config.limits,
            env=env or {},
            interactive=interactive,
            timeout=wall_timeout,
        )
    )


async def collect(proc: SandboxProcess) -> Run:
    """Drain both pipes while waiting, so a chatty program never blocks on a full pipe."""
    try:
        out, err, outcome = await asyncio.gather(
            proc.stdout.read(), proc.stderr.read(), proc.wait()
        )
    finally:
        await proc.aclose()
    return Run(outcome, out.decode(errors="replace"), err.decode(errors="replace"))


async def run(
    backend: BubblewrapBackend, workspace: Path, command: str | list[str], **kw: object
) -> Run:
    return await collect(await spawn(backend, workspace, command, **kw))  # type: ignore[arg-type]


async def wait_until(
    condition: Callable[[], bool],
    within: float = 5.0,
    what: str = "condition",
    *,
    in_thread: bool = False,
) -> None:
    """Poll `condition` until it holds; fail the test at the deadline. `in_thread`: ask it in
    a thread, off the event loop (for a check that may block while the loop is measured)."""
    deadline = time.monotonic() + within
    while not (await asyncio.to_thread(condition) if in_thread else condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within}s waiting for {what}{_describe(what)}")
        await asyncio.sleep(0.02)


def _describe(what: str) -> str:
    """For a failure about sandbox processes: which processes are left."""
    if "zombie" in what:
        return ": " + "; ".join(
            f"{pid} {status_field(pid, 'Name')} uid={status_field(pid, 'Uid')} "
            f"ppid={status_field(pid, 'PPid')}"
            for pid in zombie_children()
        )
    if "sandbox uid" not in what:
        return ""
    uid = str(pwd.getpwnam("srt-sandbox").pw_uid)
    left = []
    for pid in host_pids():
        if uid in (status_field(pid, "Uid") or "").split():
            cmdline = read_proc(pid, "cmdline").replace(b"\0", b" ")[:120]
            cgroup = read_proc(pid, "cgroup").split(b"\n")[0]
            name, state = status_field(pid, "Name"), status_field(pid, "State")
            left.append(
                f"{pid} {name} {state} ppid={status_field(pid, 'PPid')} {cmdline!r} {cgroup!r}"
            )
    return ": " + "; ".join(left)


def host_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def read_proc(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile
        return b""


def status_field(pid: int, key: str) -> str | None:
    for line in read_proc(pid, "status").decode().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return None


def with_marker(marker: str, *, bwrap: bool = True) -> list[int]:
    """Host pids whose command line contains `marker` (bwrap's own too, unless `bwrap=False`)."""
    me = os.getpid()
    return [
        p
        for p in host_pids()
        if p != me
        and marker.encode() in read_proc(p, "cmdline")
        and (bwrap or read_proc(p, "comm") != b"bwrap\n")
    ]


def zombie_children(parent: int | None = None, mine: set[int | None] | None = None) -> list[int]:
    """Zombies of `parent` (default: this process). For this process, with `mine` (the pids of
    the backend's spawners), only the sandbox user's count (everything a backend starts runs
    as that user), and orphans of other tests' servers re-parented here are reaped first: a
    backend made this process a subreaper, so a killed server's spawner, or the browser of a
    console test, ends up here."""
    uid = str(pwd.getpwnam("srt-sandbox").pw_uid)
    if parent is None and mine is not None:
        reap_orphaned_zombies(uid, mine)
    me = str(os.getpid() if parent is None else parent)
    out = []
    for pid in host_pids():
        stat = read_proc(pid, "stat").decode()
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2 and fields[0] == "Z" and fields[1] == me:
            if mine is None or uid in (status_field(pid, "Uid") or "").split():
                out.append(pid)
    return out


def sandbox_uid_processes(backend: BubblewrapBackend) -> list[int]:
    """Processes running as the sandbox user that belong to this backend.

    Owned by this backend means in one of its cgroups or descended from this test process
    (which is a child subreaper, so escaped daemons would be re-parented to it); the
    backend's spawner, which runs as the sandbox user outside every sandbox, is not counted.
    """
    uid = str(pwd.getpwnam(backend.config.sandbox_user).pw_uid)
    group = backend.cgroups.name  # the backend's parent group
    reap_orphaned_zombies(uid)
    ours = set(descendants(os.getpid()))
    found = []
    for pid in host_pids():
        uids = (status_field(pid, "Uid") or "").split()
        if uid not in uids or pid == backend.spawner_pid:
            continue
        if pid in ours or f"/{group}/".encode() in read_proc(pid, "cgroup"):
            found.append(pid)
    return found


def reap_orphaned_zombies(uid: str, keep: set[int | None] | None = None) -> None:
    """Reap zombies of `uid` re-parented to this test process (but those in `keep`), as init
    would: a backend made it a child subreaper, so the spawner of a server another test
    killed ends up here."""
    me = str(os.getpid())
    for pid in host_pids():
        if (
            pid not in (keep or set())
            and status_field(pid, "PPid") == me
            and (status_field(pid, "State") or "").startswith("Z")
            and uid in (status_field(pid, "Uid") or "").split()
        ):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def descendants(root: int) -> list[int]:
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone meanwhile
            continue
        for tid in tids:
            for child in read_proc(pid, f"task/{tid}/children").split():
                found.append(int(child))
                stack.append(int(child))
    return found


def execution_cgroups(backend: BubblewrapBackend) -> list[Path]:
    bases = backend.cgroups.bases
    return [d for base in bases if base.is_dir() for d in base.iterdir() if d.is_dir()]


def busy_execution_cgroups(backend: BubblewrapBackend) -> list[Path]:
    """Execution cgroups with processes in them (ended executions' groups are pooled empty)."""
    return [d for d in execution_cgroups(backend) if read_proc_file(d / "cgroup.procs").strip()]


def read_proc_file(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # removed meanwhile
        return ""


# Reports, as JSON, what happens when the sandbox tries to read or write each path.
PROBE = """
import errno, json, os, sys
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
def read(p):
    if os.path.isdir(p):
        os.listdir(p)
    else:
        open(p, "rb").read(1)
def write(p):
    with open(p, "w") as f:
        f.write("pwned")
mode, paths = sys.argv[1], sys.argv[2:]
print(json.dumps({p: attempt(lambda p=p: (read if mode == "read" else write)(p)) for p in paths}))
"""


# -- isolation --------------------------------------------------------------------------------


async def test_sandbox_cannot_read_host_secrets_or_server_files(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    other = sandbox_backend.create_workspace("other")
    (other / "secret.txt").write_text("other tenant's secret")
    (sandbox_workspace / "mine.txt").write_text("readable")
    private_dir = sandbox_backend._private_dir  # seccomp program and generated /etc files
    assert private_dir is not None
    forbidden = [
        "/etc/shadow",
        "/root",
        str(REPO_DIR),
        str(REPO_DIR / "pyproject.toml"),
        str(Path(sandbox_runtime.__file__).parent),
        sandbox_runtime.__file__,
        str(sandbox_backend.config.workspace_root),
        str(sandbox_backend.config.workspace_root.parent),
        str(other),
        str(other / "secret.txt"),
        "/workspace/../other/secret.txt",
        str(private_dir),
        str(private_dir / "seccomp.bpf"),
    ]
    result = await run(
        sandbox_backend,
        sandbox_workspace,
        [PYTHON, "-c", PROBE, "read", "/workspace/mine.txt", *forbidden],
    )
    assert result.outcome.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen.pop("/workspace/mine.txt") == "ok"  # the probe itself works
    readable = {path: how for path, how in seen.items() if how == "ok"}
    assert readable == {}
    assert "other tenant's secret" not in result.stdout


async def test_sandbox_cannot_write_outside_workspace_and_tmp(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    outside = ["/usr/pwned", "/usr/bin/pwned", "/etc/pwned", "/etc/passwd", "/pwned", "/proc/pwned"]
    outside += ["/dev/pwned", "/dev/null/pwned"]
    outside.append(str(sandbox_backend.config.workspace_root / "pwned"))
    result = await run(
        sandbox_backend,
        sandbox_workspace,
        [PYTHON, "-c", PROBE, "write", "/workspace/ok.txt", "/tmp/ok.txt", *outside],
    )
    assert result.outcome.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen.pop("/workspace/ok.txt") == "ok"
    assert seen.pop("/tmp/ok.txt") == "ok"
    assert {path: how for path, how in seen.items() if how == "ok"} == {}
    assert not (sandbox_backend.config.workspace_root / "pwned").exists()
    assert (sandbox_workspace / "ok.txt").read_text() == "pwned"


# Lists /dev (following no links), then uses what a program expects there.
DEV_PROBE = """
import json, multiprocessing, os, stat
entries = {}
for name in sorted(os.listdir("/dev")):
    st = os.lstat("/dev/" + name)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        kind = "chr" if stat.S_ISCHR(st.st_mode) else "blk"
        entries[name] = [kind, os.major(st.st_rdev), os.minor(st.st_rdev)]
    else:
        entries[name] = "link" if stat.S_ISLNK(st.st_mode) else "other"
with open("/dev/null", "w") as f:
    f.write("discarded")
used = {
    "zero": open("/dev/zero", "rb").read(4).hex(),
    "urandom": len(open("/dev/urandom", "rb").read(16)),
    "stdout": os.readlink("/dev/stdout"),
}
lock = multiprocessing.Lock()  # a POSIX semaphore in /dev/shm
with lock:
    used["lock"] = True
print(json.dumps({"entries": entries, "used": used}))
"""
# The character devices a sandbox may have: null, zero, full, random, urandom, tty and, with
# bwrap's own /dev, the pty multiplexer.
HARMLESS_DEVICES = {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2)}


async def test_sandbox_dev_holds_only_harmless_devices_and_they_work(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    private_dir = sandbox_backend._private_dir
    assert private_dir is not None
    if os.geteuid() == 0 and not os.statvfs(private_dir).f_flag & os.ST_NODEV:
        assert sandbox_backend.dev_problem is None  # the cheap prebuilt /dev is in use
    result = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", DEV_PROBE])
    assert result.outcome.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    nodes = {name: e for name, e in seen["entries"].items() if isinstance(e, list)}
    assert all(kind == "chr" for kind, _, _ in nodes.values()), nodes  # no block devices
    assert {"null", "zero", "full", "random", "urandom", "tty"} <= set(nodes)
    assert {(major, minor) for _, major, minor in nodes.values()} <= HARMLESS_DEVICES, nodes
    assert seen["used"] == {"zero": "00000000", "urandom": 16, "stdout": "/proc/self/fd/1",
                            "lock": True}  # fmt: skip


async def test_the_prebuilt_dev_is_roots_shared_read_only_and_its_shm_is_the_bounded_tmp(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    dev = sandbox_backend._dev_dir
    if dev is None:
        pytest.fail(f"no prebuilt /dev on this host: {sandbox_backend.dev_problem}")
    # Every sandbox binds this one directory: only root may change anything in it.
    assert (os.stat(dev).st_uid, stat.S_IMODE(os.stat(dev).st_mode)) == (0, 0o755)
    for entry in dev.iterdir():
        st = os.lstat(entry)
        assert st.st_uid == 0, entry
        if stat.S_ISCHR(st.st_mode):
            assert stat.S_IMODE(st.st_mode) == 0o666, entry
    script = (
        "readlink /dev/shm; chmod 000 /dev/null || echo no-chmod; ln -s x /dev/y || echo no-ln; "
        "head -c 3000000 /dev/zero > /dev/shm/fill; echo shm-write=$?; "
        "df -k /dev/shm/ | tail -1 | awk '{print $2}'"
    )
    limits = replace(sandbox_backend.config.limits, tmp_size_mb=2)
    result = await run(sandbox_backend, sandbox_workspace, script, limits=limits)
    lines = result.stdout.split()
    assert lines[:3] == ["/tmp", "no-chmod", "no-ln"], result.stdout + result.stderr
    assert lines[3] == "shm-write=1" and "No space left" in result.stderr  # 2 MiB, no more
    assert lines[4] == str(2 * 1024)
    assert stat.S_IMODE(os.stat(dev / "null").st_mode) == 0o666


async def test_stdout_and_stderr_can_be_reopened_by_path(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    result = await run(
        sandbox_backend,
        sandbox_workspace,
        "echo to-stdout > /dev/stdout; echo to-stderr > /dev/stderr; echo fd1 >> /proc/self/fd/1",
    )
    assert result.outcome.exit_code == 0, result.stderr
    assert result.stdout == "to-stdout\nfd1\n"
    assert result.stderr == "to-stderr\n"

    proc = await spawn(sandbox_backend, sandbox_workspace, "cat /dev/stdin", interactive=True)
    assert proc.stdin is not None
    proc.stdin.write(b"typed in\n")
    await proc.stdin.drain()
    proc.stdin.close()
    typed = await collect(proc)
    assert (typed.stdout, typed.outcome.exit_code) == ("typed in\n", 0), typed.stderr


# Says whether a pseudo-terminal can be had.
OPENPTY = """
import os
try:
    main, tty = os.openpty()
    print("pty", os.ttyname(tty))
except OSError as exc:
    print("no pty", exc.errno)
"""


async def test_pseudo_terminals_only_where_the_server_allows_them(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    server = sandbox_backend.config.limits
    assert server.pseudo_terminals is False  # the default
    result = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", OPENPTY])
    assert result.stdout == f"no pty {errno.ENOENT}\n", result.stderr
    with pytest.raises(PolicyViolationError, match="pseudo_terminals"):
        server.tighten({"pseudo_terminals": True})

    assert Settings(pseudo_terminals=True, _env_file=None).limits().pseudo_terminals  # type: ignore[call-arg]
    allowing = replace(server, pseudo_terminals=True)  # a server that allows them
    result = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", OPENPTY], limits=allowing)
    assert result.stdout == "pty /dev/pts/0\n", result.stderr  # a devpts of its own
    # No other line discipline (one could autoload a module with a history of holes).
    set_ldisc = OPENPTY + (
        "import errno, fcntl, struct\n"
        "try:\n"
        "    fcntl.ioctl(tty, 0x5423, struct.pack('i', 0))\n"  # TIOCSETD, even to N_TTY
        "    print('ldisc set')\n"
        "except OSError as exc:\n"
        "    print('ldisc', errno.errorcode[exc.errno])\n"
    )
    result = await run(
        sandbox_backend, sandbox_workspace, [PYTHON, "-c", set_ldisc], limits=allowing
    )
    assert result.stdout == "pty /dev/pts/0\nldisc EPERM\n", result.stderr
    off = allowing.tighten({"pseudo_terminals": False})  # a caller turns them off
    result = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", OPENPTY], limits=off)
    assert result.stdout == f"no pty {errno.ENOENT}\n", result.stderr


async def test_where_device_nodes_cannot_be_made_bwraps_dev_is_used_minimal_and_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")  # as without CAP_MKNOD

    backend = new_sandbox_backend(tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(os, "mknod", refuse)
        backend.start()
    try:
        assert backend.unavailable_reason is None, backend.unavailable_reason
        assert backend.dev_problem is not None and "not permitted" in backend.dev_problem
        workspace = backend.create_workspace("ws")
        result = await run(backend, workspace, [PYTHON, "-c", DEV_PROBE])
        assert result.outcome.exit_code == 0, result.stderr
        nodes = {
            n: e for n, e in json.loads(result.stdout)["entries"].items() if isinstance(e, list)
        }
        assert {(major, minor) for _, major, minor in nodes.values()} <= HARMLESS_DEVICES, nodes
        written = await run(
            backend,
            workspace,
            [PYTHON, "-c", PROBE, "write", "/dev/pwned", "/dev/pts/pwned", "/dev/shm/ok"],
        )
        assert json.loads(written.stdout) == {
            "/dev/pwned": "EROFS", "/dev/pts/pwned": "EROFS", "/dev/shm/ok": "ok"
        }  # fmt: skip
        result = await run(backend, workspace, [PYTHON, "-c", OPENPTY])
        assert result.stdout == f"no pty {errno.ENOENT}\n", result.stderr  # devpts hidden
        allowing = replace(backend.config.limits, pseudo_terminals=True)
        result = await run(backend, workspace, [PYTHON, "-c", OPENPTY], limits=allowing)
        assert result.stdout == "pty /dev/pts/0\n", result.stderr
    finally:
        await backend.aclose()


async def test_private_directories_of_servers_that_are_gone_are_removed_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "tmp"  # the servers' TMPDIR
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def private_dir(name: str, lock: bool) -> Path:
        path = temp / f"srt-sandbox-{name}"
        (path / "root" / "dev").mkdir(parents=True)
        if lock:
            (path / "lock").touch()
        return path

    gone = private_dir("gone", lock=True)  # its server died: nobody holds the lock
    someone_elses = private_dir("nobodys", lock=True)  # unlocked, but not this user's
    for path in (someone_elses, someone_elses / "lock"):
        os.chown(path, 65534, 65534)
    (temp / "srt-sandbox-link").symlink_to(someone_elses)  # a link is never followed
    live = private_dir("live", lock=True)
    being_made = private_dir("new", lock=False)  # (or an older server's: left alone)
    held = os.open(live / "lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a live server does
    try:
        backend = new_sandbox_backend(tmp_path)
        backend.start()
        try:
            assert backend.unavailable_reason is None, backend.unavailable_reason
            assert backend._private_dir is not None and backend._private_dir.parent == temp
            assert not gone.exists()
            assert live.exists() and being_made.exists() and someone_elses.exists()
        finally:
            await backend.aclose()
        assert sorted(p.name for p in temp.iterdir()) == [
            "srt-sandbox-link", "srt-sandbox-live", "srt-sandbox-new", "srt-sandbox-nobodys"
        ]  # fmt: skip
    finally:
        os.close(held)


async def test_sandbox_sees_only_its_own_processes(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    script = (
        "import json, os\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "print(json.dumps({p: open(f'/proc/{p}/comm').read().strip() for p in pids}))\n"
    )
    result = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", script])
    assert result.outcome.exit_code == 0, result.stderr
    inside = {int(pid): comm for pid, comm in json.loads(result.stdout).items()}
    assert os.getpid() not in inside
    assert set(inside.values()) <= {"bwrap", "python3"}, inside  # bwrap's init + the probe
    assert len(inside) <= 3
    assert max(inside) < 10  # a fresh pid namespace, not host pids


async def test_sandbox_cannot_reach_a_tcp_server_on_host_loopback(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    connections: list[object] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        connect = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=3).sendall(b'hi')\n"
            "print('connected')\n"
        )
        result = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", connect])
        assert result.outcome.exit_code != 0
        assert "connected" not in result.stdout
        # seccomp refuses AF_INET sockets (EAFNOSUPPORT); the empty network namespace would
        # refuse the connection next (ENETUNREACH / ECONNREFUSED).
        assert re.search(r"Error: \[Errno (97|101|111)\]", result.stderr), result.stderr

        # Control: a host connection made afterwards is seen, and is the only one.
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await wait_until(lambda: len(connections) >= 1, what="the control connection")
        writer.close()
        assert len(connections) == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_sandbox_environment_holds_only_the_callers_variables(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_name = f"SRT_TEST_SECRET_{uuid.uuid4().hex.upper()}"
    secret_value = uuid.uuid4().hex
    monkeypatch.setenv(secret_name, secret_value)
    result = await run(sandbox_backend, sandbox_workspace, "env", env={"CALLER_VAR": "arrives"})
    assert result.outcome.exit_code == 0, result.stderr
    names = {line.split("=", 1)[0] for line in result.stdout.splitlines()}
    assert "CALLER_VAR=arrives" in result.stdout.splitlines()
    assert secret_name not in names
    assert secret_value not in result.stdout
    # Nothing but the fixed base set, the caller's variables and what the shell itself adds.
    assert names <= {*BASE_ENV, "CALLER_VAR", "PWD", "SHLVL", "_"}, names
    assert "HOME=/workspace" in result.stdout.splitlines()


# Calls mount(2) and unshare(2) directly, so no tool's own uid check hides what the kernel says.
MOUNT_UNSHARE = """
import ctypes, errno, json, os, platform, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_CLONE, SYS_CLONE3 = {"x86_64": (56, 435), "aarch64": (220, 435)}[platform.machine()]
def err(rc):
    if rc == 0:  # a clone that worked: this is the child
        os._exit(0)
    return errno.errorcode.get(ctypes.get_errno(), "?") if rc < 0 else "ok"
def clone(flags):
    return libc.syscall(SYS_CLONE, ctypes.c_ulong(flags | signal.SIGCHLD), 0, 0, 0, 0)
print(json.dumps({
    "mount": err(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "unshare_user": err(libc.unshare(0x10000000)),
    "unshare_mount": err(libc.unshare(0x00020000)),
    "unshare_net": err(libc.unshare(0x40000000)),
    "clone_newuser": err(clone(0x10000000)),
    "clone_newns": err(clone(0x00020000)),
    "clone3": err(libc.syscall(SYS_CLONE3, None, 0)),
}))
"""


async def test_sandbox_cannot_mount_or_unshare_and_runs_unprivileged(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    result = await run(
        sandbox_backend,
        sandbox_workspace,
        "mount -t tmpfs none /tmp; echo mount=$?; "
        "unshare --user --map-root-user true; echo unshare_user=$?; "
        "unshare --mount true; echo unshare_mount=$?; "
        "grep -E '^(Seccomp|NoNewPrivs|CapEff|CapPrm|CapBnd):' /proc/self/status; "
        "touch /workspace/made-inside",
    )
    assert result.outcome.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    for probe in ("mount", "unshare_user", "unshare_mount"):
        code = next(int(x.split("=")[1]) for x in lines if x.startswith(probe + "="))
        assert code != 0, f"{probe} succeeded inside the sandbox"
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    assert status["Seccomp"] == "2"
    assert status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0
    assert int(status["CapPrm"], 16) == 0
    # On the host, what the sandbox creates belongs to the unprivileged sandbox user.
    sandbox_uid = pwd.getpwnam(sandbox_backend.config.sandbox_user).pw_uid
    assert sandbox_uid != 0
    assert (sandbox_workspace / "made-inside").stat().st_uid == sandbox_uid
    assert result.stderr.count("Operation not permitted") >= 2, result.stderr  # unshare(1)

    syscalls = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", MOUNT_UNSHARE])
    assert syscalls.outcome.exit_code == 0, syscalls.stderr
    assert json.loads(syscalls.stdout) == {
        "mount": "EPERM",
        "unshare_user": "EPERM",
        "unshare_mount": "EPERM",
        "unshare_net": "EPERM",
        "clone_newuser": "EPERM",  # user namespaces: refused by the filter, not by bwrap
        "clone_newns": "EPERM",
        "clone3": "ENOSYS",  # its flags are out of the filter's sight: libc falls back to clone
    }


async def test_sandboxed_processes_run_as_the_unprivileged_host_uid(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    marker = f"srt-uid-{uuid.uuid4().hex}"
    proc = await spawn(
        sandbox_backend,
        sandbox_workspace,
        f"echo ready; sh -c 'sleep 30; :' {marker}",
        wall_timeout=10,
    )
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 5) == b"ready\n"
        await wait_until(lambda: proc.child_pid is not None, what="bwrap's child pid")
        await wait_until(lambda: bool(with_marker(marker)), what="the marked sleeper")
        inside = with_marker(marker)
        sandbox_uid = str(pwd.getpwnam(sandbox_backend.config.sandbox_user).pw_uid)
        for pid in [*inside, proc.child_pid]:
            assert pid is not None
            uids = status_field(pid, "Uid")
            assert uids is not None and set(uids.split()) == {sandbox_uid}, (pid, uids)
            cap_eff = status_field(pid, "CapEff")
            assert cap_eff is not None and int(cap_eff, 16) == 0
    finally:
        proc.kill()
        await proc.aclose()


# -- limits -----------------------------------------------------------------------------------


# Every process forks forever and shrugs off failures (a shell bomb gives up when fork fails).
FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


async def test_fork_bomb_is_held_by_pids_limit_while_host_stays_responsive(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    marker = f"srt-bomb-{uuid.uuid4().hex}"
    limits = sandbox_backend.config.limits.tighten({"pids": 32})
    argv = [PYTHON, "-c", FORK_BOMB, marker]
    bomb = await spawn(sandbox_backend, sandbox_workspace, argv, limits=limits, wall_timeout=4)
    bomb_result = asyncio.ensure_future(collect(bomb))

    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    # The ticks measure the backend's event loop. The test's own reads of the bomb's /proc
    # entries run in a thread: reading a forking process's cmdline waits for its memory map,
    # which a bomb throttled by its CPU quota may hold for a whole period on a busy machine.
    tick_task = asyncio.ensure_future(ticker())
    try:
        await wait_until(
            lambda: len(with_marker(marker)) >= 30, what="the fork bomb to spread", in_thread=True
        )
        started = time.monotonic()
        ok = await run(sandbox_backend, sandbox_workspace, "echo ok", wall_timeout=5)
        elapsed = time.monotonic() - started
        assert ok.outcome.exit_code == 0 and ok.stdout == "ok\n"
        assert elapsed < 2.0, f"a sandbox took {elapsed:.2f}s during the fork bomb"
        assert bomb.running, "the bomb ended before we measured the host under it"
        # 32 in the execution's cgroup, bwrap's two processes (outside and init) among them
        assert len(await asyncio.to_thread(with_marker, marker, bwrap=False)) <= 30
        outcome = (await bomb_result).outcome
    finally:
        tick_task.cancel()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert max(gaps) < 0.5, f"event loop stalled for {max(gaps):.2f}s"
    assert outcome.reason == "timeout"
    assert "pids" in outcome.limits_reached
    await wait_until(lambda: not with_marker(marker), what="the fork bomb to be gone")
    await wait_until(lambda: not sandbox_uid_processes(sandbox_backend), what="no sandbox uid")
    await wait_until(lambda: not busy_execution_cgroups(sandbox_backend), what="cgroups empty")


async def test_memory_hog_is_killed_and_reported_as_memory(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    limits = sandbox_backend.config.limits.tighten({"memory_mb": 64})
    hog = "a = [str(i % 10) * 10**6 for i in range(2000)]\nprint('survived')"
    result = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", hog], limits=limits)
    assert result.outcome.reason == "memory"
    assert "memory" in result.outcome.limits_reached
    assert result.outcome.signal == signal.SIGKILL
    assert "survived" not in result.stdout


async def test_reused_cgroup_reports_only_its_own_execution(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    hog = "a = [str(i % 10) * 10**6 for i in range(2000)]"
    tight = sandbox_backend.config.limits.tighten({"memory_mb": 64, "pids": 8})

    async def run_pooled(command: str, limits: SandboxLimits | None = None) -> Run:
        await wait_until(lambda: sandbox_backend.cgroups.idle_count == 1, what="a pooled group")
        pooled = set(execution_cgroups(sandbox_backend))
        result = await run(sandbox_backend, sandbox_workspace, command, limits=limits)
        assert set(execution_cgroups(sandbox_backend)) == pooled  # no new group: reused
        return result

    forks = await run(
        sandbox_backend, sandbox_workspace, "for i in $(seq 20); do sleep 1 & done", limits=tight
    )
    assert "pids" in forks.outcome.limits_reached
    hogged = await run_pooled(f"{PYTHON} -c '{hog}'", tight)
    assert hogged.outcome.reason == "memory"
    assert hogged.outcome.limits_reached == ["memory"]  # the pids hits were the first's
    quiet = await run_pooled(f"{PYTHON} -c 'x = bytearray(10**6)'")
    assert (quiet.outcome.exit_code, quiet.outcome.limits_reached) == (0, [])
    assert quiet.outcome.memory_peak_bytes is not None
    assert quiet.outcome.memory_peak_bytes < 64 * 1024 * 1024  # its own peak
    assert quiet.outcome.cpu_seconds is not None and quiet.outcome.cpu_seconds < 5
    big = await run_pooled(f"{PYTHON} -c 'x = bytearray(100 * 10**6); x[::4096] = b\"1\" * 24415'")
    assert big.outcome.exit_code == 0, big.outcome  # the server's 256 MB again, not 64
    assert big.outcome.memory_peak_bytes is not None
    assert big.outcome.memory_peak_bytes > 64 * 1024 * 1024


async def test_busy_loop_hits_cpu_time_limit(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    limits = sandbox_backend.config.limits.tighten({"cpu_time_seconds": 1})
    result = await run(
        sandbox_backend, sandbox_workspace, "while :; do :; done", limits=limits, wall_timeout=15
    )
    assert result.outcome.reason == "cpu"
    assert "cpu" in result.outcome.limits_reached
    assert result.outcome.signal in (signal.SIGXCPU, signal.SIGKILL)
    assert result.outcome.duration_s < 10


async def test_large_file_is_stopped_at_file_size_limit(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    limits = sandbox_backend.config.limits.tighten({"file_size_mb": 1})
    # dd does not handle SIGXFSZ: the kernel kills it, and the outcome says why.
    dd = await run(
        sandbox_backend,
        sandbox_workspace,
        "dd if=/dev/zero of=/workspace/big.dd bs=1M count=5",
        limits=limits,
    )
    assert dd.outcome.reason == "file_size"
    assert dd.outcome.signal == signal.SIGXFSZ
    assert (sandbox_workspace / "big.dd").stat().st_size <= 1024 * 1024
    # Python ignores SIGXFSZ: its write fails with EFBIG instead and the program decides.
    write = (
        "try:\n"
        "    open('/workspace/big.py', 'wb').write(b'x' * 5 * 2**20)\n"
        "except OSError as exc:\n"
        "    print(exc.errno)\n"
    )
    py = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", write], limits=limits)
    assert py.outcome.exit_code == 0, py.stderr
    assert py.stdout.strip() == str(errno.EFBIG)
    assert (sandbox_workspace / "big.py").stat().st_size <= 1024 * 1024


# -- stopping and reaping ---------------------------------------------------------------------

# Ignores SIGTERM, forks grandchildren (which inherit that) and a daemon that double-forks
# into a new session. Forked children keep the parent's command line, marker included.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
for _ in range(3):
    if os.fork() == 0:
        time.sleep(1000)
        os._exit(0)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)
    os._exit(0)
print("ready", flush=True)
time.sleep(1000)
"""


async def test_terminate_kills_sigterm_ignoring_child_grandchildren_and_daemons(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    marker = f"srt-stubborn-{uuid.uuid4().hex}"
    proc = await spawn(sandbox_backend, sandbox_workspace, [PYTHON, "-c", STUBBORN, marker])
    assert await asyncio.wait_for(proc.stdout.readline(), 5) == b"ready\n"
    # main + 3 grandchildren + the daemon (its intermediate parent exits)
    await wait_until(
        lambda: len(with_marker(marker, bwrap=False)) == 5, what="all five stubborn processes"
    )
    await proc.terminate(grace=0.3)
    outcome = await asyncio.wait_for(proc.wait(), 5)
    await proc.aclose()
    assert outcome.reason == "cancelled"
    assert outcome.signal == signal.SIGKILL
    await wait_until(lambda: not with_marker(marker), what="every stubborn process to be gone")
    await wait_until(lambda: not sandbox_uid_processes(sandbox_backend), what="no sandbox uid")
    await wait_until(lambda: not busy_execution_cgroups(sandbox_backend), what="cgroup empty")


async def test_no_zombies_or_stray_processes_remain_after_200_runs(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    commands = [
        "true",
        "echo hi",
        "exit 3",
        "(sleep 5 &); true",  # leaves a daemonized child behind in the sandbox
        "sleep 5 & exit 0",  # leaves a background child behind
        "kill -9 $$",
    ]
    outcomes: list[SandboxOutcome] = []
    for i in range(120):
        outcomes.append((await run(sandbox_backend, sandbox_workspace, commands[i % 6])).outcome)
    for batch in range(10):
        results = await asyncio.gather(
            *(run(sandbox_backend, sandbox_workspace, commands[(batch + j) % 6]) for j in range(8))
        )
        outcomes += [r.outcome for r in results]
    assert len(outcomes) == 200
    assert all(o.started for o in outcomes)
    assert sum(o.exit_code == 3 for o in outcomes) >= 30
    mine = {sandbox_backend.spawner_pid}
    await wait_until(lambda: not zombie_children(mine=mine), what="no zombie children")
    spawner = sandbox_backend.spawner_pid
    await wait_until(lambda: not zombie_children(spawner), what="no zombies of the spawner")
    await wait_until(lambda: not sandbox_uid_processes(sandbox_backend), what="no sandbox uid")
    await wait_until(lambda: not busy_execution_cgroups(sandbox_backend), what="cgroups empty")
    assert sandbox_backend.running_count == 0
    groups = {d.name for d in execution_cgroups(sandbox_backend)}
    assert len(groups) <= sandbox_backend.config.cgroup_pool  # only the pool of idle ones
    await sandbox_backend.aclose()
    assert not execution_cgroups(sandbox_backend)


# -- the spawner ------------------------------------------------------------------------------


@pytest.mark.no_launch
async def test_spawner_runs_as_the_sandbox_user_with_no_privileges(
    sandbox_backend: BubblewrapBackend,
) -> None:
    spawner = sandbox_backend.spawner_pid
    assert spawner is not None
    sandbox_uid = pwd.getpwnam(sandbox_backend.config.sandbox_user)
    assert status_field(spawner, "Uid") == "\t".join([str(sandbox_uid.pw_uid)] * 4)
    assert status_field(spawner, "Gid") == "\t".join([str(sandbox_uid.pw_gid)] * 4)
    assert status_field(spawner, "Groups") == ""
    for capabilities in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status_field(spawner, capabilities) or "ff", 16) == 0, capabilities
    assert status_field(spawner, "NoNewPrivs") == "1"
    assert read_proc(spawner, "environ") == b""  # unreadable (not dumpable) or empty


async def test_killed_spawner_ends_its_sandboxes_and_a_new_one_takes_over(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    marker = f"srt-orphan-{uuid.uuid4().hex}"
    proc = await spawn(sandbox_backend, sandbox_workspace, f"echo up; sh -c 'sleep 60; :' {marker}")
    assert await asyncio.wait_for(proc.stdout.readline(), 5) == b"up\n"
    await wait_until(lambda: bool(with_marker(marker, bwrap=False)), what="the marked sleeper")
    old = sandbox_backend.spawner_pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    result = await asyncio.wait_for(collect(proc), 10)
    assert result.outcome.signal == signal.SIGKILL
    await wait_until(lambda: not with_marker(marker), what="the sandbox gone with its spawner")
    again = await run(sandbox_backend, sandbox_workspace, "echo again")
    assert (again.outcome.exit_code, again.stdout) == (0, "again\n")
    assert sandbox_backend.spawner_pid not in (None, old)
    mine = {old, sandbox_backend.spawner_pid}
    await wait_until(lambda: not zombie_children(mine=mine), what="no zombie children")


async def test_a_start_cancelled_at_any_point_never_leaves_a_sandbox_running(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    """Cancelled before spawn() returns: what the spawner started is killed once it answers, and
    whatever of it ran had its limits (the spawner sets them, and the cgroups, before bwrap gets
    its options). Returned: the caller owns and ends it. Either way nothing is left running."""
    limits = sandbox_backend.config.limits.tighten({"open_files": 77})
    cancelled: list[int] = []
    for i in range(120):
        task = asyncio.ensure_future(
            spawn(
                sandbox_backend,
                sandbox_workspace,
                f"ulimit -n > /workspace/ran-{i}; sleep 30",
                limits=limits,
            )
        )
        if i < 20:
            for _ in range(i):  # every await point of the start
                await asyncio.sleep(0)
        else:  # the spawner's answer arriving meanwhile, at any moment of its first 2 ms
            await asyncio.sleep((i - 20) * 0.00002)
        task.cancel()
        try:
            proc = await task
        except asyncio.CancelledError:
            cancelled.append(i)
            continue
        proc.kill()
        await collect(proc)
    assert cancelled, "no start was cancelled in time: the test proves nothing"
    # The backend still serves after all that (on a slow machine every start may have been
    # cancelled: this one is not).
    after = await run(sandbox_backend, sandbox_workspace, "ulimit -n", limits=limits)
    assert after.stdout == "77\n", after
    await wait_until(lambda: not sandbox_uid_processes(sandbox_backend), what="no sandbox uid")
    await wait_until(lambda: not busy_execution_cgroups(sandbox_backend), what="cgroups empty")
    assert sandbox_backend.running_count == 0
    for name in os.listdir(sandbox_workspace):
        if name.startswith("ran-"):
            assert (sandbox_workspace / name).read_text() in ("", "77\n"), name


async def test_a_sandbox_the_spawner_cannot_move_into_its_cgroup_never_runs(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spawner moves bwrap into the execution's cgroups before it hands bwrap its options;
    if that fails, bwrap is killed with nothing run and the start fails with the cause."""
    if sandbox_backend.cgroups.version == "none":
        pytest.fail("this test needs the backend's cgroups (run it as root)")
    refusing = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # any write to it fails
    try:
        monkeypatch.setattr(ExecutionCgroup, "procs_fds", lambda self: [refusing])
        with pytest.raises(
            SandboxSpawnError, match=r"could not move it into its cgroup: .*Bad file descriptor"
        ):
            await spawn(sandbox_backend, sandbox_workspace, "touch /workspace/escaped")
    finally:
        os.close(refusing)
    monkeypatch.undo()
    await wait_until(lambda: not sandbox_uid_processes(sandbox_backend), what="no sandbox uid")
    assert not (sandbox_workspace / "escaped").exists()
    result = await run(sandbox_backend, sandbox_workspace, "echo fine")
    assert (result.outcome.exit_code, result.stdout) == (0, "fine\n")


# Run inside a sandbox: park as many fds as it may in flight on a unix socket (counted against
# the host uid the sandboxes and the spawner share), then report and hold them.
FD_FLOOD = """
import os, socket, sys, time
a, b = socket.socketpair()
a.setblocking(False)
sent = 0
try:
    while True:
        socket.send_fds(a, [b"x"], [0] * 250)
        sent += 250
except OSError:
    pass
print(sent, flush=True)
time.sleep(30)
"""


async def test_fds_in_flight_from_a_sandbox_do_not_break_other_starts(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    flood = await spawn(sandbox_backend, sandbox_workspace, [PYTHON, "-c", FD_FLOOD])
    try:
        line = await asyncio.wait_for(flood.stdout.readline(), 10)
        assert int(line) >= 1000, line  # as many as its open-files limit lets it hold
        for _ in range(3):
            result = await run(sandbox_backend, sandbox_workspace, "echo fine")
            assert (result.outcome.exit_code, result.stdout) == (0, "fine\n")
    finally:
        flood.kill()
        await collect(flood)


# -- policy -----------------------------------------------------------------------------------


@pytest.mark.no_launch
@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ({"memory_mb": 100_000}, "memory_mb=100000 exceeds the server's maximum of 256"),
        ({"pids": 1000}, "pids=1000 exceeds the server's maximum of 64"),
        ({"network": True}, "this server allows no network egress"),
        ({"network": ["pypi.org"]}, "this server allows no network egress"),
        ({"pseudo_terminals": True}, "pseudo_terminals: this server does not allow them"),
        ({"pty": "yes"}, "pseudo_terminals must be true or false"),
        ({"no_such_limit": 1}, "unknown sandbox_config key 'no_such_limit'"),
    ],
)
async def test_caller_cannot_loosen_the_servers_policy(
    sandbox_backend: BubblewrapBackend, request_: dict[str, object], message: str
) -> None:
    with pytest.raises(PolicyViolationError, match=message):
        sandbox_backend.config.limits.tighten(request_)


# Forks children that wait on a pipe until it fails; prints how many it got.
COUNT_FORKS = """
import os
r, w = os.pipe()
count = 0
try:
    while count < 200:
        if os.fork() == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        count += 1
except OSError:
    pass
os.close(w)
print(count, flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""


async def test_tighter_caller_policy_is_applied(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    ceiling = sandbox_backend.config.limits
    tight = ceiling.tighten({"pids": 16, "memory_mb": 64})
    assert (tight.pids, tight.memory_mb) == (16, 64)
    assert tight.cpu_time_seconds == ceiling.cpu_time_seconds

    limited = await run(
        sandbox_backend, sandbox_workspace, [PYTHON, "-c", COUNT_FORKS], limits=tight
    )
    loose = await run(sandbox_backend, sandbox_workspace, [PYTHON, "-c", COUNT_FORKS])
    assert limited.outcome.exit_code == 0, limited.stderr
    assert loose.outcome.exit_code == 0, loose.stderr
    assert int(limited.stdout) < 16
    assert "pids" in limited.outcome.limits_reached
    assert 16 < int(loose.stdout) < 64


# -- timeouts, stdin, exit codes --------------------------------------------------------------


async def test_wall_clock_timeout_kills_a_sleeping_command(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    result = await run(sandbox_backend, sandbox_workspace, "sleep 100", wall_timeout=0.5)
    assert result.outcome.reason == "timeout"
    assert result.outcome.exit_code >= 128
    assert result.outcome.signal in (signal.SIGTERM, signal.SIGKILL)
    assert result.outcome.duration_s < 5


async def test_interactive_stdin_reaches_the_program_and_closing_it_ends_cat(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    proc = await spawn(sandbox_backend, sandbox_workspace, ["cat"], interactive=True)
    try:
        assert proc.stdin is not None
        for line in (b"hello\n", b"second line\n"):
            proc.stdin.write(line)
            await proc.stdin.drain()
            assert await asyncio.wait_for(proc.stdout.readline(), 5) == line
        proc.stdin.close()
        outcome = await asyncio.wait_for(proc.wait(), 5)
    finally:
        await proc.aclose()
    assert outcome.exit_code == 0
    assert outcome.reason is None


async def test_exit_code_is_reported(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    result = await run(sandbox_backend, sandbox_workspace, "exit 7")
    assert result.outcome.exit_code == 7
    assert result.outcome.signal is None
    assert result.outcome.reason is None


async def test_killing_signal_is_reported(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    result = await run(sandbox_backend, sandbox_workspace, "kill -9 $$")
    assert result.outcome.signal == signal.SIGKILL
    assert result.outcome.exit_code == 128 + signal.SIGKILL
    assert result.outcome.reason is None


PRELOAD_SOURCE = r"""
#include <stdio.h>
#include <sys/resource.h>
__attribute__((constructor)) static void report(void) {
    struct rlimit r;
    getrlimit(RLIMIT_FSIZE, &r);
    fprintf(stderr, "preload-fsize=%lld\n", (long long) r.rlim_cur);
}
"""


async def test_callers_ld_preload_runs_only_after_the_limits_are_set(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    (sandbox_workspace / "p.c").write_text(PRELOAD_SOURCE)
    os.chmod(sandbox_workspace / "p.c", 0o644)
    built = await run(
        sandbox_backend, sandbox_workspace, "cc -shared -fPIC -o /workspace/p.so /workspace/p.c"
    )
    assert built.outcome.exit_code == 0, built.stderr
    limits = sandbox_backend.config.limits.tighten({"file_size_mb": 1})
    result = await run(
        sandbox_backend,
        sandbox_workspace,
        "ulimit -f; /bin/true",
        limits=limits,
        env={"LD_PRELOAD": "/workspace/p.so"},
    )
    reported = [line for line in result.stderr.splitlines() if line.startswith("preload-fsize=")]
    assert reported, f"the preloaded library never ran: {result.stderr!r}"
    assert all(line == f"preload-fsize={1024 * 1024}" for line in reported), reported
    assert result.stdout.strip() == "2048"


@pytest.mark.no_launch
async def test_reserved_environment_names_are_refused(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    with pytest.raises(InvalidRequestError, match="not valid"):
        await run(sandbox_backend, sandbox_workspace, "true", env={"__srt_n": "1"})


async def test_callers_environment_and_shell_code_never_show_in_a_command_line(
    sandbox_backend: BubblewrapBackend, sandbox_workspace: Path
) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    code_marker = f"code-{uuid.uuid4().hex}"
    proc = await spawn(
        sandbox_backend,
        sandbox_workspace,
        f': {code_marker}; echo "$API_KEY" > /workspace/seen; sleep 30',
        env={"API_KEY": secret},
    )
    try:
        await wait_until(lambda: (sandbox_workspace / "seen").exists(), what="the command")
        assert (sandbox_workspace / "seen").read_text() == secret + "\n"
        for pid in host_pids():
            cmdline = read_proc(pid, "cmdline")
            assert secret.encode() not in cmdline, f"pid {pid} shows the secret"
            assert code_marker.encode() not in cmdline, f"pid {pid} shows the code"
    finally:
        proc.kill()
        await collect(proc)


# -- a server that is not root ----------------------------------------------------------------

# Run by a server process that is the sandbox user itself (uid 65534, `nobody`): starts a
# backend, looks at a sandbox from inside, stops a stubborn one, hits the file size limit.
NON_ROOT_SERVER = """
import asyncio, json, os, sys
from pathlib import Path
from sandbox_runtime.sandbox import BackendConfig, BubblewrapBackend, SandboxLimits, SandboxSpec
from sandbox_runtime.sandbox import shell_argv

root, probe, stubborn, marker = sys.argv[1:5]

def marked(bwrap=True):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():  # this server has the marker in its own argv
            continue
        try:
            if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                if bwrap or open(f"/proc/{pid}/comm").read().strip() != "bwrap":
                    found.append(int(pid))
        except OSError:
            pass
    return found

async def main():
    backend = BubblewrapBackend(BackendConfig(
        workspace_root=Path(root) / "workspaces", sandbox_user="nobody",
        limits=SandboxLimits(memory_mb=256, pids=64, open_files=77, file_size_mb=1),
        group_name="srt-test-non-root"))
    backend.start()
    report = {"euid": os.geteuid(), "unavailable": backend.unavailable_reason,
              "cgroups": backend.cgroups.describe(), "dev_problem": backend.dev_problem}
    if backend.unavailable_reason is not None:
        print(json.dumps(report))
        return
    ws = backend.create_workspace("ws")
    def spec(argv):
        return SandboxSpec(argv=argv, workspace=ws, limits=backend.config.limits, timeout=20)
    async def run(argv):
        proc = await backend.spawn(spec(argv))
        out, err, outcome = await asyncio.gather(proc.stdout.read(), proc.stderr.read(),
                                                 proc.wait())
        await proc.aclose()
        return out.decode(), err.decode(), outcome
    with open(f"/proc/{backend.spawner_pid}/status") as f:
        report["spawner_uids"] = f.read().split("Uid:")[1].split()[:4]
    out, err, outcome = await run(["/usr/bin/python3", "-c", probe, "read", "/etc/shadow",
                                   "/root", root + "/workspaces"])
    report["read"] = json.loads(out) if outcome.exit_code == 0 else err
    out, err, outcome = await run(["/usr/bin/python3", "-c", probe, "write", "/etc/x",
                                   "/usr/x", "/dev/x", "/workspace/ok"])
    report["write"] = json.loads(out) if outcome.exit_code == 0 else err
    out, err, outcome = await run(shell_argv(
        "grep -E '^(Uid|CapEff|NoNewPrivs|Seccomp):' /proc/self/status; ulimit -n; ulimit -v"))
    report["inside"] = out.split()
    proc = await backend.spawn(spec(["/usr/bin/python3", "-c", stubborn, marker]))
    report["stubborn_ready"] = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
    for _ in range(250):
        # main, 3 children and the daemon, which its short-lived parent forks
        report["stubborn_running"] = len(marked(bwrap=False))
        if report["stubborn_running"] == 5 and len(marked(bwrap=False)) == 5:
            break
        await asyncio.sleep(0.02)
    await proc.terminate(grace=0.3)
    outcome = await proc.wait()
    report["stubborn_outcome"] = [outcome.exit_code, outcome.reason]
    await proc.aclose()
    for _ in range(250):
        if not marked():
            break
        await asyncio.sleep(0.02)
    report["stubborn_left"] = len(marked())
    out, err, outcome = await run(shell_argv("head -c 2000000 /dev/zero > /workspace/big"))
    report["file_size"] = [outcome.signal_name, outcome.reason, (ws / "big").stat().st_size]
    await backend.aclose()
    print(json.dumps(report))

asyncio.run(main())
"""
CAP_DAC_READ_SEARCH = 2
libc = ctypes.CDLL(None, use_errno=True)


def _become_nobody_keeping_read_search() -> None:
    """preexec: uid/gid 65534 with one capability kept across exec, CAP_DAC_READ_SEARCH, only
    so the interpreter can read its own installation (under root's 0700 home on the machines
    this runs on). The server's code treats itself as non-root (euid 65534); its spawner
    drops this capability like every other before it starts a sandbox, and checks. (Only
    system calls here: libc was loaded before the fork.)"""
    if libc.prctl(8, 1, 0, 0, 0) != 0:  # PR_SET_KEEPCAPS
        raise OSError(ctypes.get_errno(), "PR_SET_KEEPCAPS")
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable for caps 0-31, 32-63
    data[0] = data[1] = data[2] = 1 << CAP_DAC_READ_SEARCH
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if libc.prctl(47, 2, CAP_DAC_READ_SEARCH, 0, 0) != 0:  # PR_CAP_AMBIENT, RAISE
        raise OSError(ctypes.get_errno(), "PR_CAP_AMBIENT_RAISE")


def test_a_server_that_is_not_root_runs_sandboxes_as_itself_with_rlimits(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the sandbox tests run as root (they start a non-root server from it)")
    traversable_by_others(tmp_path)
    os.chown(tmp_path, 65534, 65534)
    marker = f"srt-non-root-{uuid.uuid4().hex}"
    result = subprocess.run(
        [sys.executable, "-c", NON_ROOT_SERVER, str(tmp_path), PROBE, STUBBORN, marker],
        preexec_fn=_become_nobody_keeping_read_search,
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["euid"] == 65534
    assert report["unavailable"] is None, report
    assert "no usable cgroup" in report["cgroups"]  # only root makes cgroups: rlimits only
    assert "root" in report["dev_problem"]  # bwrap's own /dev
    assert report["spawner_uids"] == ["65534"] * 4
    assert "ok" not in report["read"].values(), report["read"]
    write = report["write"]
    assert write.pop("/workspace/ok") == "ok"
    assert "ok" not in write.values(), write
    # Only the sandbox uid, no capabilities, the filter; open files and (no memory cgroup)
    # address space limited by rlimits, in KiB.
    assert report["inside"] == [
        "Uid:", "1000", "1000", "1000", "1000", "CapEff:", "0" * 16, "NoNewPrivs:", "1",
        "Seccomp:", "2", "77", str(256 * 1024),
    ]  # fmt: skip
    assert report["stubborn_ready"] == "ready\n"
    assert report["stubborn_running"] == 5
    assert report["stubborn_outcome"] == [128 + signal.SIGKILL, "cancelled"]
    assert report["stubborn_left"] == 0
    assert report["file_size"] == ["SIGXFSZ", "file_size", 1024 * 1024]


async def test_sandbox_workspaces_do_not_depend_on_pytests_own_temp_root(tmp_path: Path) -> None:
    """Every pytest run on the machine closes pytest's root (/tmp/pytest-of-<user>) to 0700
    when it starts; the suite's sandbox-visible directories must not be under it
    (tests/conftest.py), or one engineer's run breaks the sandboxes of another's."""
    pytest_root = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    assert pytest_root not in tmp_path.parents, tmp_path
    mode = pytest_root.stat().st_mode & 0o7777 if pytest_root.exists() else None
    try:
        if mode is not None:
            os.chmod(pytest_root, mode & ~0o077)  # as a pytest run starting now does
        async with started_backend(tmp_path) as backend:
            workspace = backend.create_workspace("ws")
            done = await run(backend, workspace, "echo seen > note && cat note && pwd")
            assert done.outcome.exit_code == 0, done.stderr
            assert done.stdout == "seen\n/workspace\n"
    finally:
        if mode is not None:
            os.chmod(pytest_root, mode)
