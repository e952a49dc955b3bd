"""What the two kinds of quota'd workspace directories share: their usage, their interface,
and finding the filesystem a path is on (type, device, mount options) to pick one.

A quota'd directory is a workspace on the shared state filesystem limited by the filesystem
itself: an ext4/XFS project quota (workspaces/projects.py) or a btrfs subvolume's qgroup
(workspaces/subvolumes.py). Both have the same shape, `QuotaDirs`.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class QuotaUsage:
    """A quota'd workspace's use and limits (None: not limited, or not counted)."""

    bytes_used: int
    bytes_limit: int | None
    files_used: int | None
    files_limit: int | None


class QuotaDirs(Protocol):
    """Quota'd workspace directories under one root."""

    kind: str  # ext4, xfs, btrfs
    root: Path

    def probe(self) -> str | None: ...
    def enable_command(self) -> str: ...
    def is_workspace(self, path: Path) -> bool: ...
    def create(self, path: Path, limit_bytes: int, inodes: int, uid: int, gid: int) -> None: ...
    def remove(self, path: Path) -> None: ...
    def usage(self, path: Path) -> QuotaUsage: ...


@dataclass(frozen=True)
class MountEntry:
    point: str
    fstype: str
    device: str
    options: frozenset[str]  # the mount's and the superblock's options


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(line: str) -> MountEntry | None:
    """One line of /proc/self/mountinfo (None: not one)."""
    fields = line.split()
    if "-" not in fields or len(fields) < 6:
        return None
    dash = fields.index("-")
    if len(fields) < dash + 4:
        return None
    options = set(fields[5].split(",")) | set(fields[dash + 3].split(","))
    return MountEntry(
        _unescape(fields[4]), fields[dash + 1], _unescape(fields[dash + 2]), frozenset(options)
    )


def mount_of(path: Path) -> MountEntry | None:
    """The mount `path` is on (the last mounted at its longest matching mount point)."""
    target = os.path.realpath(path)
    best: MountEntry | None = None
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            entry = parse_mountinfo(line)
            if entry is None:
                continue
            point = entry.point.rstrip("/") + "/"
            if (target + "/").startswith(point) and (
                best is None or len(entry.point) >= len(best.point)
            ):
                best = entry
    return best
