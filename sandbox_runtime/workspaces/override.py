"""Root's way past workspace quotas, given up for the server's own threads.

ext4 lets a process with CAP_SYS_RESOURCE in its effective set write past a project quota
(and into the blocks the filesystem reserves for root); XFS and btrfs hold root to them. A
server running as root writes into workspaces itself (file tools, file URLs, restoring a
snapshot), so on ext4 a project-mode workspace would take whatever those bring past its
quota. The capability is taken out of the effective set of the main thread at start, before
any thread that could write into a workspace exists: every thread made later inherits the
set, and nothing the server does needs the capability (its rlimit changes only lower limits;
its pipes stay under pipe-max-size). It stays in the permitted set, and programs the server
runs (bwrap, mkfs, mount) get their usual capabilities back when they are executed.
"""

from __future__ import annotations

import ctypes
import os

from loguru import logger

CAP_SYS_RESOURCE = 24
LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def give_up_quota_override() -> bool:
    """Take CAP_SYS_RESOURCE out of this thread's effective set; whether it was there. Call it
    before the process starts the threads that write into workspaces. Raises OSError."""
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capget: {os.strerror(err)}")
    bit = 1 << CAP_SYS_RESOURCE
    if not data[0].effective & bit:
        return False
    data[0].effective &= ~bit
    if _libc.capset(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")
    logger.debug("CAP_SYS_RESOURCE left out of the server's effective capabilities")
    return True
