"""Blank workspaces: made ahead of need, as many as new sessions come in.

A new session's first call takes a blank instead of making its workspace on its path (an
image: mkfs and a loop mount, ~25-40 ms alone, seconds when a burst makes fifty at once). A
blank is an ordinary workspace named blank-..., mounted and empty, counted against the
replica's mount cap only (principal None, like a warm interpreter's slot), and not in use: the
caps and the idle sweeps may take it like any idle workspace (one found no longer ready is
skipped). With the sandbox pool, a sandbox is started in each blank as it is made
(`start_ahead`, set by the composition root: sandbox/pool.py), and the blank is handed out
only once that sandbox has bound it (taking a blank unmounts the path bwrap binds); the
session's first call then finds it waiting (`blank_taken` moves it to the session).

How many: SANDBOX_WORKSPACE_POOL always, plus the most new sessions that came within any
DEMAND_WINDOW (about what making one takes: as many must be ready for none to wait) in the last
DEMAND_MEMORY seconds, up to SANDBOX_WORKSPACE_POOL_MAX. FILL_WORKERS make them at once, so a
refill outpaces what comes in; each stops at the first refusal (a mount cap, no room on the
disk). Blanks above the number are removed as demand falls (`fill`, run after every take and
every TEND_SECONDS). A previous run's blanks are removed at start, this run's at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from loguru import logger

from sandbox_runtime.errors import DiskFullError, SandboxRuntimeError
from sandbox_runtime.workspaces.images import umount
from sandbox_runtime.workspaces.mountcaps import MountCaps
from sandbox_runtime.workspaces.store_state import BLANK_PREFIX

if TYPE_CHECKING:
    from pathlib import Path

DEMAND_WINDOW = 0.25  # seconds: new sessions this close together count as one burst
DEMAND_MEMORY = 300.0  # seconds a burst keeps the pool at its size
# Blanks made at once: as many as cores (each is mkfs, a loop mount and a sandbox's start:
# more at once only take CPU from the calls, measured on 2 cores: 4 made the sessions that
# found none slower than 2 did).
FILL_WORKERS = max(2, len(os.sched_getaffinity(0)))
TAKER_THREADS = 4  # blanks taken at once
TEND_SECONDS = 5.0  # how often the number is looked at without a take (services.py)


def peak(arrivals: Iterable[float], since: float, window: float = DEMAND_WINDOW) -> int:
    """The most `arrivals` (times, in order) within any `window` seconds, from `since` on."""
    times = [t for t in arrivals if t >= since]
    best = low = 0
    for high, t in enumerate(times):
        while t - times[low] > window:
            low += 1
        best = max(best, high - low + 1)
    return best


class Blanks(MountCaps):
    """Blank workspaces of a WorkspaceStore: made, counted, handed to new sessions."""

    if TYPE_CHECKING:  # (workspaces/store.py)

        async def ensure(
            self, name: str, principal: str | None = None, *, ahead: bool = False
        ) -> tuple[Path, bool]: ...

        def _adopt_sync(
            self, slot: str, name: str, principal: str | None, leave_source: bool = False
        ) -> bool: ...

    @property
    def blanks_on(self) -> bool:
        """Whether this store makes blanks (images only: a directory costs nothing to make;
        SANDBOX_WORKSPACE_POOL=0: none, whatever the demand)."""
        return self.mode == "image" and self.blanks_wanted > 0

    def blanks_target(self) -> int:
        """How many blanks to keep now: the floor plus the recent peak of new sessions."""
        demand = peak(self._arrivals, time.monotonic() - DEMAND_MEMORY)
        return max(self.blanks_wanted, min(self.blanks_max, self.blanks_wanted + demand))

    def refill(self) -> None:
        """Start a fill in the background (a take's, or the composition root's loop)."""
        if self.spawn is not None and self.blanks_on and not self._closing:
            with contextlib.suppress(RuntimeError):  # (the supervisor has closed)
                self.spawn("blank workspaces refill", self.fill())

    async def fill(self) -> None:
        """Make blanks up to `blanks_target()` (FILL_WORKERS at once), remove those above it.
        One fill at a time: a call meanwhile makes the running one look again."""
        if not self.blanks_on:
            return
        if self._filling:
            self._fill_again = True
            return
        self._filling = True
        try:
            again = True
            while again and not self._closing:
                self._fill_again = False
                self._blanks = [n for n in self._blanks if self._blank_ready(n)]
                await self._trim_blanks()
                await asyncio.gather(*(self._fill_worker() for _ in range(FILL_WORKERS)))
                again = self._fill_again
        finally:
            self._filling = False

    async def _fill_worker(self) -> None:
        while not self._closing and len(self._blanks) + len(self._making) < self.blanks_target():
            name = f"{BLANK_PREFIX}{uuid.uuid4().hex[:20]}"
            self._making.add(name)
            try:
                if not await self._make_blank(name):
                    return
            finally:
                self._making.discard(name)

    async def _make_blank(self, name: str) -> bool:
        """Make one blank, with a sandbox waiting in it if the pool can; whether to go on."""
        try:
            await self.ensure(name, None, ahead=True)
            if self.start_ahead is not None and not self._closing:
                await self.start_ahead(self.path(name))
        except SandboxRuntimeError as exc:
            logger.debug("no blank workspace made now: {}", exc)
            if self.exists(name):
                await self.remove(name)
            return False
        if self._closing:  # (made while the store closed: aclose waits for this)
            await self.remove(name)
            return False
        if self._blank_ready(name):  # (not taken by a mount cap meanwhile)
            self._blanks.append(name)
        return True

    async def _trim_blanks(self) -> None:
        """Remove the oldest blanks above the number wanted now (not one being taken)."""
        extra = len(self._blanks) - self.blanks_target()
        for name in list(self._blanks[: max(0, extra)]):
            if not (name in self._locks and self._locks[name].locked()):
                self._blanks.remove(name)
                await self.remove(name)

    def _takers(self) -> ThreadPoolExecutor:
        """Threads of their own for taking blanks (a bind, an unmount, a rename: ~0.2 ms, up
        to tens when the kernel waits for a grace period): in a burst, the shared ones are
        busy making images (mkfs, mount: 100+ ms each), and a take must not wait behind
        them. Shut down by the store's aclose."""
        if self._taker_threads is None:
            self._taker_threads = ThreadPoolExecutor(TAKER_THREADS, "blank-take")
        return self._taker_threads

    async def _let_go(self, blank: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self._takers(), self._let_go_sync, blank)

    def _let_go_sync(self, blank: str) -> None:
        """Unmount a taken blank's old path (the filesystem lives on at its session's) and
        remove the mount point."""
        if blank not in self._leaving:
            return
        self._leaving.discard(blank)
        try:
            umount(self.path(blank))
            self.path(blank).rmdir()
        except OSError as exc:
            logger.warning("the taken blank {}'s old mount point stays: {}", blank, exc)

    def _blank_ready(self, name: str) -> bool:
        return name in self._mounted and self.is_ready(name)

    async def _take_blank(self, name: str, principal: str | None) -> bool:
        """Make a ready blank into the new workspace `name` (its lock held); whether one was
        there to take. A refill starts either way. A session's counts as demand (a warm
        interpreter's slot, principal None, takes one as it starts: not a new session)."""
        if principal is not None:
            self._arrivals.append(time.monotonic())
        blank = None
        while self._blanks and blank is None:
            candidate = self._blanks.pop()
            if self._blank_ready(candidate):
                blank = candidate
        self.refill()
        if blank is None:
            return False
        try:
            self.disk.check_room(self.size_mb * 1024 * 1024)  # (a new session, all the same)
        except DiskFullError:
            self._blanks.append(blank)
            raise
        async with self._lock(blank):
            try:
                taken = await asyncio.get_running_loop().run_in_executor(
                    self._takers(), self._adopt_sync, blank, name, principal, True
                )
            except OSError as exc:
                logger.warning("blank workspace {} not taken: {}", blank, exc)
                for hook in self.before_release:  # (its sandbox ends first)
                    await hook(blank)
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self._remove_sync, blank)
                return False
        if not taken:  # (`name` had files after all: the blank stays one)
            self._blanks.append(blank)
            return False
        self._leaving.add(blank)  # (its old path: unmounted after the call has its workspace)
        if self.spawn is None or self._closing:
            await asyncio.to_thread(self._let_go_sync, blank)
        else:
            with contextlib.suppress(RuntimeError):  # (closed: aclose lets it go)
                self.spawn(f"blank {blank} let go", self._let_go(blank))
        for moved in self.blank_taken:
            moved(self.path(blank), self.path(name))
        return True
