"""What a sandbox is made of on the host: the user it runs as, the backend's private directory,
and the root, /dev and /etc that bwrap mounts; plus where things appear inside."""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import pwd
import re
import shutil
import stat
import subprocess
from pathlib import Path

from loguru import logger

from sandbox_runtime.errors import InvalidRequestError, SandboxUnavailableError
from sandbox_runtime.sandbox.egress_port import SOCKET_DIR

WORKSPACE = "/workspace"
SANDBOX_UID = 1000  # the uid a program sees inside; on the host it is `sandbox_user`
# The host user sandboxes run as by default: a system user of our own, not `nobody` (which
# other daemons share: a sandbox could signal or ptrace them were it ever to reach them, and
# files they own would be the sandbox's).
DEFAULT_SANDBOX_USER = "srt-sandbox"

# The backend's private directory (seccomp program, the sandbox's root and /dev), in TMPDIR.
PRIVATE_PREFIX = "srt-sandbox-"

# The interpreter of the stub that sandboxes started ahead of need run (argv.STUB_PROGRAM).
STUB_PERL = "/usr/bin/perl"

# Where the runtime (a Python environment with a data stack, Deno, Jupyter kernels) appears in
# every sandbox, read-only, first on PATH; and where an interpreter's sockets live.
RUNTIME = "/opt/srt-runtime"
KERNEL_DIR = "/run/srt-kernel"
SERVER_DIR = "/opt/srt-server"  # a hosted MCP server's install, read-only
BRIDGE_DIR = "/run/srt-bridge"  # code mode's socket and library, read-only
# A sandbox with egress: its init is the relay (egress/relay.pl, copied here into the root at
# start) run by the host's Perl (STUB_PERL), which /usr brings into every sandbox; it makes
# itself undumpable with prctl, whose syscall number is the architecture's (None: egress
# is refused here, fail closed).
RELAY_PROGRAM = Path(__file__).parents[1] / "egress" / "relay.pl"
RELAY_PATH = "/run/srt-relay.pl"
PRCTL_SYSCALL = {"x86_64": 157, "aarch64": 167, "riscv64": 167, "ppc64le": 171, "s390x": 172}.get(
    platform.machine()
)
# Deno finds this config from any directory without one of its own (it looks up to /): its
# import map gives code mode's package its bare name, as Node finds it in /node_modules.
# No lockfile: Deno would write one beside the config, in the read-only root.
DENO_CONFIG = '{"imports": {"mcp_servers": "/node_modules/mcp_servers/index.mjs"}, "lock": false}\n'

# /etc entries taken read-only from the host: what dynamic linking, TLS, time zones and
# Debian's alternatives need; nothing with accounts or secrets.
ETC_FROM_HOST = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "ssl/certs",
    "ca-certificates.conf",
    "localtime",
    "timezone",
    "mime.types",
    "os-release",
    "debian_version",
    "bash.bashrc",
    "profile",
    "inputrc",
    "python3",
    "python3.11",
    "python3.12",
    "python3.13",
)
ETC_GENERATED = {
    "passwd": (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{WORKSPACE}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    ),
    "group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
    "resolv.conf": "",
}


def ensure_system_user(name: str) -> str:
    """`name`, created as a system user (no home, no login shell, a group of its own) if it
    does not exist yet. Raises SandboxUnavailableError."""
    with contextlib.suppress(KeyError):
        pwd.getpwnam(name)
        return name
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    argv = [useradd, "--system", "--user-group", "--no-create-home", "--home-dir",
            "/nonexistent", "--shell", "/usr/sbin/nologin", name]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        problem = done.stderr.strip() if done.returncode != 0 else ""
    except (OSError, subprocess.SubprocessError) as exc:
        problem = str(exc)
    with contextlib.suppress(KeyError):
        pwd.getpwnam(name)  # made now (or by another server starting at the same time)
        logger.info("created the system user {} for sandboxes", name)
        return name
    raise SandboxUnavailableError(
        f"could not create the sandbox user {name!r} ({problem or 'useradd failed'}); create it "
        f"(useradd --system --user-group --no-create-home {name}) or set SANDBOX_SANDBOX_USER"
    )


def relay_problem() -> str | None:
    """Why the relay cannot run in sandboxes here, if it cannot: it needs the host's Perl
    under /usr (which every sandbox sees), on an architecture whose prctl number it knows."""
    if PRCTL_SYSCALL is None:
        return f"the egress relay does not know this architecture ({platform.machine()})"
    return _host_program_problem(STUB_PERL, "the egress relay's interpreter", "perl-base")


def stub_problem() -> str | None:
    """Why sandboxes cannot be started ahead of need here, if they cannot: their stub needs
    the host's Perl under /usr (perl-base, essential on Debian and Ubuntu)."""
    return _host_program_problem(STUB_PERL, "the stub of sandboxes started ahead", "perl-base")


def _host_program_problem(path: str, role: str, package: str) -> str | None:
    """Why the host program at `path` cannot run in a sandbox, which sees the host's /usr only."""
    real = os.path.realpath(path)
    if not real.startswith("/usr/") or not os.access(real, os.X_OK):
        return f"{path} ({role}) is missing or outside /usr; install it: apt-get install {package}"
    return None


