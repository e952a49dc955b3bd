"""The steps of readying a host for sandboxes (`BubblewrapBackend.start` runs them in order):
bubblewrap, the sandbox user, the backend's private directory (seccomp programs, the root,
/dev), the workspace root, the descriptor limit, the cgroups and the spawner. Each raises
SandboxUnavailableError for what makes sandboxes impossible here."""

from __future__ import annotations

import contextlib
import os
import pwd
import resource
import shutil
import tempfile
from pathlib import Path

from loguru import logger

from sandbox_runtime.errors import SandboxUnavailableError
from sandbox_runtime.sandbox.cgroups import CgroupLayout
from sandbox_runtime.sandbox.host import (
    DEFAULT_SANDBOX_USER,
    PRIVATE_PREFIX,
    build_dev,
    ensure_system_user,
    first_unsearchable,
    lock_private_dir,
    remove_stale_private_dirs,
)
from sandbox_runtime.sandbox.seccomp import compile_filter
from sandbox_runtime.sandbox.spawn_client import SpawnerManager
from sandbox_runtime.sandbox.spec import BackendConfig

NOFILE_WANTED = 65536


def find_bwrap(path: str | None) -> str:
    """bubblewrap's path (`path`, else found on PATH)."""
    bwrap = path or shutil.which("bwrap")
    if not bwrap or not os.access(bwrap, os.X_OK):
        raise SandboxUnavailableError(
            "bubblewrap (bwrap) is not installed; install it: apt-get install bubblewrap"
        )
    return bwrap


def sandbox_ids(config: BackendConfig) -> tuple[int, int]:
    """The uid and gid sandboxes run as: `config.sandbox_user`'s (when it names none, it is
    set to DEFAULT_SANDBOX_USER, created if missing, for a root server, else to its own)."""
    user = config.sandbox_user
    if user is None:
        if os.geteuid() == 0:
            user = ensure_system_user(DEFAULT_SANDBOX_USER)
        else:  # a server that is not root can only run sandboxes as itself
            user = pwd.getpwuid(os.geteuid()).pw_name
        config.sandbox_user = user
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise SandboxUnavailableError(
            f"sandbox user {user!r} does not exist; create it "
            "(useradd --system --no-create-home srt-sandbox) or set SANDBOX_SANDBOX_USER"
        ) from None
    if entry.pw_uid == 0:
        raise SandboxUnavailableError("the sandbox user must not be root")
    if os.geteuid() != 0 and os.geteuid() != entry.pw_uid:
        raise SandboxUnavailableError(
            f"the server runs as uid {os.geteuid()}, not root: it cannot switch to sandbox "
            f"user {config.sandbox_user!r}; run it as root or set SANDBOX_SANDBOX_USER "
            "to the server's own user"
        )
    return entry.pw_uid, entry.pw_gid


def new_private_dir() -> Path:
    """A new private directory for the backend (root's, 0711), in TMPDIR."""
    private_dir = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))
    os.chmod(private_dir, 0o711)
    return private_dir


def lock_private(private_dir: Path) -> int:
    """Lock `private_dir` as in use (the lock's fd): no other server removes it as stale;
    then remove the stale ones of servers that are gone."""
    try:
        lock = lock_private_dir(private_dir)
    except OSError as exc:
        raise SandboxUnavailableError(
            f"cannot lock the private directory {private_dir}: {exc}"
        ) from exc
    try:
        removed = remove_stale_private_dirs(private_dir)
    except OSError as exc:  # an unreadable TMPDIR: nothing removed, nothing else wrong
        logger.warning("could not look for stale private directories: {}", exc)
    else:
        if removed:
            logger.info("removed {} private directories of servers that are gone", removed)
    return lock


def remove_private_dir(private_dir: Path | None, lock: int | None) -> None:
    """Remove the backend's private directory, then let go of its lock."""
    if private_dir is not None:
        shutil.rmtree(private_dir, ignore_errors=True)
    if lock is not None:
        os.close(lock)


def write_seccomp(private_dir: Path, program: bytes) -> tuple[Path, Path]:
    """The seccomp programs in `private_dir`: `program` (AF_UNIX sockets only) and one that
    allows inet sockets too."""
    plain = private_dir / "seccomp.bpf"
    plain.write_bytes(program)
    os.chmod(plain, 0o600)
    inet = private_dir / "seccomp-inet.bpf"
    inet.write_bytes(compile_filter(inet=True))
    os.chmod(inet, 0o600)
    return plain, inet


def prebuilt_dev(root_dir: Path, private_dir: Path) -> tuple[Path | None, str | None]:
    """A /dev built once for every sandbox, or why there is none."""
    dev_dir: Path | None = None
    problem: str | None = None
    if os.geteuid() == 0:
        try:
            dev_dir = build_dev(root_dir / "dev")
        except OSError as exc:
            problem = f"device nodes cannot be made in {private_dir}: {exc}"
    else:
        problem = "device nodes can only be made by a server running as root"
    if problem is not None:
        logger.info("no prebuilt /dev ({}); bwrap builds one per sandbox", problem)
    return dev_dir, problem


def ready_workspace_root(config: BackendConfig, uid: int, gid: int) -> None:
    """Create the workspace root; the sandbox user must be able to reach it."""
    config.workspace_root.mkdir(parents=True, exist_ok=True)
    os.chmod(config.workspace_root, 0o711)
    blocked = first_unsearchable(config.workspace_root, uid, gid)
    if blocked is not None:
        raise SandboxUnavailableError(
            f"the sandbox user {config.sandbox_user!r} cannot reach the workspaces "
            f"under {config.workspace_root}: {blocked} is not searchable by it; "
            f"run `chmod o+x {blocked}` or choose another SANDBOX_STATE_DIR"
        )


def raise_nofile_limit() -> None:
    """Every running or pooled sandbox holds a few fds here: lift the soft limit (often
    1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NOFILE_WANTED if hard == resource.RLIM_INFINITY else min(hard, NOFILE_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def cgroup_layout(config: BackendConfig) -> CgroupLayout:
    """This server's cgroups (stale ones of servers that are gone removed)."""
    cgroups = CgroupLayout.setup(config.group_name, favordynmods=config.cgroup_favordynmods)
    cgroups.pool_size = config.cgroup_pool
    cgroups.cleanup_stale()
    for problem in cgroups.problems:
        logger.warning("cgroups: {}", problem)
    return cgroups


def start_spawner(uid: int, gid: int) -> SpawnerManager:
    """The spawner, running as the sandbox user."""
    if os.geteuid() == 0:
        spawner = SpawnerManager(uid, gid)
    else:  # the server already is the sandbox user
        spawner = SpawnerManager(os.geteuid(), os.getegid())
    spawner.start()
    return spawner
