"""The state filesystem's space: thin workspace images, the room they may still take, a floor.

A workspace image is thin by default (`thin`): it takes from the state filesystem what it
holds, plus its ext4 metadata (about 52 KiB for a new 1 GiB image, ~85 KiB once used: a 4
MiB journal and the inode tables made lazily; see images.mkfs_argv), and it is mounted with
`discard`, so a file deleted inside gives its blocks back to the host.

A thin image promises the sandbox bytes the host may not have. The danger is not a write
refused (that is ENOSPC, clean) but a write accepted and then lost: the kernel takes a write
into the workspace's page cache, and only when it writes it back does the loop device ask
the host for a block; a host that has none fails that writeback, the workspace's journal
aborts and what was acknowledged may be lost. So what a workspace may have accepted without
the host having the blocks for it is bounded, and kept room for:

- Each mounted workspace has a margin (SANDBOX_WORKSPACE_HEADROOM_MB, 64 MiB by default):
  what its metadata may still take from the host (its 4 MiB journal, inode tables and
  bitmaps: 20 MiB for 1 GiB and 65,536 files; workspaces/ext4meta.py), and the rest is the
  most it may hold written but not yet on the host (its loop device's dirty-page limit,
  strict: workspaces/diskguard.py). 64 MiB keeps bulk writes at full speed (a 32 MiB limit
  measured no slower; 1,000 mounted workspaces keep 64 GB free); the margin is raised when
  the metadata would leave less than MIN_DIRTY.
- A new session is refused (DiskFullError, naming the free space and the settings) when the
  free space, less a margin for every mounted workspace and the new one, would be under the
  floor (SANDBOX_MIN_FREE_DISK_MB): free < floor + (mounted + 1) * margin.
- A watchdog (diskguard.py: one statvfs every 0.25 s, every 0.05 s within twice the line)
  stops every mounted workspace from taking data when the free space falls under its line,
  max(floor, mounted * margin): each workspace's filesystem then counts all its free space
  as reserved (ext4's reserved_clusters), so a writer gets ENOSPC ("No space left on
  device") at its next write; its metadata is given its host blocks (fallocate) and what it
  had accepted is flushed, all into the room the line kept. A stopped workspace then needs
  no host block: the disk may fill to its last block from outside without costing it
  anything. When space returns, writes work again. Nothing of this is damage: the
  workspace is never made read-only, checked or repaired for it.

Why not make the workspaces read-only (`remount,ro`) at the floor: Linux refuses it (EBUSY)
while any file in them is open for writing, which is exactly when it is needed (a `dd` into
the workspace; measured). Why not reservations grown ahead of use (blocks allocated in the
image ahead of the filesystem inside using them): ext4 inside chooses where it writes, so
only the whole image can be allocated ahead of it; that is `allocate`. Counting, bounded
by the dirty-page limits and enforced by ext4 itself, is what holds here.

What this holds against: anything the sessions write (from inside, uploads, file tools) and
a state filesystem filling from outside, as long as what lands between two looks of the
watchdog fits in the floor (the default 1 GiB: 20 GB/s near the line). What it cannot hold
against: another program taking the last of the floor faster than that: it may still cost
the workspaces what they had not flushed and abort their journals (the workspace is then
checked: workspaces/damage.py). (Space reserved inside with fallocate would be promised without
being counted, and writes into it would pass a stop: the sandbox's seccomp filter refuses
fallocate that reserves blocks, sandbox/seccomp.py.) What
an fsync acknowledged (every file tool, file URL and `dd conv=fsync`) is on the host already
and is never lost. Give the state directory a filesystem of its own, or choose `allocate`.

`allocate` (the operator's choice) gives every image all its blocks when it is made
(fallocate: a few ms per GiB, nothing written) and mounts it without `discard`: a workspace
never needs a block of the host's, whatever fills the host, at the cost of its whole quota of
disk per workspace, idle ones kept for the retention period, pooled blanks and warm slots
included. `sparse` is the old name of `thin`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from sandbox_runtime.errors import DiskFullError

FALLOC_FL_KEEP_SIZE = 0x01
MIB = 1024 * 1024
MIN_DIRTY = 4 * MIB  # the least a workspace may hold unflushed (writes are throttled to it)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


@dataclass(frozen=True)
class DiskStatus:
    free_bytes: int
    total_bytes: int
    low: bool  # below the floor

    def wire(self) -> dict[str, object]:
        return {"free_bytes": self.free_bytes, "total_bytes": self.total_bytes, "low": self.low}


class StateDisk:
    """Space on the filesystem under `root` (SANDBOX_STATE_DIR's): what images reserve or may
    still take, what is left, and whether that is below `min_free_mb` (logged when it
    changes)."""

    def __init__(
        self,
        root: Path,
        *,
        reserve: str = "thin",
        min_free_mb: int = 0,
        headroom_mb: int = 64,
    ) -> None:
        self.root = root
        self.reserve = reserve  # thin, allocate
        self.min_free_mb = min_free_mb
        self.headroom_mb = headroom_mb  # kept free per mounted thin image (see margin)
        self.metadata = 0  # what an image's ext4 metadata may still take (set by the store)
        self.low = False  # below the floor when last looked
        # Images mounted and being mounted (set by the store).
        self.mounted: Callable[[], int] = lambda: 0

    def free_bytes(self) -> int:
        """Free bytes now (one statvfs; 0 if it fails)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def status(self) -> DiskStatus:
        """Free and total bytes now; a change across the floor is logged."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return DiskStatus(0, 0, True)
        free = st.f_bavail * st.f_frsize
        low = self.min_free_mb > 0 and free < self.min_free_mb * MIB
        if low != self.low:
            self.low = low
            if low:
                logger.error(
                    "the state filesystem {} has {} MiB free, below SANDBOX_MIN_FREE_DISK_MB={}:"
                    " not ready, no new workspaces",
                    self.root,
                    free // MIB,
                    self.min_free_mb,
                )
            else:
                logger.info("the state filesystem {} has {} MiB free again", self.root, free // MIB)
        return DiskStatus(free, st.f_blocks * st.f_frsize, low)

    @property
    def thin(self) -> bool:
        return self.reserve != "allocate"

    @property
    def margin(self) -> int:
        """Bytes kept free for each mounted thin image: SANDBOX_WORKSPACE_HEADROOM_MB, or more
        if its metadata would leave less than MIN_DIRTY of it for unflushed data."""
        return max(self.headroom_mb * MIB, self.metadata + MIN_DIRTY)

    def dirty_limit(self) -> int:
        """What a mounted thin image may hold written but not yet flushed to the host."""
        return self.margin - self.metadata

    def line(self, mounted: int) -> int:
        """Free bytes under which mounted thin workspaces stop accepting data: the floor, or
        a margin for each of them if that is more (what they may still have to flush)."""
        return max(self.min_free_mb * MIB, mounted * self.margin) if self.thin else 0

    def mount_options(self, base: str) -> str:
        # `discard` gives a deleted file's blocks back to the host: right for a thin image,
        # wrong for an allocated one (it would punch holes in the reservation).
        return f"{base},discard" if self.thin else base

    def check_room(self, size: int) -> None:
        """Refuse to mount a workspace (a new image of `size` bytes, or an existing one; it
        is counted in `mounted()` already) when the state filesystem has no room for what it
        would reserve (allocate) or what the mounted ones may still take (thin) above the
        floor. Raises DiskFullError."""
        free = self.free_bytes()
        floor = self.min_free_mb * MIB
        mounted = max(1, self.mounted())
        if self.thin and free - mounted * self.margin < floor:
            raise DiskFullError(self._no_room_thin(free, mounted))
        if not self.thin and free - size < floor:
            raise DiskFullError(self._no_room(free, size))

    def allocate(self, fd: int, size: int, image: Path, existing: bool = False) -> None:
        """Give the image (open as `fd`) all its `size` bytes now, if allocating; `existing`:
        an image made thin before. Raises DiskFullError, OSError."""
        if self.thin or _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.ENOSPC:
            raise DiskFullError(self._no_room(self.free_bytes(), size, existing))
        if err == errno.EOPNOTSUPP:
            logger.warning(
                "the state filesystem cannot allocate workspace images (fallocate): they stay "
                "thin (SANDBOX_WORKSPACE_RESERVE=thin; put SANDBOX_STATE_DIR on ext4 or xfs "
                "to allocate them)"
            )
            self.reserve = "thin"
            return
        raise OSError(err, os.strerror(err), str(image))

    def allocate_existing(self, image: Path) -> None:
        """Allocate in full an image made thin (by an earlier setting) before it is mounted.
        Raises DiskFullError, OSError."""
        if self.thin:
            return
        st = image.stat()
        if st.st_blocks * 512 >= st.st_size:
            return
        fd = os.open(image, os.O_WRONLY | os.O_CLOEXEC)
        try:
            self.allocate(fd, st.st_size, image, existing=True)
        finally:
            os.close(fd)

    def _no_room_thin(self, free: int, mounted: int) -> str:
        margin = -(-self.margin // MIB)
        return (
            f"this replica's state filesystem (SANDBOX_STATE_DIR) has {free // MIB} MiB free: "
            f"no room to mount another workspace: it keeps {self.min_free_mb} MiB free "
            f"(SANDBOX_MIN_FREE_DISK_MB) plus {margin} MiB for each mounted workspace "
            f"({mounted} with this one: SANDBOX_WORKSPACE_HEADROOM_MB; "
            "SANDBOX_WORKSPACE_RESERVE=thin). Existing sessions keep working; retry later or "
            "on another replica"
        )

    def _no_room(self, free: int, size: int, existing: bool = False) -> str:
        if existing:
            return (
                f"this replica's state filesystem (SANDBOX_STATE_DIR) has {free // MIB} MiB "
                f"free: no room to reserve the {size // MIB} MiB of this workspace, made thin "
                "before SANDBOX_WORKSPACE_RESERVE=allocate; its files are kept: retry once "
                "there is room"
            )
        return (
            f"this replica's state filesystem (SANDBOX_STATE_DIR) has {free // MIB} MiB free: no "
            f"room for a new workspace of {size // MIB} MiB (SANDBOX_WORKSPACE_MB; "
            f"SANDBOX_WORKSPACE_RESERVE={self.reserve}) above the {self.min_free_mb} MiB it "
            "keeps free (SANDBOX_MIN_FREE_DISK_MB). Existing sessions keep working; retry later "
            "or on another replica"
        )


def allocate_ranges(image: Path, ranges: list[tuple[int, int]]) -> None:
    """Give these (offset, length) ranges of `image` host blocks (those it has cost nothing).
    Raises OSError (ENOSPC: the host has no room)."""
    fd = os.open(image, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for offset, length in ranges:
            if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(image))
    finally:
        os.close(fd)


FS_IOC_FIEMAP = 0xC020660B
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNWRITTEN = 0x800
FIEMAP_BATCH = 64
FALLOC_FL_PUNCH_HOLE = 0x02


def punch_unwritten(image: Path) -> int:
    """Give back the host blocks of the extents of `image` that are allocated but unwritten
    (they read as zeros, as the hole left in their place does): mkfs.ext4 zeroes the last
    64 KiB of a device (FALLOC_FL_ZERO_RANGE on a file) to wipe old RAID metadata. How many
    bytes were given back. Raises OSError (a filesystem without FIEMAP: nothing done)."""
    fd = os.open(image, os.O_WRONLY | os.O_CLOEXEC)
    punched, start = 0, 0
    try:
        while True:
            request = bytearray(32 + 56 * FIEMAP_BATCH)
            struct.pack_into("QQIII", request, 0, start, 2**64 - 1 - start, 0, 0, FIEMAP_BATCH)
            fcntl.ioctl(fd, FS_IOC_FIEMAP, request)
            mapped = struct.unpack_from("I", request, 20)[0]
            if mapped == 0:
                return punched
            for i in range(mapped):
                logical, _, length = struct.unpack_from("QQQ", request, 32 + 56 * i)
                flags = struct.unpack_from("I", request, 32 + 56 * i + 40)[0]
                if flags & FIEMAP_EXTENT_UNWRITTEN:
                    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
                    if _libc.fallocate(fd, mode, logical, length) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, os.strerror(err), str(image))
                    punched += length
                if flags & FIEMAP_EXTENT_LAST:
                    return punched
                start = logical + length
    finally:
        os.close(fd)
