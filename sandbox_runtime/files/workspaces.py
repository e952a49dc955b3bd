"""The workspaces of this replica: one ext4 image per workspace (its quota), mounted while used.

Why an image: a byte and an inode quota the kernel enforces for writes from inside (ENOSPC)
need either filesystem quotas (mount options on the host's filesystem, rarely there) or a
filesystem of the workspace's own. An image file formatted with `mkfs.ext4 -N` and
loop-mounted costs a few ms to make and ~3 ms to mount, and makes a workspace one movable
file. It also puts the workspace on a filesystem of its own: a hard link to a
file outside cannot exist, and host-side file operations cannot cross into another mount.
The sandbox only ever sees the mounted filesystem; the image file is root's, 0600, outside.

Layout under the root: `<name>.img` (the image) and `<name>/` (its mount point, root-owned
mode 0 while nothing is mounted, so nothing is ever written to the host's disk through it).
An image is mounted when first used, unmounted after UNMOUNT_IDLE_SECONDS without use, and
removed with its mount point after the retention period. Each mount holds a loop device and a
journal thread in the kernel, so mounts are capped per replica and per principal: a mount past
a cap first unmounts the least recently used idle workspace (its image stays: its files come
back on its next use), and is refused (LimitExceededError) when every one is in use. Mounts a
killed server left are detached at start. Where images cannot be mounted (no root, no loop
devices, no mkfs.ext4), `quota="auto"` falls back to plain directories without a quota, and
says so (doctor, /health).

Disk space is reserved, not promised: by default an image is allocated in full when made and
a new one is refused when the state filesystem has no room for it (files/diskspace.py).

A workspace whose filesystem fails (an I/O error, EROFS once the kernel aborted its journal,
found by a file operation or by the mount turning read-only) is marked damaged (in memory and
a `<name>.damaged` file beside the image): the call that found it fails, and its next use
unmounts it, once nothing runs in it, and checks it (e2fsck -p), as does any mount of an image
whose superblock records an error. Repaired, it is mounted again and the session is told
(`workspace_repaired`: files may be missing); beyond automatic repair, the image is moved to
`.quarantine/` for the operator and the session starts afresh (`workspace_quarantined`)
(files/repair.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from loguru import logger

from sandbox_runtime.errors import (
    InvalidRequestError,
    LimitExceededError,
    SandboxSpawnError,
    SandboxUnavailableError,
    WorkspaceDamagedError,
)
from sandbox_runtime.files.diskspace import StateDisk
from sandbox_runtime.files.fsops import WorkspaceFiles, remove_partial_uploads
from sandbox_runtime.files.repair import check_image, has_recorded_error, loop_attached

NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
IMAGE_SUFFIX = ".img"
UNMOUNT_IDLE_SECONDS = 300.0
# errors=remount-ro: a filesystem error stops writes at once (and we see the mount turn
# read-only) rather than letting them go on into a damaged filesystem.
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime,noinit_itable,errors=remount-ro"
MS_BIND = 4096
MNT_DETACH = 2
COMMAND_TIMEOUT = 30.0
DETACH_WAIT_STEPS = 40  # times 0.05 s: for the loop device of an unmounted image to go
PROBE = ".probe"
PROBE_ROOM = 64 * 1024 * 1024  # free space below which a failed probe is blamed on the disk
CHECK_ROOM = 16 * 1024 * 1024  # free space e2fsck is given to repair an image in
DAMAGED_SUFFIX = ".damaged"

_libc = ctypes.CDLL(None, use_errno=True)


def _umount(path: Path) -> None:
    """Unmount `path` (detached if busy). Raises OSError."""
    raw = os.fsencode(path)
    if _libc.umount2(raw, 0) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and _libc.umount2(raw, MNT_DETACH) == 0:
        return
    if err != errno.EINVAL:  # EINVAL: not mounted
        raise OSError(err, os.strerror(err), str(path))


def _bind(source: Path, target: Path) -> None:
    if _libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(target))


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below `root`, deepest first (from /proc/self/mountinfo)."""
    prefix = str(root).rstrip("/") + "/"
    found: list[Path] = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = line.split(b" ")[4].decode("utf-8", "surrogateescape")
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)
            if point.startswith(prefix):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def loop_devices_under(root: Path) -> int:
    """Loop devices whose backing file is under `root` (this replica's images), detached
    mounts a sandbox still holds included (from /sys/block/loop*/loop/backing_file)."""
    prefix = str(root).rstrip("/") + "/"
    count = 0
    with contextlib.suppress(OSError), os.scandir("/sys/block") as entries:
        for entry in entries:
            if not entry.name.startswith("loop"):
                continue
            with contextlib.suppress(OSError), open(f"{entry.path}/loop/backing_file") as f:
                if f.read().startswith(prefix):
                    count += 1
    return count


