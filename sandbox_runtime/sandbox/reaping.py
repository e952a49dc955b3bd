"""Reaping what the spawner could not: the server is a child subreaper, so a bwrap whose
spawner died under it is reparented to the server, which must reap it (and nothing else:
the server's other children are waited for by their owners)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from loguru import logger

PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> None:
    """Make this process the reaper of its descendants' orphans (needs root to matter)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno {}", ctypes.get_errno())


def reap_orphans(uid: int) -> int:
    """Reap the zombie bwraps running as `uid` among this process's children (reparented to
    it when their spawner died under them); how many were reaped."""
    reaped = 0
    for pid in children_of(os.getpid()):
        if not is_orphaned_sandbox(pid, uid):
            continue  # someone else's child: its owner waits for it
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        reaped += done != 0
    return reaped


def is_orphaned_sandbox(pid: int, uid: int) -> bool:
    """A zombie bwrap running as `uid`: only those were reparented to us."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return is_zombie_bwrap(status, uid)


def is_zombie_bwrap(status: str, uid: int) -> bool:
    """Whether /proc/PID/status text `status` is a zombie bwrap whose real uid is `uid`."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uids = fields.get("Uid", "").split()
    return (
        fields.get("Name", "").strip() == "bwrap"
        and fields.get("State", "").strip().startswith("Z")
        and bool(uids)
        and int(uids[0]) == uid
    )


def children_of(pid: int) -> list[int]:
    """The children of `pid` (every thread's), from /proc."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out
