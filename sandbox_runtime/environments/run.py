"""A Dockerfile RUN step: the command in a sandbox whose writable root is the tree being built.

The sandbox: bubblewrap under userns.py (root of a user namespace mapping ids 0-65535 to the
host's, so apt and dpkg can give files to their owners), its own mount, pid, network, ipc
and uts namespaces, a fresh /dev, /proc and /tmp, nothing of the host's filesystem but the
tree itself and, for the relay, the host's /usr read-only at HOST_USR; no_new_privs (setuid
files in the tree give nothing). Its only network is the egress proxy, through the relay,
under the operator's build allowlist (SANDBOX_ENVIRONMENT_BUILD_ALLOW): HTTP(S)_PROXY points
at it, which apt, pip, go and curl read. The step is killed past its time limit, or when the
tree grows past the size limit (checked every few seconds while it runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.environments.digest import tree_size
from sandbox_runtime.environments.store import EnvironmentsError
from sandbox_runtime.sandbox.egress_port import RELAY_PORT, SOCKET_DIR, SOCKET_NAME, EgressGate
from sandbox_runtime.supervisor import scoped

HOST_USR = "/run/srt-host/usr"
RELAY_AT = "/run/srt-relay.py"
RELAY_SOURCE = Path(__file__).resolve().parent.parent / "egress" / "relay.py"
LOADER = "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
LIBS = ("lib/x86_64-linux-gnu", "lib")
# Mount points bwrap makes in the tree for a step, removed after it (never part of a root).
MOUNT_LEFTOVERS = (
    "run/srt-host", "run/srt-egress", "run/srt-relay.py", "run/srt-copy", "run/srt-ca.crt",
)  # fmt: skip
# The host's CAs, for RUN's downloads only (a host behind an intercepting proxy or a private
# mirror builds through it); never part of the root: programs are pointed at it by name.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
CA_AT = "/run/srt-ca.crt"
CA_ENV = {
    name: CA_AT
    for name in (
        "SSL_CERT_FILE",
        "PIP_CERT",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
    )
}
COPY_AT = "/run/srt-copy"  # COPY's staged sources, read-only
SIZE_CHECK_SECONDS = 3.0
MAX_PASSWD = 4 * 1024 * 1024
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_PROXY = f"http://127.0.0.1:{RELAY_PORT}"
PROXY_ENV = {
    name: _PROXY
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
}

Log = Callable[[str], None]


class RunStepError(EnvironmentsError):
    """A RUN step failed (its status, or a limit)."""


class TooLargeError(EnvironmentsError):
    """The environment grew past SANDBOX_ENVIRONMENT_MAX_MB."""


def loader() -> tuple[str, str] | None:
    """(loader, library path) inside the sandbox that run the host's python3 there, whatever
    libc the tree has; None when the host lacks them."""
    if not Path("/usr", LOADER).exists() or not Path("/usr/bin/python3").exists():
        return None
    return f"{HOST_USR}/{LOADER}", ":".join(f"{HOST_USR}/{lib}" for lib in LIBS)


def user_ids(tree: Path, user: str) -> tuple[int, int]:
    """uid and gid of USER (a name in the tree's /etc/passwd, or `uid[:gid]`)."""
    name, _, group = user.partition(":")
    if name.isdigit():
        return int(name), int(group) if group.isdigit() else int(name)
    lines = _tree_passwd(tree).splitlines()
    for line in lines:
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == name:
            return int(fields[2]), int(fields[3])
    raise RunStepError(f"USER {user}: no such user in the environment's /etc/passwd (add it "
                       "with RUN useradd first, or give a numeric uid)")  # fmt: skip


def _tree_passwd(tree: Path) -> str:
    """The tree's /etc/passwd, read here on the host: never through a link (an earlier step
    may have made it one to a host file, a fifo or /dev/zero), at most MAX_PASSWD bytes."""
    etc = tree / "etc"
    try:
        if not stat.S_ISDIR(os.lstat(etc).st_mode):
            return ""
        fd = os.open(etc / "passwd", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return f.read(MAX_PASSWD).decode("utf-8", "replace")


async def run_step(
    tree: Path,
    command: list[str],
    *,
    env: dict[str, str],
    workdir: str,
    user: str,
    egress: EgressGate[Any] | None,
    allow: str,
    allow_cidrs: str = "",
    step_seconds: float,
    max_bytes: int,
    log: Log,
    copy_from: Path | None = None,
) -> None:
    """Run `command` in a sandbox rooted at `tree` (`copy_from`: bound read-only at COPY_AT).
    Raises RunStepError, TooLargeError."""
    make_dirs(tree, workdir)
    uid, gid = (0, 0) if user in ("", "root", "0", "0:0") else user_ids(tree, user)
    if uid or gid:
        command = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *command]
    args = [
        "--bind", str(tree), "/", "--dev", "/dev", "--proc", "/proc",
        # (the step's /tmp and /dev/shm are memory: bounded as the tree is, not half the host's)
        "--size", str(max_bytes), "--tmpfs", "/dev/shm",
        "--perms", "1777", "--size", str(max_bytes), "--tmpfs", "/tmp",
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "build",
        "--chdir", workdir, "--clearenv", "--setenv", "PATH", PATH, "--setenv", "HOME", "/root",
        "--setenv", "DEBIAN_FRONTEND", "noninteractive", "--setenv", "LC_ALL", "C.UTF-8",
    ]  # fmt: skip
    if copy_from is not None:
        args += ["--ro-bind", str(copy_from), COPY_AT]
    lease = None
    step_env = dict(env)
    try:
        if egress is not None and allow.strip():
            found = loader()
            if found is None:
                raise RunStepError("RUN with network needs the host's /usr/bin/python3 (for "
                                   "the egress relay)")  # fmt: skip
            lease = await egress.open(
                EgressPolicy(allow, "", allow_cidrs),
                lambda host, port, reason: log(f"egress refused {host}:{port}: {reason}"),
            )
            args += ["--ro-bind", "/usr", HOST_USR, "--ro-bind", str(RELAY_SOURCE), RELAY_AT]
            args += ["--ro-bind", str(lease.host_dir), SOCKET_DIR, "--as-pid-1"]
            step_env = {**PROXY_ENV, **step_env}
            if await asyncio.to_thread(HOST_CA.is_file):
                args += ["--ro-bind", str(HOST_CA), CA_AT]
                step_env = {**CA_ENV, **step_env}
            args += ["--setenv", "__srt_env", json.dumps(step_env)]
            command = [
                found[0], "--library-path", found[1], f"{HOST_USR}/bin/python3", "-I", "-S",
                "-B", RELAY_AT, f"{SOCKET_DIR}/{SOCKET_NAME}", str(RELAY_PORT), *command,
            ]  # fmt: skip
        else:
            for key, value in step_env.items():
                args += ["--setenv", key, value]
        argv = [sys.executable, "-m", "sandbox_runtime.environments.userns", "bwrap", *args]
        await _supervise([*argv, "--", *command], tree, step_seconds, max_bytes, log)
    finally:
        if lease is not None:
            with contextlib.suppress(Exception):
                await egress.close_lease(lease)  # type: ignore[union-attr]
        clean_leftovers(tree)


def make_dirs(tree: Path, inside: str) -> None:
    """Make the directory `inside` (a path in the tree) on the host, as far as it goes
    through real directories: a link is the tree's (an earlier step's), resolved inside the
    sandbox, never here, where it would lead onto the host."""
    path = tree
    for part in [p for p in inside.split("/") if p not in ("", ".", "..")]:
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            path.mkdir(mode=0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return


def clean_leftovers(tree: Path) -> None:
    """Remove the mount points bwrap made for a step (empty directories and files), in the
    tree's own /run only (a step may have made it a link onto the host)."""
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.lstat(tree / "run").st_mode):
            return
    for rel in MOUNT_LEFTOVERS:
        path = tree / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink(missing_ok=True)


async def _supervise(
    argv: list[str], tree: Path, step_seconds: float, max_bytes: int, log: Log
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    assert proc.stdout is not None
    tail: list[str] = []
    over: list[int] = []

    async def read() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            log(line)
            tail.append(line)
            del tail[:-20]

    async def watch_size() -> None:
        while True:
            await asyncio.sleep(SIZE_CHECK_SECONDS)
            size = await asyncio.to_thread(tree_size, tree)
            if size > max_bytes:
                over.append(size)
                _kill(proc.pid)
                return

    watcher = scoped(watch_size())
    try:
        await asyncio.wait_for(asyncio.gather(read(), proc.wait()), step_seconds)
    except TimeoutError:
        _kill(proc.pid)
        await proc.wait()
        raise RunStepError(
            f"the step took longer than {step_seconds:.0f} s (SANDBOX_ENVIRONMENT_BUILD_TIMEOUT)"
        ) from None
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        if proc.returncode is None:
            _kill(proc.pid)
            await proc.wait()
    if over:
        raise TooLargeError(_too_large(over[0], max_bytes))
    if proc.returncode != 0:
        raise RunStepError(f"exit status {proc.returncode}: " + " | ".join(tail[-5:]))


def _too_large(size: int, limit: int) -> str:
    return (
        f"the environment grew to {size // 2**20} MiB, past the limit of {limit // 2**20} MiB "
        "(SANDBOX_ENVIRONMENT_MAX_MB): install less, or raise the limit"
    )


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