class WorkspaceStore:
    """Creates, mounts, measures and removes this replica's workspaces."""

    def __init__(
        self,
        root: Path,
        *,
        size_mb: int,
        inodes: int,
        quota: str = "auto",
        retention_seconds: float,
        max_mounted: int = 1024,
        max_mounted_per_principal: int = 64,
        reserve: str = "allocate",
        min_free_mb: int = 0,
    ) -> None:
        self.root = root
        self.size_mb = size_mb
        self.disk = StateDisk(root, reserve=reserve, min_free_mb=min_free_mb)
        self.inodes = inodes
        self.wanted = quota  # auto, image, none
        self.uid = self.gid = -1  # the sandbox user's, set by start()
        self.retention_seconds = retention_seconds
        self.max_mounted = max_mounted
        self.max_mounted_per_principal = max_mounted_per_principal
        self.mode = "directory"  # or "image" once start() found images work
        self.problem: str | None = None  # why there is no quota
        self._ready: dict[str, float] = {}  # name -> last use (monotonic), made ready this run
        self._mounted: set[str] = set()  # those of them that are mounted images
        self._swept: set[str] = set()  # names whose partial uploads were removed this run
        # Mounted images, and those being mounted, with their principal (None: a warm slot):
        # what the mount caps count.
        self._principals: dict[str, str | None] = {}
        self._touched: dict[str, float] = {}  # name -> when its use was last put on disk
        self._locks: dict[str, asyncio.Lock] = {}
        self._holds: dict[str, int] = {}
        self.busy: list[Callable[[], set[str]]] = []  # names in use (executions, kernels)
        # Names a sandbox started ahead of need waits in: not in use, but not a new session's
        # either; unmounted only after every idle workspace without one.
        self.standby: list[Callable[[], set[str]]] = []
        self.on_refused: list[Callable[[str], None]] = []  # a mount refused, by which cap
        # Called with a name before that workspace is unmounted, removed or replaced (a
        # sandbox started ahead of need holds a bind of it: it must end first; mounting the
        # image again while a detached mount of it lives on would corrupt it).
        self.before_release: list[Callable[[str], Awaitable[None]]] = []
        self._damaged: dict[str, str] = {}  # name -> what failed, until checked
        self._resets: dict[str, str] = {}  # name -> a session_reset reason not yet told
        # Called with detected, clean, repaired or quarantined (a damaged workspace's course).
        self.on_damage: list[Callable[[str], None]] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, uid: int, gid: int) -> None:
        """Prepare the root, detach mounts a dead server left, and decide on images; files
        are made for the sandbox user uid/gid.

        Raises SandboxUnavailableError when quota="image" and images cannot be used.
        """
        self.uid, self.gid = uid, gid
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        for point in mounts_under(self.root):
            with contextlib.suppress(OSError):
                _umount(point)
                logger.info("detached a workspace a previous server left mounted: {}", point)
        if self.wanted == "none":
            self.problem = "workspace quotas are turned off (SANDBOX_WORKSPACE_QUOTA=none)"
        else:
            self.problem = self._probe()
        if self.problem is None:
            self.mode = "image"
            return
        if self.wanted == "image":
            raise SandboxUnavailableError(
                f"workspace images (SANDBOX_WORKSPACE_QUOTA=image) cannot be used: {self.problem}"
            )
        if self.wanted != "none":
            logger.warning("workspaces have no quota: {}", self.problem)

    def _probe(self) -> str | None:
        """Why workspace images cannot be made and mounted here (None: they can)."""
        if os.geteuid() != 0:
            return "mounting workspace images needs a server running as root"
        if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
            return "mkfs.ext4 or mount is missing (apt-get install e2fsprogs mount)"
        if not os.path.exists("/dev/loop-control") and not os.path.exists("/dev/loop0"):
            return "there are no loop devices (/dev/loop-control)"
        image, point = self.root / f"{PROBE}{IMAGE_SUFFIX}", self.root / PROBE
        try:
            self._remove_sync(PROBE)
            self._make_image(image, 16, 256, probe=True)
            point.mkdir(mode=0)
            self._mount(image, point)
            _umount(point)
        except (OSError, subprocess.SubprocessError) as exc:
            if self.disk.status().free_bytes < PROBE_ROOM:
                # (A full disk must not turn the images it holds into empty directories.)
                logger.warning(
                    "no room to try a workspace image ({}); images are assumed to work (root, "
                    "loop devices and mkfs.ext4 are there)",
                    exc,
                )
                return None
            return f"a test image could not be made and mounted: {exc}"
        finally:
            with contextlib.suppress(OSError):
                self._remove_sync(PROBE)
        return None

    async def close(self) -> None:
        """Unmount every workspace (the server is stopping; nothing runs in them now)."""
        for name in list(self._mounted):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_umount, self.root / name)
            self._mounted.discard(name)
            self._principals.pop(name, None)
        self._ready.clear()

    # -- naming ------------------------------------------------------------------------------

    def _check(self, name: str) -> None:
        if not NAME.fullmatch(name):
            raise InvalidRequestError(f"invalid workspace name {name!r}")

    def path(self, name: str) -> Path:
        """Where the workspace is (its mount point, or its directory)."""
        return self.root / name

    def image(self, name: str) -> Path:
        return self.root / f"{name}{IMAGE_SUFFIX}"

    def is_ready(self, name: str) -> bool:
        """Whether the workspace is there and mounted (if it is an image) now, and nothing is
        about to unmount, remove or replace it."""
        lock = self._locks.get(name)
        return name in self._ready and not (lock is not None and lock.locked())

    def exists(self, name: str) -> bool:
        return self.image(name).is_file() or self.path(name).is_dir()

    def files(self, name: str) -> WorkspaceFiles:
        """Safe access to the contents of an ensured workspace (an I/O error of its
        filesystem marks it damaged)."""
        return WorkspaceFiles(
            self.path(name),
            self.uid,
            self.gid,
            on_damage=lambda detail: self.mark_damaged(name, detail),
        )

    # -- use ---------------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            if len(self._locks) > 10_000:
                self._locks = {n: lk for n, lk in self._locks.items() if lk.locked()}
            lock = self._locks[name] = asyncio.Lock()
        return lock

    async def ensure(
        self, name: str, principal: str | None = None, *, ahead: bool = False
    ) -> tuple[Path, bool]:
        """The workspace, made and mounted if needed, and whether it existed before; marks
        it used. A mount counts against the caps of the replica and of `principal` (None: a
        warm interpreter's slot, the replica's cap only). `ahead`: made ready ahead of an
        operation, which reports (and counts) a refusal itself.

        Raises InvalidRequestError, SandboxSpawnError (it cannot be made), LimitExceededError
        (a mount cap is reached and every mounted workspace in its scope is in use),
        DiskFullError (no room on the state filesystem for a new one), WorkspaceDamagedError
        (its filesystem failed and it cannot be checked now: something still runs in it).
        """
        self._check(name)
        if name in self._ready and not self.check_damage(name):
            self._ready[name] = time.monotonic()
            self._touch(name)
            return self.path(name), True
        async with self._lock(name):
            existed = self.exists(name)
            if name in self._damaged and name in self._mounted:
                await self._release_damaged(name)
            if name in self._ready:  # made ready by the call this one waited for
                self._ready[name] = time.monotonic()
                return self.path(name), True
            mounting = self._needs_mount(name)
            if mounting:
                await self._make_room(principal, host=True, count=not ahead)
                self._principals[name] = principal  # (counted from now: no await since)
            try:
                await asyncio.to_thread(self._ensure_sync, name)
            except (OSError, subprocess.SubprocessError) as exc:
                raise SandboxSpawnError(f"could not prepare the workspace: {exc}") from exc
            finally:
                if mounting and name not in self._mounted:
                    self._principals.pop(name, None)
        return self.path(name), existed

    def _needs_mount(self, name: str) -> bool:
        """Whether making `name` ready mounts an image (not a plain directory)."""
        if self.mode != "image":
            return False
        point = self.path(name)
        with contextlib.suppress(OSError):
            if point.is_dir() and not self.image(name).exists() and any(point.iterdir()):
                return False  # a plain directory from before images
        return True

    def mounted_count(self, principal: str | None = None) -> int:
        """Mounted images (and those being mounted): all, or `principal`'s."""
        if principal is None:
            return len(self._principals)
        return sum(1 for p in self._principals.values() if p == principal)

    def mounted_by_kind(self) -> dict[str, int]:
        """Mounted images of sessions and of warm interpreters' slots (the metrics' view)."""
        slots = sum(1 for p in self._principals.values() if p is None)
        return {"session": len(self._principals) - slots, "slot": slots}

    async def _make_room(self, principal: str | None, *, host: bool, count: bool = True) -> None:
        """Unmount least recently used idle workspaces until one more mount of `principal`
        fits under the caps (the replica's too if `host`). A warm slot (principal None) never
        unmounts a session's workspace. The caller holds the lock of the name it mounts.

        Raises LimitExceededError.
        """
        tried: set[str] = set()
        while True:
            over_host = host and len(self._principals) >= self.max_mounted
            over_mine = (
                principal is not None
                and self.mounted_count(principal) >= self.max_mounted_per_principal
            )
            if not over_host and not over_mine:
                return
            victim = None
            if principal is not None:
                victim = self._least_recently_used(principal if over_mine else None, tried)
            if victim is None:
                self._refuse(over_mine, count)
            assert victim is not None
            tried.add(victim)
            if await self._unmount(victim):
                logger.info("unmounted the idle workspace {} to mount another", victim)

    def _least_recently_used(self, principal: str | None, skip: set[str]) -> str | None:
        """The mounted workspace (of `principal`, or anyone's) to unmount first: not in use,
        not locked; one without a sandbox waiting in it before one with, then the oldest."""
        busy = self._in_use()
        standby = self._standing_by()
        candidates = [
            name
            for name in self._mounted
            if name not in busy
            and name not in skip
            and name in self._ready
            and not (name in self._locks and self._locks[name].locked())
            and (principal is None or self._principals.get(name) == principal)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda n: (n in standby, self._ready.get(n, 0.0)))

    def _refuse(self, mine: bool, count: bool) -> None:
        for hook in self.on_refused if count else ():
            hook("principal_mounted_workspaces" if mine else "mounted_workspaces")
        if mine:
            raise LimitExceededError(
                f"this token has its maximum of {self.max_mounted_per_principal} session "
                "workspaces mounted on this replica (SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL)"
                " and every one is in use (running code, an interpreter, a file operation): "
                "wait for one to finish, restart_interpreter or stop work in a session you no "
                "longer need, or reuse a session; idle workspaces are unmounted to make room"
            )
        raise LimitExceededError(
            f"this replica has its maximum of {self.max_mounted} workspaces mounted "
            "(SANDBOX_MAX_MOUNTED_WORKSPACES) and every one is in use: retry later (idle "
            "workspaces are unmounted to make room) or on another replica"
        )

    def _ensure_sync(self, name: str) -> None:
        point, image = self.path(name), self.image(name)
        if self.mode != "image" or (point.is_dir() and not image.exists() and any(point.iterdir())):
            # No images here, or a plain directory from before images (kept as it is; nothing
            # can check or repair it: a failure found in it was reported, and it is served on).
            self._damaged.pop(name, None)
            point.mkdir(mode=0o700, exist_ok=True)
            if os.geteuid() == 0:
                os.chown(point, self.uid, self.gid)
            self._sweep_uploads(name)
            self._ready[name] = time.monotonic()
            self._touch(name)
            return
        fresh = not image.exists()
        checked = None if fresh else self._check_image(name)
        fresh = fresh or checked == "quarantined"  # (set aside: replaced by a new one)
        if fresh:
            self._make_image(image, self.size_mb, self.inodes)
        else:
            self.disk.allocate_existing(image)
        with contextlib.suppress(FileExistsError):
            point.mkdir(mode=0)
        os.chmod(point, 0)  # never writable while nothing is mounted on it
        try:
            self._mount(image, point)
        except OSError as exc:
            if fresh or checked is not None:
                raise
            self.mark_damaged(name, f"it would not mount: {exc}")
            if self._check_image(name) == "quarantined":
                fresh = True
                self._make_image(image, self.size_mb, self.inodes)
            self._mount(image, point)
        if fresh:
            with contextlib.suppress(OSError):
                os.rmdir(point / "lost+found")
        os.chmod(point, 0o700)  # the filesystem's root, owned by the sandbox user (mkfs)
        self._sweep_uploads(name)
        self._mounted.add(name)
        self._ready[name] = time.monotonic()
        self._touch(name)

    def _sweep_uploads(self, name: str) -> None:
        """Remove what uploads cut off by an earlier server's death left (hidden from listings
        but using space), once per workspace and process, before anything can use it."""
        if name in self._swept:
            return
        self._swept.add(name)
        try:
            removed = remove_partial_uploads(self.path(name))
        except OSError as exc:
            logger.warning("workspace {}: partial uploads not removed: {}", name, exc)
            return
        if removed:
            logger.info(
                "workspace {}: removed {} partial uploads left by a cut-off upload", name, removed
            )

    def _make_image(self, image: Path, size_mb: int, inodes: int, probe: bool = False) -> None:
        """Make and format an image (allocated in full unless sparse). Raises OSError,
        SubprocessError, DiskFullError."""
        size = size_mb * 1024 * 1024
        if not probe:
            self.disk.check_room(size)
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            if not probe:  # (a full disk must not fail the start: see _probe)
                self.disk.allocate(fd, size, image)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                image.unlink()
            raise
        os.close(fd)
        try:
            options = f"root_owner={self.uid}:{self.gid},lazy_itable_init=1,lazy_journal_init=1"
            mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", "-N", str(inodes)]
            self._run([*mkfs, "-E", f"{options},nodiscard", str(image)])
        except BaseException:
            with contextlib.suppress(OSError):
                image.unlink()
            raise

    # -- damage ------------------------------------------------------------------------------

    def mark_damaged(self, name: str, detail: str) -> None:
        """Record that the workspace's filesystem failed: its next use checks it (e2fsck)
        before serving it again. Safe from a worker thread."""
        if name in self._damaged:
            return
        self._damaged[name] = detail
        logger.error("workspace {} is damaged ({}): checked before its next use", name, detail)
        with contextlib.suppress(OSError):  # (the host may be full: the mark in memory holds)
            os.close(os.open(self._marker(name), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        for hook in self.on_damage:
            hook("detected")

    def damaged(self) -> dict[str, str]:
        """Workspaces marked damaged and not yet checked: name -> what failed."""
        return dict(self._damaged)

    def take_reset(self, name: str) -> str | None:
        """A session_reset reason owed for the workspace (repaired, quarantined), once."""
        return self._resets.pop(name, None)

    def _marker(self, name: str) -> Path:
        return self.root / f"{name}{DAMAGED_SUFFIX}"

    def check_damage(self, name: str) -> bool:
        """Whether a ready workspace must be checked before use: marked damaged, or its
        mount turned read-only (the kernel's answer to an error: errors=remount-ro)."""
        if name in self._damaged:
            return True
        if name in self._mounted:
            try:
                read_only = bool(os.statvfs(self.path(name)).f_flag & os.ST_RDONLY)
            except OSError as exc:
                read_only, detail = True, f"statfs failed: {exc}"
            else:
                detail = "the kernel made its filesystem read-only after an error"
            if read_only:
                self.mark_damaged(name, detail)
                return True
        return False

    async def _release_damaged(self, name: str) -> None:
        """Unmount a damaged workspace so that it can be checked (the caller holds its lock).

        Raises WorkspaceDamagedError while something still runs in it.
        """
        busy = name in self._in_use()
        if not busy:
            self._ready.pop(name, None)  # (from here, new users wait for the lock)
            for hook in self.before_release:
                await hook(name)
            busy = name in self._in_use()
        if not busy:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_umount, self.path(name))
            self._mounted.discard(name)
            self._principals.pop(name, None)
            with contextlib.suppress(OSError):
                os.chmod(self.path(name), 0)
            for _ in range(DETACH_WAIT_STEPS):  # (the kernel lets a loop device go async)
                if not loop_attached(self.image(name)):
                    break
                await asyncio.sleep(0.05)
            busy = loop_attached(self.image(name))  # a sandbox still holds a bind of it
        if busy:
            raise WorkspaceDamagedError(
                f"the workspace's filesystem failed ({self._damaged.get(name)}) and something "
                "still runs in it (an execution, an interpreter): it is checked and repaired "
                "once that ends (cancel_execution; an idle interpreter is stopped after its "
                "idle timeout). Files written since the failure were not kept"
            )

    def _check_image(self, name: str) -> str | None:
        """Before mounting an existing image: check it if it is marked damaged or records an
        error, and repair it (e2fsck -p) or set it aside (.quarantine/, a fresh image is then
        to be made). How the check ended (None: not needed). Raises OSError,
        SubprocessError."""
        image, marker = self.image(name), self._marker(name)
        why = self._damaged.get(name)
        if why is None and marker.exists():
            why = "marked damaged by an earlier run"
        if why is None and has_recorded_error(image):
            why = "its filesystem records an error"
        if why is None:
            return None
        if self.disk.status().free_bytes < CHECK_ROOM:  # (e2fsck writes into the image)
            self.mark_damaged(name, why)
            raise WorkspaceDamagedError(
                f"the workspace's filesystem failed ({why}) and the state filesystem is too "
                "full to check and repair it: it is checked once there is room again; retry"
            )
        outcome = check_image(image, name)
        if outcome.result == "quarantined":
            self._resets[name] = "workspace_quarantined"
            logger.error(
                "workspace {} ({}) could not be repaired (e2fsck -p exit {}: {}): its image is "
                "kept at {} for the operator and the session starts afresh",
                name,
                why,
                outcome.exit_code,
                outcome.output,
                outcome.kept,
            )
        elif outcome.result == "repaired":
            self._resets[name] = "workspace_repaired"
            logger.warning(
                "workspace {} ({}) repaired by e2fsck in {:.2f} s (exit {}): {}",
                name,
                why,
                outcome.seconds,
                outcome.exit_code,
                outcome.output,
            )
        else:
            logger.info("workspace {} ({}) checked clean in {:.2f} s", name, why, outcome.seconds)
        self._damaged.pop(name, None)
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
        for hook in self.on_damage:
            hook(outcome.result)
        return outcome.result

    def _mount(self, image: Path, point: Path) -> None:
        options = self.disk.mount_options(MOUNT_OPTIONS)
        self._run(["mount", "-t", "ext4", "-o", options, str(image), str(point)])

    @staticmethod
    def _run(argv: list[str]) -> None:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=COMMAND_TIMEOUT,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"},
        )
        if done.returncode != 0:
            message = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise OSError(f"{argv[0]} failed ({done.returncode}): {message[:500]}")

    def _touch(self, name: str) -> None:
        """Record a use on disk (the retention period counts from it, across restarts): at
        most once per tenth of the period, not on every call (two stats and a utime each)."""
        now = time.monotonic()
        if now - self._touched.get(name, -math.inf) < min(30.0, self.retention_seconds / 10):
            return
        self._touched[name] = now
        if len(self._touched) > 100_000:  # (forgetting only costs a utime more)
            self._touched.clear()
        handle = self.image(name) if self.image(name).exists() else self.path(name)
        with contextlib.suppress(OSError):
            os.utime(handle)

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Keep the workspace mounted while a host-side file operation uses it."""
        self._holds[name] = self._holds.get(name, 0) + 1
        try:
            yield
        finally:
            self._holds[name] -= 1
            if not self._holds[name]:
                del self._holds[name]
            if name in self._ready:
                self._ready[name] = time.monotonic()

    def _in_use(self) -> set[str]:
        names = set(self._holds)
        for busy in self.busy:
            names |= busy()
        return names

    # -- measuring ---------------------------------------------------------------------------

    def usage(self, name: str) -> dict[str, int | None]:
        """Bytes and files used and allowed (None: no quota) of a mounted workspace."""
        if name not in self._mounted:
            return {
                "bytes_used": None,
                "bytes_limit": None,
                "files_used": None,
                "files_limit": None,
            }
        st = os.statvfs(self.path(name))
        return {
            "bytes_used": (st.f_blocks - st.f_bfree) * st.f_frsize,
            "bytes_limit": st.f_blocks * st.f_frsize,
            "files_used": st.f_files - st.f_ffree,
            "files_limit": st.f_files,
        }

    def free_bytes(self, name: str) -> int | None:
        if name not in self._mounted:
            return None
        st = os.statvfs(self.path(name))
        return st.f_bavail * st.f_frsize

    # -- moving and removing -----------------------------------------------------------------

    async def adopt(self, slot: str, name: str, principal: str | None = None) -> bool:
        """Make workspace `slot` (a warm interpreter's) into `name`, if `name` is new or
        empty and nothing uses it (no execution, interpreter, file operation, sandbox waiting
        in it); whether it did. A kernel started in `slot` keeps its bind of the filesystem.

        The check and the swap are one step for every other user of `name`: `name` is not
        ready meanwhile, so a call that would start in it waits for its lock (ensure).
        """
        self._check(slot)
        self._check(name)
        async with self._lock(name):
            if name in self._in_use() or name in self._standing_by():
                return False
            last_used = self._ready.pop(name, None)  # (from here, new users wait for the lock)
            adopted = reserved = False
            try:
                if self.mode == "image" and name not in self._principals:  # (a mount more)
                    try:
                        await self._make_room(principal, host=False, count=False)
                    except LimitExceededError:
                        return False
                    self._principals[name] = principal  # (counted from now)
                    reserved = True
                for hook in self.before_release:  # (an empty `name` is replaced)
                    await hook(name)
                if name in self._in_use() or name in self._standing_by():
                    return False  # (whatever started meanwhile waits for this lock)
                adopted = await asyncio.to_thread(self._adopt_sync, slot, name, principal)
                return adopted
            finally:
                if not adopted and last_used is not None and name not in self._ready:
                    self._ready[name] = last_used
                if not adopted and reserved and name not in self._mounted:
                    self._principals.pop(name, None)

    def _standing_by(self) -> set[str]:
        names: set[str] = set()
        for waiting in self.standby:
            names |= waiting()
        return names

    def _adopt_sync(self, slot: str, name: str, principal: str | None) -> bool:
        target = self.path(name)
        if self.exists(name):
            if name in self._mounted or not self.image(name).exists():
                with contextlib.suppress(OSError):
                    if any(target.iterdir()):
                        return False
            else:
                return False  # an unmounted image: the session has been used
            self._remove_sync(name)
        source = self.path(slot)
        if slot not in self._mounted:  # a plain directory
            os.rename(source, target)
            self._ready.pop(slot, None)
            self._ready[name] = time.monotonic()
            return True
        target.mkdir(mode=0)
        try:
            _bind(source, target)
        except OSError:
            target.rmdir()
            raise
        _umount(source)
        os.rename(self.image(slot), self.image(name))
        with contextlib.suppress(OSError):
            source.rmdir()
        self._mounted.discard(slot)
        self._principals.pop(slot, None)
        self._ready.pop(slot, None)
        self._mounted.add(name)
        self._principals[name] = principal
        self._ready[name] = time.monotonic()
        self._touch(name)
        return True

    async def remove(self, name: str) -> None:
        """Remove the workspace and its contents (nothing may be running in it)."""
        self._check(name)
        async with self._lock(name):
            for hook in self.before_release:
                await hook(name)
            await asyncio.to_thread(self._remove_sync, name)

    def _remove_sync(self, name: str) -> None:
        point = self.path(name)
        if name in self._mounted or point in mounts_under(self.root):
            _umount(point)
        self._mounted.discard(name)
        self._principals.pop(name, None)
        self._ready.pop(name, None)
        self._touched.pop(name, None)
        self._damaged.pop(name, None)
        self._swept.discard(name)
        with contextlib.suppress(FileNotFoundError):
            self.image(name).unlink()
        with contextlib.suppress(FileNotFoundError):
            self._marker(name).unlink()
        shutil.rmtree(point, ignore_errors=True)

    def remove_all(self, prefix: str) -> int:
        """Remove every workspace whose name starts with `prefix`, now (at start, before
        anything runs in them): how many."""
        names = {
            p.name.removesuffix(IMAGE_SUFFIX)
            for p in self.root.glob(f"{prefix}*")
            if NAME.fullmatch(p.name.removesuffix(IMAGE_SUFFIX))
        }
        for name in names:
            with contextlib.suppress(OSError):
                self._remove_sync(name)
        return len(names)

    def idle(self, now: float | None = None) -> list[str]:
        """Workspaces unused for the retention period and not in use now."""
        now = time.time() if now is None else now
        busy = self._in_use()
        names: set[str] = set()
        with contextlib.suppress(OSError), os.scandir(self.root) as entries:
            for entry in entries:
                name = entry.name.removesuffix(IMAGE_SUFFIX)
                if name in busy or not NAME.fullmatch(name) or name in names:
                    continue
                handle = self.image(name) if self.image(name).exists() else self.path(name)
                with contextlib.suppress(OSError):
                    if handle.stat().st_mtime + self.retention_seconds <= now:
                        names.add(name)
        return sorted(names)

    async def sweep(self) -> tuple[int, int]:
        """Unmount workspaces idle a while and remove those idle past retention: how many
        of each."""
        removed = 0
        for name in self.idle():
            if name in self._locks and self._locks[name].locked():
                continue
            await self.remove(name)
            removed += 1
        unmounted = 0
        busy = self._in_use()
        cutoff = time.monotonic() - UNMOUNT_IDLE_SECONDS
        for name in list(self._mounted):
            if self._ready.get(name, 0) > cutoff or name in busy:
                continue
            if await self._unmount(name, used_after=cutoff):
                unmounted += 1
        return removed, unmounted

    async def _unmount(self, name: str, used_after: float | None = None) -> bool:
        """Unmount the image of `name` if nothing uses it (nor did after `used_after`); its
        image stays, and its next use mounts it again. Whether it did."""
        async with self._lock(name):
            last_used = self._ready.get(name)
            if name not in self._mounted or last_used is None or name in self._in_use():
                return False
            if used_after is not None and last_used > used_after:
                return False
            del self._ready[name]  # (from here, new users wait for the lock: ensure)
            unmounted = False
            try:
                for hook in self.before_release:
                    await hook(name)
                if name in self._in_use():  # (a call came meanwhile: it waits for the lock)
                    return False
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(_umount, self.path(name))
                    self._mounted.discard(name)
                    self._principals.pop(name, None)
                    os.chmod(self.path(name), 0)
                    unmounted = True
                return unmounted
            finally:
                if not unmounted and name in self._mounted:
                    self._ready.setdefault(name, last_used)