def make_workspace(root: Path, name: str, uid: int, gid: int) -> Path:
    """Workspace `name` under `root`, owned by the sandbox user (`uid`, `gid`; created if
    missing). Raises InvalidRequestError for a name that is not one."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", name) or name in (".", ".."):
        raise InvalidRequestError(f"invalid workspace name {name!r}")
    path = root / name
    path.mkdir(mode=0o700, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, uid, gid)
    return path


def lock_private_dir(private: Path) -> int:
    """Lock `private` for as long as this process lives (the fd returned). The lock file gets
    its name only once it is locked: another server's cleanup never finds it unlocked.
    Raises OSError."""
    fd = os.open(private / "lock.new", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(private / "lock.new", private / "lock")
    except OSError:
        os.close(fd)
        raise
    return fd


def remove_stale_private_dirs(own: Path) -> int:
    """Remove the private directories next to `own` that servers which ended without closing
    left behind: this user's, with a lock file no live server holds. (One without a lock file
    is being made, or is an older server's, which may still run: it is left alone.) How many
    were removed."""
    removed = 0
    with os.scandir(own.parent) as entries:
        candidates = [e.path for e in entries if e.name.startswith(PRIVATE_PREFIX)]
    for path in candidates:
        if path == str(own):
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue  # not ours to remove
        try:
            fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live server holds it
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        finally:
            os.close(fd)
    return removed


def first_unsearchable(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory on the way to `path` that uid/gid may not traverse, if any."""
    for directory in [*reversed(path.parents), path]:
        st = directory.stat()
        if st.st_uid == uid:
            ok = st.st_mode & 0o100
        elif st.st_gid == gid:
            ok = st.st_mode & 0o010
        else:
            ok = st.st_mode & 0o001
        if not ok:
            return directory
    return None


ROOT_TOPS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def build_root(root: Path) -> None:
    """The sandbox's root directory: /etc, the host's merged-usr symlinks and a mount point
    for everything mounted on top (mounts on a read-only bind need existing points)."""
    root.mkdir(mode=0o755)
    build_etc(root / "etc")
    for point in ("/usr", "/proc", "/dev", "/tmp", WORKSPACE, RUNTIME, KERNEL_DIR, SOCKET_DIR,
                  SERVER_DIR, BRIDGE_DIR, "/node_modules"):  # fmt: skip
        (root / point.lstrip("/")).mkdir(mode=0o755, parents=True)
    # E2B's sandboxes keep the user's files in /home/user: the same directory here (its SDKs'
    # code names paths there).
    (root / "home").mkdir(mode=0o755)
    (root / "home" / "user").symlink_to(WORKSPACE)
    shutil.copyfile(RELAY_PROGRAM, root / RELAY_PATH.lstrip("/"))
    os.chmod(root / RELAY_PATH.lstrip("/"), 0o644)
    (root / "deno.json").write_text(DENO_CONFIG)
    os.chmod(root / "deno.json", 0o644)
    for top in ROOT_TOPS:
        host = f"/{top}"
        if os.path.islink(host):
            (root / top).symlink_to(os.readlink(host))
        elif os.path.isdir(host):
            (root / top).mkdir(mode=0o755)


# The prebuilt /dev: character devices (major, minor) every program may use, and links.
DEV_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9),
             "tty": (5, 0)}  # fmt: skip
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "shm": "/tmp",  # POSIX shared memory and semaphores live in the bounded /tmp
}


def build_dev(dev: Path) -> Path:
    """Fill `dev` (in the sandbox's root) with the minimal /dev. Raises OSError (and leaves
    `dev` empty) when the host refuses device nodes there (no CAP_MKNOD, a nodev filesystem):
    bwrap's --dev is used instead."""
    try:
        for name, (major, minor) in DEV_NODES.items():
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(dev / name, 0o666)  # (mknod's mode is cut by the umask)
        for name, target in DEV_LINKS.items():
            (dev / name).symlink_to(target)
        os.close(os.open(dev / "null", os.O_WRONLY | os.O_CLOEXEC))  # EACCES on nodev
    except OSError:
        for entry in dev.iterdir():
            entry.unlink()
        raise
    return dev


def build_etc(etc: Path) -> None:
    """The sandbox's /etc: generated account files plus copies of harmless host entries.

    Copied once at start: only world-readable files, so nothing private can leak in.
    """
    etc.mkdir(mode=0o755)
    for name, text in ETC_GENERATED.items():
        (etc / name).write_text(text)
        os.chmod(etc / name, 0o644)

    def copy_public(src: str, dst: str) -> None:
        if os.stat(src).st_mode & 0o004:
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o644)

    for name in ETC_FROM_HOST:
        host = Path("/etc") / name
        target = etc / name
        if not host.exists() or target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        if host.is_symlink():
            target.symlink_to(os.readlink(host))
        elif host.is_dir():
            shutil.copytree(host, target, symlinks=True, copy_function=copy_public)
        else:
            with contextlib.suppress(OSError):
                copy_public(str(host), str(target))
    # The point a trust bundle is bound on (sandboxes whose TLS the egress proxy may
    # terminate): a file, whatever the host has there.
    bundle = etc / "ssl" / "certs" / "ca-certificates.crt"
    bundle.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    if bundle.is_symlink() or not bundle.exists():
        content = b""
        with contextlib.suppress(OSError):
            content = Path("/etc/ssl/certs/ca-certificates.crt").read_bytes()
        bundle.unlink(missing_ok=True)
        bundle.write_bytes(content)
        os.chmod(bundle, 0o644)
    for root, dirs, _ in os.walk(etc):
        for d in dirs:
            path = os.path.join(root, d)
            if not os.path.islink(path):
                os.chmod(path, 0o755)
