"""The state filesystem's space: workspace images reserved in full, a floor of free space kept.

A sparse image promises the sandbox bytes the host may not have: when the state filesystem
fills, writes an image already acknowledged fail in the loop device's writeback, the kernel
aborts the workspace's journal and files are lost. So by default (`allocate`) an image gets
all its blocks when it is made (fallocate: a few ms per GiB on ext4, nothing written) and is
mounted without `discard` (which would punch them back out): a workspace then never needs a
block of the host's, whatever else fills the host filesystem, and a new workspace is refused
(DiskFullError) when it does not fit above the floor. We chose allocation over counting what
sparse images may still grow against free space: counting cannot stop another program from
filling the disk under them. The cost is the whole quota of disk per workspace, idle ones kept
for the retention period included. `sparse` keeps the old behaviour for hosts that prefer
density; the floor and the damage checks (workspaces/repair.py) still apply.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from sandbox_runtime.errors import DiskFullError

FALLOC_FL_KEEP_SIZE = 0x01
MIB = 1024 * 1024

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
    """Space on the filesystem under `root` (SANDBOX_STATE_DIR's): what images reserve, what
    is left, and whether that is below `min_free_mb` (logged when it changes)."""

    def __init__(self, root: Path, *, reserve: str = "allocate", min_free_mb: int = 0) -> None:
        self.root = root
        self.reserve = reserve  # allocate, sparse
        self.min_free_mb = min_free_mb
        self.low = False  # below the floor when last looked

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

    def mount_options(self, base: str) -> str:
        # `discard` gives a deleted file's blocks back to the host: right for a sparse image,
        # wrong for an allocated one (it would punch holes in the reservation).
        return base if self.reserve == "allocate" else f"{base},discard"

    def check_room(self, size: int) -> None:
        """Refuse a new image of `size` bytes (what it reserves) that would leave less than
        the floor free. Raises DiskFullError."""
        reserved = size if self.reserve == "allocate" else 0
        free = self.status().free_bytes
        if free - reserved < self.min_free_mb * MIB:
            raise DiskFullError(self._no_room(free, size))

    def allocate(self, fd: int, size: int, image: Path, existing: bool = False) -> None:
        """Give the image (open as `fd`) all its `size` bytes now, if reserving; `existing`:
        an image made sparse before. Raises DiskFullError, OSError."""
        if self.reserve != "allocate" or _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.ENOSPC:
            raise DiskFullError(self._no_room(self.status().free_bytes, size, existing))
        if err == errno.EOPNOTSUPP:
            logger.warning(
                "the state filesystem cannot allocate workspace images (fallocate): they stay "
                "sparse, and a full disk can lose their writes (put SANDBOX_STATE_DIR on ext4 "
                "or xfs)"
            )
            self.reserve = "sparse"
            return
        raise OSError(err, os.strerror(err), str(image))

    def allocate_existing(self, image: Path) -> None:
        """Allocate in full an image made sparse (by an earlier setting) before it is mounted.
        Raises DiskFullError, OSError."""
        if self.reserve != "allocate":
            return
        st = image.stat()
        if st.st_blocks * 512 >= st.st_size:
            return
        fd = os.open(image, os.O_WRONLY | os.O_CLOEXEC)
        try:
            self.allocate(fd, st.st_size, image, existing=True)
        finally:
            os.close(fd)

    def _no_room(self, free: int, size: int, existing: bool = False) -> str:
        if existing:
            return (
                f"this replica's state filesystem (SANDBOX_STATE_DIR) has {free // MIB} MiB "
                f"free: no room to reserve the {size // MIB} MiB of this workspace, made sparse "
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
