"""What a WorkspaceStore knows about its workspaces, and how they are named and used.

The state every part of the store shares (workspaces/store.py puts them together): which
workspaces are ready (last use), mounted, and counted against the mount caps (by principal);
the per-name locks that make a mount, unmount, removal or replacement one step for every other
user; the holds of host-side file operations; and the hooks the store's owner sets (what is
busy or waiting, what must end before a release, refusals and damage to count). Naming (a
workspace's mount point, image and damage marker), recording use, and measuring live here
too. The other parts are mixins over this: mountcaps.py (the caps), retention.py (unmounting
idle workspaces and removing expired ones), damage.py (a failed filesystem's course).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.workspaces.diskguard import DiskGuard
from sandbox_runtime.workspaces.diskspace import StateDisk
from sandbox_runtime.workspaces.ext4meta import metadata_bytes
from sandbox_runtime.workspaces.quotainfo import QuotaDirs

NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
BLANK_PREFIX = "blank-"  # a workspace made ahead of need (store.py)
IMAGE_SUFFIX = ".img"
DAMAGED_SUFFIX = ".damaged"
OWNER_SUFFIX = ".owner"  # whose a workspace is (budget.py)
MAX_ARRIVALS = 4096  # new sessions' times kept for the blanks' demand (blanks.py)


class StoreState:
    """The shared state, naming and use-tracking of a WorkspaceStore (workspaces/store.py)."""

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
        reserve: str = "thin",
        min_free_mb: int = 0,
        headroom_mb: int = 64,
        blanks: int = 0,
        blanks_max: int = 0,
        idle_budget_mb: int = 0,
        idle_budget_mb_per_principal: int = 0,
        idle_after_seconds: float = 300.0,
    ) -> None:
        self.root = root
        self.size_mb = size_mb
        self.disk = StateDisk(
            root, reserve=reserve, min_free_mb=min_free_mb, headroom_mb=headroom_mb
        )
        self.inodes = inodes
        self.wanted = quota  # auto, project, image, none
        self.uid = self.gid = -1  # the sandbox user's, set by start()
        self.retention_seconds = retention_seconds
        self.max_mounted = max_mounted
        self.max_mounted_per_principal = max_mounted_per_principal
        self.mode = "directory"  # or "project" / "image": what start() found works
        self.problem: str | None = None  # why there is no quota
        # Project mode (workspaces/quotamode.py): the quota'd directories, their kind (ext4,
        # xfs, btrfs), why the mode is not used here, and the command that enables it.
        self.quotas: QuotaDirs | None = None
        self.quota_kind: str | None = None
        self.project_problem: str | None = None
        self.enable_hint: str | None = None
        # The sets and dicts below are changed in worker threads too (the store's *_sync
        # functions: mkfs, mount, remove). The event loop reads them through a copy (list(),
        # set(), dict(): one step under the GIL), never by iterating them: a thread adding a
        # name mid-iteration fails it ("Set changed size during iteration", a session refused
        # by an unmapped error; seen after thousands of new sessions).
        self._quotaed: set[str] = set()  # names made ready as quota'd directories this run
        self._ready: dict[str, float] = {}  # name -> last use (monotonic), made ready this run
        self._mounted: set[str] = set()  # those of them that are mounted images
        self._swept: set[str] = set()  # names whose partial uploads were removed this run
        # Mounted images, and those being mounted, with their principal (None: a warm slot):
        # what the mount caps count.
        self._principals: dict[str, str | None] = {}
        self.disk.mounted = lambda: len(self._principals)
        # Stops thin workspaces taking data while the state filesystem is under its line (a
        # supervised loop runs its step: app/services.py).
        self.disk.metadata = metadata_bytes(size_mb, inodes)
        if self.disk.margin > headroom_mb * 1024 * 1024:
            logger.info(
                "each mounted workspace keeps {} MiB free, more than SANDBOX_WORKSPACE_HEADROOM_MB"
                "={}: its metadata may take {} MiB",
                -(-self.disk.margin // 2**20),
                headroom_mb,
                -(-self.disk.metadata // 2**20),
            )
        self.guard = DiskGuard(
            self.disk, lambda: [(self.path(n), self.image(n)) for n in list(self._mounted)]
        )
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
        # Called with a damaged workspace's name before it is released to be checked: users
        # that idle in it (an interpreter between calls) are stopped and waited for.
        self.release_idle: list[Callable[[str], Awaitable[None]]] = []
        # Byte budgets of idle workspaces (budget.py): whose each is (principal, session),
        # plain directories' measures (bytes, when), removals counted by reason (age,
        # budget), and what keeps a workspace's files before a budget removes it (snapshots):
        # an async step that may snapshot it, and a check under its lock that it is kept.
        self.budget_bytes = idle_budget_mb * 1024 * 1024  # (0: none)
        self.budget_bytes_per_principal = idle_budget_mb_per_principal * 1024 * 1024
        self.idle_after_seconds = idle_after_seconds
        self._owners: dict[str, tuple[str, str]] = {}
        self._dir_bytes: dict[str, tuple[int, float]] = {}
        self._keep_failed: dict[str, float] = {}  # name -> when its snapshot failed
        self.on_removed: list[Callable[[str], None]] = []
        self.before_budget_removal: list[Callable[[Owner], Awaitable[bool]]] = []
        self.kept_elsewhere: list[Callable[[Owner], bool]] = []
        self._fsid: int | None = None  # the root's filesystem's statfs id (damage.py)
        self._damaged: dict[str, str] = {}  # name -> what failed, until checked
        self._resets: dict[str, str] = {}  # name -> a session_reset reason not yet told
        # Called with detected, clean, repaired or quarantined (a damaged workspace's course).
        self.on_damage: list[Callable[[str], None]] = []
        # Blank workspaces made ahead of need (blanks.py): how many to keep at least and at
        # most, those made and being made, when new sessions took one (the demand), and the
        # composition root's: what starts a refill in the background, what starts a sandbox
        # in a blank, what hears of a blank that became a session's (old path, new path).
        # (`spawn` runs work in the background: the supervisor's.)
        self.blanks_wanted = blanks
        self.blanks_max = blanks_max
        self._blanks: list[str] = []
        self._making: set[str] = set()
        self._arrivals: deque[float] = deque(maxlen=MAX_ARRIVALS)
        self._filling = self._fill_again = False
        self._taker_threads: ThreadPoolExecutor | None = None
        self._leaving: set[str] = set()  # taken blanks whose old path is still mounted
        self._closing = False  # (aclose has begun: no more blanks)
        self.spawn: Callable[[str, Coroutine[Any, Any, None]], object] | None = None
        self.start_ahead: Callable[[Path], Awaitable[bool]] | None = None
        self.blank_taken: list[Callable[[Path, Path], None]] = []

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

    def _marker(self, name: str) -> Path:
        return self.root / f"{name}{DAMAGED_SUFFIX}"

    # -- use ---------------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            if len(self._locks) > 10_000:
                self._locks = {n: lk for n, lk in self._locks.items() if lk.locked()}
            lock = self._locks[name] = asyncio.Lock()
        return lock

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
        # (An image's own mtime also moves when its mount writes back, e.g. at an unmount:
        # the owner record's is when it was last used, for the budgets' order.)
        with contextlib.suppress(OSError):
            os.utime(self.root / f"{name}{OWNER_SUFFIX}")

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

    def last_used(self, name: str) -> float | None:
        """When the workspace was last used this run (monotonic; None: not ready now)."""
        return self._ready.get(name)

    def in_use(self) -> set[str]:
        """Workspaces something uses now (executions, kernels, host-side file operations)."""
        return self._in_use()

    def _in_use(self) -> set[str]:
        names = set(self._holds)
        for busy in self.busy:
            names |= busy()
        return names

    def _standing_by(self) -> set[str]:
        names: set[str] = set()
        for waiting in self.standby:
            names |= waiting()
        return names

    # -- measuring ---------------------------------------------------------------------------

    def usage(self, name: str) -> dict[str, int | None]:
        """Bytes and files used and allowed (None: no quota, or not counted) of a mounted
        or quota'd workspace."""
        if name in self._quotaed and self.quotas is not None:
            got = self.quotas.usage(self.path(name))
            return {
                "bytes_used": got.bytes_used,
                "bytes_limit": got.bytes_limit,
                "files_used": got.files_used,
                "files_limit": got.files_limit,
            }
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
        if name in self._quotaed and self.quotas is not None:
            got = self.quotas.usage(self.path(name))
            st = os.statvfs(self.path(name))  # (the shared filesystem may have less)
            room = st.f_bavail * st.f_frsize
            if got.bytes_limit is None:
                return room
            return max(0, min(room, got.bytes_limit - got.bytes_used))
        if name not in self._mounted:
            return None
        st = os.statvfs(self.path(name))
        return st.f_bavail * st.f_frsize
