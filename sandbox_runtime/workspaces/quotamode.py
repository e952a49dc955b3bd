"""Project mode: workspaces as directories of the state filesystem with a quota it enforces
(an ext4/XFS project quota, or a btrfs subvolume's qgroup), chosen first where it is there.

A workspace in project mode is made by `ensure` in a few syscalls (no mount, no loop device,
no mkfs, nothing preallocated): it costs the disk what it holds, and a full disk is an honest
ENOSPC/EDQUOT to whoever writes, never a journal aborting under acknowledged data. Nothing is
mounted, so the mount caps do not apply to it. Workspaces from before (an image, a plain
directory with files) are served as they were made, on the same host.

A project-mode workspace whose filesystem fails (an I/O error) cannot be checked on its own
(the filesystem is the host's): it is set aside whole in `.quarantine/` for the operator and
the session starts afresh (`workspace_quarantined`), as an image beyond repair is.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from loguru import logger

from sandbox_runtime.errors import DiskFullError, WorkspaceDamagedError
from sandbox_runtime.workspaces.projects import Projects
from sandbox_runtime.workspaces.quotainfo import QuotaDirs, mount_of
from sandbox_runtime.workspaces.repair import QUARANTINE
from sandbox_runtime.workspaces.store_state import StoreState
from sandbox_runtime.workspaces.subvolumes import Subvolumes

MIB = 1024 * 1024


def quota_dirs(root: Path) -> QuotaDirs:
    """The quota'd directories the filesystem under `root` would have (btrfs: subvolumes;
    anything else: project quotas, whose probe says why not)."""
    entry = mount_of(root)
    if entry is not None and entry.fstype == "btrfs":
        return Subvolumes(root)
    return Projects(root)


def probe_project(root: Path) -> tuple[str | None, str | None, str]:
    """(the quota kind, or None; why not; the command that enables it) for workspaces under
    `root` (made if missing)."""
    root.mkdir(parents=True, exist_ok=True)
    dirs = quota_dirs(root)
    problem = dirs.probe()
    return (dirs.kind if problem is None else None), problem, dirs.enable_command()


class QuotaMode(StoreState):
    """Choosing project mode at start, and making, measuring and setting aside its
    workspaces."""

    def _start_project(self) -> bool:
        """Use project mode if it is wanted and available (whether it is). Sets the
        problem and the enabling command otherwise."""
        if self.wanted not in ("auto", "project"):
            return False
        dirs = quota_dirs(self.root)
        problem = dirs.probe()
        self.enable_hint = dirs.enable_command()
        if problem is not None:
            self.project_problem = problem
            return False
        self.quotas, self.mode, self.quota_kind = dirs, "project", dirs.kind
        logger.info(
            "workspaces are {} directories with a quota ({} MiB, {} files{})",
            dirs.kind,
            self.size_mb,
            self.inodes,
            ": btrfs counts files in bytes" if dirs.kind == "btrfs" else "",
        )
        return True

    def _is_quota_dir(self, path: Path) -> bool:
        return self.quotas is not None and self.quotas.is_workspace(path)

    def _ensure_quota_dir(self, name: str) -> None:
        """Make `name` ready as a quota'd directory (the caller holds its lock): set aside
        first if damaged; a plain directory with files from before is served as it is."""
        assert self.quotas is not None
        point = self.path(name)
        if name in self._damaged or self._marker(name).exists():
            self._set_aside(name)
        if point.is_dir() and not self.quotas.is_workspace(point):
            if any(point.iterdir()):
                self._quotaed.discard(name)  # a plain directory from before: served as is
                return
            point.rmdir()  # (an empty plain directory: replaced)
        if not point.is_dir():
            self._check_floor()
            self.quotas.create(point, self.size_mb * MIB, self.inodes, self.uid, self.gid)
        self._quotaed.add(name)

    def _check_floor(self) -> None:
        """Refuse a new workspace below the state filesystem's floor (DiskFullError)."""
        status = self.disk.status()
        if status.low:
            raise DiskFullError(
                f"this replica's state filesystem (SANDBOX_STATE_DIR) has "
                f"{status.free_bytes // MIB} MiB free, below the {self.disk.min_free_mb} MiB "
                "it keeps free (SANDBOX_MIN_FREE_DISK_MB): no new workspace now. Existing "
                "sessions keep working; retry later or on another replica"
            )

    def _set_aside(self, name: str) -> None:
        """Move a damaged workspace whole to .quarantine/ (the session starts afresh)."""
        why = self._damaged.pop(name, None) or "marked damaged by an earlier run"
        point = self.path(name)
        if point.is_dir():
            kept = self.root / QUARANTINE / f"{name}-{int(time.time())}"
            kept.parent.mkdir(mode=0o700, exist_ok=True)
            os.rename(point, kept)
            logger.error(
                "workspace {} ({}) cannot be checked on its own (a directory of the state "
                "filesystem): it is kept at {} for the operator and the session starts afresh",
                name,
                why,
                kept,
            )
            self._resets[name] = "workspace_quarantined"
        self._quotaed.discard(name)
        with contextlib.suppress(FileNotFoundError):
            self._marker(name).unlink()
        for hook in self.on_damage:
            hook("quarantined")

    async def _release_damaged_dir(self, name: str) -> None:
        """Take a damaged project-mode workspace out of use so that it can be set aside (the
        caller holds its lock). Raises WorkspaceDamagedError while something runs in it."""
        if name not in self._in_use():
            self._ready.pop(name, None)
            for hook in self.before_release:
                await hook(name)
            if name not in self._in_use():
                return
        raise WorkspaceDamagedError(
            f"the workspace's filesystem failed ({self._damaged.get(name)}) and something "
            "still runs in it (an execution, an interpreter): it is set aside and replaced "
            "once that ends (cancel_execution; an idle interpreter is stopped after its idle "
            "timeout)"
        )

    def describe_mode(self) -> dict[str, str | None]:
        """The mode this replica's workspaces are in and why (/health)."""
        out: dict[str, str | None] = {"mode": self.mode, "quota": self.quota_kind}
        if self.mode != "project" and self.project_problem is not None:
            out["project_unavailable"] = self.project_problem
            out["enable_project"] = self.enable_hint
        if self.mode == "directory":
            out["no_quota"] = self.problem
        return out
