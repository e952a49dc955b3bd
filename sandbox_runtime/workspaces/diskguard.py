"""The watchdog of thin workspace images: no write accepted that the state filesystem could
not hold (the accounting it keeps: workspaces/diskspace.py).

Two kernel knobs per mounted image, found from its mount point's device (its loop device):
- the loop device's dirty-page limit (/sys/class/bdi/<major:minor>/max_bytes, strict): what
  the workspace may hold written but not yet on the host, half its margin. Set when it is
  mounted, set back when it is unmounted (loop devices are reused by anything).
- the free space its ext4 keeps from writes (/sys/fs/ext4/<loopN>/reserved_clusters): raised
  to all of it while the state filesystem is under the line, so every write that needs a new
  block gets ENOSPC there and then, whoever writes (root included); set back when space
  returns. Reading and deleting keep working. Unlike a read-only
  remount this works with files open for writing, and it is not an error of the filesystem:
  nothing marks the workspace damaged.

`step` runs every GUARD_INTERVAL under the supervisor (one statvfs when nothing changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import struct
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from loguru import logger

from sandbox_runtime.workspaces.diskspace import MIB, StateDisk, allocate_ranges
from sandbox_runtime.workspaces.ext4meta import metadata_ranges

GUARD_INTERVAL = 0.25  # seconds between looks at the free space
NEAR_INTERVAL = 0.05  # ... once it is within NEAR times the line
NEAR = 2
RELEASE_MARGIN = 8 * MIB  # above the line before writes are let in again (no flapping)
TRIM_SLACK = 16 * MIB  # an image holding this much more than its files and metadata is trimmed
LOOP_MAJOR = 7
FITRIM = 0xC0185879  # _IOWR('X', 121, struct fstrim_range)
BDI_DEFAULT_MAX_RATIO = "100"

_libc = ctypes.CDLL(None, use_errno=True)


def _device(point: Path) -> tuple[int, str] | None:
    """The device number and block device name (loopN) of a loop-mounted mount point."""
    with contextlib.suppress(OSError):
        dev = os.stat(point).st_dev
        if os.major(dev) == LOOP_MAJOR:
            link = os.readlink(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
            return dev, os.path.basename(link)
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def limit_dirty(point: Path, limit: int) -> None:
    """Cap what the workspace mounted at `point` may hold written but not yet on the host."""
    found = _device(point)
    if found is None:
        return
    dev = found[0]
    bdi = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}"
    try:
        _write(f"{bdi}/max_bytes", str(limit))
        _write(f"{bdi}/strict_limit", "1")
    except OSError as exc:  # (kernels before 6.2 have no max_bytes)
        logger.warning("no dirty-page limit for the workspace at {}: {}", point, exc)


def unlimit_dirty(dev: int) -> None:
    """Set the dirty-page limit of loop device `dev` back (before it serves another file)."""
    if os.major(dev) != LOOP_MAJOR:
        return
    bdi = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}"
    with contextlib.suppress(OSError):
        _write(f"{bdi}/strict_limit", "0")
        _write(f"{bdi}/max_ratio", BDI_DEFAULT_MAX_RATIO)


def trim(point: Path) -> None:
    """Give the host back every free block of the filesystem mounted at `point` (FITRIM:
    the loop device punches them out of its image). Raises OSError."""
    fd = os.open(point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FITRIM, bytearray(struct.pack("QQQ", 0, 2**64 - 1, 0)))
    finally:
        os.close(fd)


class DiskGuard:
    """Stops the mounted thin workspaces (`points`) taking data while the state filesystem
    is under its line, and lets them again once there is room."""

    def __init__(self, disk: StateDisk, points: Callable[[], Iterable[tuple[Path, Path]]]) -> None:
        self.disk = disk
        self.points = points
        # Workspaces stopped now: mount point -> (device, reserved_clusters file, its value
        # before).
        self._held: dict[Path, tuple[int, str, str]] = {}
        self._lock = threading.Lock()  # (mounted() runs in worker threads)
        self.stopped = False
        self._free = self._line = 0  # as last seen

    def mounted(self, point: Path, image: Path) -> None:
        """A thin workspace (`image`) was mounted at `point`: cap its dirty pages, give back
        the free space of an image allocated before (SANDBOX_WORKSPACE_RESERVE=allocate), and
        stop it too if the others are stopped. Blocks (a worker thread's)."""
        if not self.disk.thin:
            return
        limit_dirty(point, self.disk.dirty_limit())
        with contextlib.suppress(OSError):
            st, inside = os.stat(image), os.statvfs(point)
            used = (inside.f_blocks - inside.f_bfree) * inside.f_frsize
            if st.st_blocks * 512 > 2 * used + self.disk.metadata + TRIM_SLACK:
                trim(point)
        if self.stopped:
            self._stop([(point, image)])

    def interval(self) -> float:
        """Seconds until the next step: shorter as the free space nears the line (what lands
        between two looks is what the floor must absorb)."""
        if not self.disk.thin or self.stopped:
            return GUARD_INTERVAL
        return NEAR_INTERVAL if self._free < NEAR * self._line else GUARD_INTERVAL

    def why_stopped(self) -> str | None:
        """What a write refused now is told, if workspaces are stopped (None: they are not)."""
        if not self.stopped:
            return None
        free = self.disk.free_bytes()
        return (
            f"this replica's state filesystem (SANDBOX_STATE_DIR) has {free // MIB} MiB free, "
            f"under the {-(-self.disk.line(len(self._held)) // MIB)} MiB it keeps "
            "(SANDBOX_MIN_FREE_DISK_MB, or SANDBOX_WORKSPACE_HEADROOM_MB per mounted "
            "workspace): workspaces take no new data until there is room. Files already "
            "written are kept and can be read or deleted; retry later"
        )

    async def step(self) -> None:
        """Look at the free space: stop or let go the workspaces as it says."""
        if not self.disk.thin:
            return
        mounts = list(self.points())
        points = [point for point, _ in mounts]
        free = self.disk.free_bytes()
        line = self.disk.line(len(points))
        self._free, self._line = free, line
        if free < line:
            with self._lock:
                todo = [m for m in mounts if m[0] not in self._held]
            if not self.stopped or todo:
                if not self.stopped:
                    logger.error(
                        "the state filesystem {} has {} MiB free, under the {} MiB kept for "
                        "SANDBOX_MIN_FREE_DISK_MB and SANDBOX_WORKSPACE_HEADROOM_MB: the {} "
                        "mounted workspaces take no new data (writers get ENOSPC) until there "
                        "is room",
                        self.disk.root,
                        free // MIB,
                        line // MIB,
                        len(points),
                    )
                self.stopped = True
                await asyncio.to_thread(self._stop, todo)
        elif self.stopped and free >= line + RELEASE_MARGIN:
            self.stopped = False
            await asyncio.to_thread(self._release)
            logger.info(
                "the state filesystem {} has {} MiB free again: workspaces take data again",
                self.disk.root,
                free // MIB,
            )
        with self._lock:
            for point in [p for p in self._held if p not in points]:
                del self._held[point]  # (unmounted: its filesystem is gone, its setting too)

    def _stop(self, mounts: list[tuple[Path, Path]]) -> None:
        """Reserve all the free space of each workspace's filesystem (writes that need a new
        block fail), give its image the host blocks its metadata may still need (journal,
        inode tables, bitmaps: a metadata write must never meet a full host), then flush what
        it had accepted: all into the room its margin kept."""
        for point, _ in mounts:
            found = _device(point)
            if found is None:
                continue
            dev, name = found
            knob = f"/sys/fs/ext4/{name}/reserved_clusters"
            try:
                before = Path(knob).read_text().strip()
                clusters = int(Path(f"/sys/block/{name}/size").read_text()) * 512 // 4096
                _write(knob, str(clusters - 1))  # (the most ext4 takes: all but one)
            except (OSError, ValueError) as exc:
                logger.warning("the workspace at {} could not be stopped: {}", point, exc)
                continue
            with self._lock:
                self._held[point] = (dev, knob, before)
        for point, image in mounts:
            try:
                allocate_ranges(image, metadata_ranges(image))
            except OSError as exc:
                logger.warning("the metadata of {} could not be given its blocks: {}", image, exc)
            with contextlib.suppress(OSError):
                fd = os.open(point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    _libc.syncfs(fd)
                finally:
                    os.close(fd)

    def _release(self) -> None:
        with self._lock:
            held, self._held = self._held, {}
        for point, (dev, knob, before) in held.items():
            with contextlib.suppress(OSError):
                if os.stat(point).st_dev == dev:  # (still the filesystem it was set on)
                    _write(knob, before)
