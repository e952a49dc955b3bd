"""A kernel's directory: the one place beside its workspace that a kernel's sandbox can write.

The relay and the kernel talk over `ipc` socket files there (bound writable at
/run/srt-kernel), so the sandbox user owns it. On the state filesystem it would be a hole in
every quota: sandboxed code could write there until the disk is full, beside its workspace's
limit (and, in project mode, on the very filesystem every workspace shares). With the server
running as root it is a tmpfs of its own instead, of KERNEL_DIR_BYTES and KERNEL_DIR_FILES
(its sockets, connection file and relay script need a few KiB): a write past that is ENOSPC
in the sandbox and takes nothing from the disk; its pages are charged to the writer's memory
cgroup. Without root, or without the right to mount (a restricted container), there is no
quota anywhere to protect (workspaces are plain directories) and it stays a plain directory.

Mounts a killed server left under the kernels' root are detached at start (clear).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from pathlib import Path

from loguru import logger

from sandbox_runtime.workspaces.images import mounts_under, umount

KERNEL_DIR_BYTES = 1024 * 1024
KERNEL_DIR_FILES = 64
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8

_libc = ctypes.CDLL(None, use_errno=True)
_unbounded_said = False


def make(directory: Path, uid: int, gid: int) -> None:
    """Make the kernel directory `directory` (mode 0700, uid/gid's; a bounded tmpfs when
    running as root and mounts are allowed). Raises OSError (the directory)."""
    directory.mkdir(mode=0o700)
    if os.geteuid() != 0:
        return
    options = f"size={KERNEL_DIR_BYTES},nr_inodes={KERNEL_DIR_FILES},mode=0700,uid={uid},gid={gid}"
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    raw = os.fsencode(directory)
    if _libc.mount(b"tmpfs", raw, b"tmpfs", flags, options.encode()) != 0:
        # (root without CAP_SYS_ADMIN, e.g. a restricted container: it cannot have quotas
        # either, so nothing is given up; said once)
        global _unbounded_said
        if not _unbounded_said:
            _unbounded_said = True
            logger.warning(
                "kernel directories are plain directories of the state filesystem, not "
                "bounded tmpfs mounts (mount: {}): interpreter code can write there beside "
                "its workspace's quota",
                os.strerror(ctypes.get_errno()),
            )


def remove(directory: Path) -> None:
    """Unmount (if it is a tmpfs) and remove a kernel directory. Never raises."""
    with contextlib.suppress(OSError):
        if os.path.ismount(directory):
            umount(directory)
    shutil.rmtree(directory, ignore_errors=True)


def clear(root: Path) -> None:
    """Remove every kernel directory under `root` (a previous server's, or this one's at its
    end), detaching their mounts first. Never raises."""
    for point in mounts_under(root):
        with contextlib.suppress(OSError):
            umount(point)
    shutil.rmtree(root, ignore_errors=True)
