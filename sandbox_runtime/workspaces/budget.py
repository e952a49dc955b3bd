"""Retention measured in what idle workspaces hold: byte budgets per replica and per principal.

Besides the age limit (retention.py), the idle workspaces of a replica may hold at most
SANDBOX_IDLE_WORKSPACES_MB, and those of one principal at most
SANDBOX_IDLE_WORKSPACES_MB_PER_PRINCIPAL (0: no budget). A workspace is idle when nothing uses
it and it has not been used for SANDBOX_IDLE_WORKSPACE_SECONDS; blanks and warm slots never
count. Past a budget, the least recently used idle workspaces are removed first until it
holds; one in use never is. Where a snapshot store is set, a workspace changed since its last
snapshot (or not used this run) is snapshotted first (the `before_budget_removal` hooks: one
that fails keeps the workspace, tried again after KEEP_RETRY_SECONDS; `kept_elsewhere` checks
again, under the workspace's lock, that nothing changed since), and its session's next call
restores it (`session_reset: workspace_removed`, as after the age limit). A `<name>.removed`
mark is left so that a session this replica forgot meanwhile (a restart without Redis) is
told too and restored; marks go after the retention period.

What a workspace holds: a mounted image's used blocks (statfs), an unmounted image's allocated
blocks (st_blocks, the same stat the sweep makes anyway), a plain directory's allocated blocks
by a walk bounded to DIR_WALK_ENTRIES entries and repeated at most every DIR_MEASURE_SECONDS.
Its principal and session are recorded beside it (`<name>.owner`, written once per run when a
session is placed here, its mtime touched with each recorded use), so the budgets hold across
restarts; a workspace without a record (made before) counts against the replica's budget
only, by its image's mtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Set
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.workspaces.retention import Retention
from sandbox_runtime.workspaces.store_state import BLANK_PREFIX, IMAGE_SUFFIX, NAME, OWNER_SUFFIX

DIR_WALK_ENTRIES = 10_000  # a plain directory's measure stops here (a lower bound then)
DIR_MEASURE_SECONDS = 600.0
MAX_REMOVED_PER_PASS = 256  # (the rest wait for the next sweep)
KEEP_RETRY_SECONDS = 600.0  # after a snapshot before removal failed
REMOVED_SUFFIX = ".removed"  # a workspace removed over a budget (its session not told yet)
MARKER_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC


@dataclass(frozen=True)
class Held:
    """An idle workspace: what it holds and when it was last used (wall clock)."""

    name: str
    principal: str | None
    bytes: int
    last_used: float


def over_budget(
    idle: Iterable[Held], replica_bytes: int, principal_bytes: int, kept: Set[str] = frozenset()
) -> list[Held]:
    """The idle workspaces to remove, least recently used first, so that each principal's
    hold at most `principal_bytes` and all of them at most `replica_bytes` (0: no budget).
    Those named in `kept` (their snapshot failed lately) count but are passed over: the next
    oldest go in their place, so one that cannot be snapshotted does not stall the budget."""
    items = sorted(idle, key=lambda h: h.last_used)
    doomed: list[Held] = []
    if principal_bytes > 0:
        totals: dict[str | None, int] = defaultdict(int)
        for held in items:
            totals[held.principal] += held.bytes
        for held in items:
            if held.name in kept:
                continue
            if held.principal is not None and totals[held.principal] > principal_bytes:
                doomed.append(held)
                totals[held.principal] -= held.bytes
    if replica_bytes > 0:
        gone = {held.name for held in doomed}
        total = sum(held.bytes for held in items if held.name not in gone)
        for held in items:
            if total <= replica_bytes:
                break
            if held.name not in gone and held.name not in kept:
                doomed.append(held)
                total -= held.bytes
    return doomed


def directory_bytes(path: Path, limit: int = DIR_WALK_ENTRIES) -> int:
    """Allocated bytes under `path`, from at most `limit` entries (never following links)."""
    total, seen, stack = 0, 0, [str(path)]
    while stack and seen < limit:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as entries:
            for entry in entries:
                seen += 1
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                if seen >= limit:
                    break
    return total


class Budgets(Retention):
    """Measuring idle workspaces and keeping them under the byte budgets."""

    def record_owner(self, name: str, owner: Owner) -> None:
        """Remember whose workspace `name` is (its session placed here), on disk once a run."""
        known = (owner.principal, owner.session_id)
        if self._owners.get(name) == known:
            return
        self._owners[name] = known
        record = json.dumps({"principal": owner.principal, "session": owner.session_id})
        with contextlib.suppress(OSError):  # (unrecorded, it counts for the replica only)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            fd = os.open(self._owner_file(name), flags, 0o600)
            try:
                os.write(fd, record.encode())
            finally:
                os.close(fd)

    def _owner_file(self, name: str) -> Path:
        return self.root / f"{name}{OWNER_SUFFIX}"

    def _owner(self, name: str) -> tuple[str, str] | None:
        if name not in self._owners:
            try:
                known = json.loads(self._owner_file(name).read_text())
                self._owners[name] = (str(known["principal"]), str(known["session"]))
            except (OSError, ValueError, KeyError, TypeError):
                return None
        return self._owners[name]

    def idle_held(self, now: float | None = None) -> list[Held]:
        """The idle workspaces and what each holds."""
        return self._idle_held(*self._view(), now)

    def _view(self) -> tuple[set[str], dict[str, float], set[str]]:
        """What the measuring needs of the store's state, copied on the event loop: names
        not to count (in use, a sandbox waiting in them, locked, blanks), last uses this run,
        the mounted."""
        skip = self._in_use() | self._standing_by() | set(self._blanks)
        skip |= {name for name, lock in self._locks.items() if lock.locked()}
        return skip, dict(self._ready), set(self._mounted)

    def _idle_held(
        self, skip: set[str], ready: dict[str, float], mounted: set[str], now: float | None
    ) -> list[Held]:
        now = time.time() if now is None else now
        wall = now - time.monotonic()  # (a monotonic time + wall = its wall-clock time)
        found: dict[str, Held] = {}
        seen: set[str] = set()
        with contextlib.suppress(OSError), os.scandir(self.root) as entries:
            for entry in entries:
                name = entry.name.removesuffix(IMAGE_SUFFIX)
                if name in seen or name in skip or not NAME.fullmatch(name):
                    continue
                seen.add(name)  # (an image and its mount point: one workspace)
                if name.startswith(BLANK_PREFIX):
                    continue
                held = self._measure(name, wall, ready.get(name), name in mounted)
                if held is not None and held.last_used + self.idle_after_seconds <= now:
                    found[name] = held
        return list(found.values())

    def _measure(self, name: str, wall: float, ready: float | None, mounted: bool) -> Held | None:
        image, is_image = self.image(name), True
        try:
            try:
                st = image.stat()
            except FileNotFoundError:
                st, is_image = self.path(name).stat(), False
        except OSError:
            return None
        try:  # (its last use: an image's own mtime moves when its mount writes back)
            used = self._owner_file(name).stat().st_mtime
        except OSError:
            used = st.st_mtime
        if ready is not None:
            used = max(used, ready + wall)
        if mounted:
            try:
                fs = os.statvfs(self.path(name))
                held = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
            except OSError:
                held = st.st_blocks * 512
        elif is_image:
            held = st.st_blocks * 512
        else:
            quota_held = self._quota_bytes(name)
            held = self._directory_bytes(name) if quota_held is None else quota_held
        owner = self._owner(name)
        return Held(name, owner[0] if owner else None, held, used)

    def _quota_bytes(self, name: str) -> int | None:
        """What a project-mode workspace holds, by its quota (one syscall or sysfs read; None:
        not a quota'd directory)."""
        quotas = self.quotas
        if quotas is None:
            return None
        try:
            if not quotas.is_workspace(self.path(name)):
                return None
            return quotas.usage(self.path(name)).bytes_used
        except OSError:
            return None

    def _directory_bytes(self, name: str) -> int:
        cached = self._dir_bytes.get(name)
        if cached is not None and time.monotonic() - cached[1] < DIR_MEASURE_SECONDS:
            return cached[0]
        held = directory_bytes(self.path(name))
        self._dir_bytes[name] = (held, time.monotonic())
        return held

    async def sweep(self) -> tuple[int, int]:
        """The age limit's removals and the idle unmounts (retention.py), then the budgets':
        how many were removed and unmounted."""
        removed, unmounted = await super().sweep()
        await asyncio.to_thread(self._forget_old_marks)
        for hook in self.on_removed:
            for _ in range(removed):
                hook("age")
        return removed + await self.apply_budgets(), unmounted

    async def apply_budgets(self) -> int:
        """Remove the least recently used idle workspaces past a budget: how many."""
        if self.budget_bytes <= 0 and self.budget_bytes_per_principal <= 0:
            return 0
        held = await asyncio.to_thread(self._idle_held, *self._view(), None)
        now = time.monotonic()
        kept = {n for n, at in self._keep_failed.items() if now - at < KEEP_RETRY_SECONDS}
        doomed = over_budget(held, self.budget_bytes, self.budget_bytes_per_principal, kept)
        removed = 0
        for victim in doomed[:MAX_REMOVED_PER_PASS]:
            if await self._remove_idle(victim):
                removed += 1
                logger.info(
                    "removed the idle workspace {} ({} bytes, unused since {}): over the idle "
                    "workspaces' byte budget",
                    victim.name,
                    victim.bytes,
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(victim.last_used)),
                )
                for hook in self.on_removed:
                    hook("budget")
        return removed

    async def _remove_idle(self, victim: Held) -> bool:
        """Remove an idle workspace past a budget, after a snapshot where a store is set;
        whether it did (not when it is used meanwhile, or its snapshot failed)."""
        owner = self._owner(victim.name)
        failed = self._keep_failed.get(victim.name)
        if failed is not None and time.monotonic() - failed < KEEP_RETRY_SECONDS:
            return False
        if owner is not None:
            who = Owner(principal=owner[0], session_id=owner[1])
            for keep in self.before_budget_removal:
                try:
                    if not await keep(who):
                        return False
                except Exception as exc:  # (a store down, too large: kept, tried again later)
                    self._keep_failed[victim.name] = time.monotonic()
                    if len(self._keep_failed) > 10_000:
                        self._keep_failed.clear()
                    logger.warning(
                        "idle workspace {} kept over the budget (its snapshot failed: {}); "
                        "tried again in {:g} s",
                        victim.name,
                        exc,
                        KEEP_RETRY_SECONDS,
                    )
                    return False
        else:
            who = None
        mark = time.monotonic()
        name = victim.name
        async with self._lock(name):
            if name in self._in_use() or name in self._standing_by():
                return False
            if self._ready.get(name, -1.0) > mark:
                return False  # (used since its snapshot)
            if who is not None and not all(kept(who) for kept in self.kept_elsewhere):
                return False  # (changed while its snapshot was taken: the next pass)
            for release in self.before_release:
                await release(name)
            if name in self._in_use():
                return False
            await asyncio.to_thread(self._remove_sync, name)
            if who is not None:  # (its session, forgotten by a restart, is told all the same)
                with contextlib.suppress(OSError):
                    os.close(os.open(self._removed_marker(name), MARKER_FLAGS, 0o600))
        return True

    def _removed_marker(self, name: str) -> Path:
        return self.root / f"{name}{REMOVED_SUFFIX}"

    def take_removed(self, name: str) -> bool:
        """Whether the workspace was removed over a budget since its session's last call
        (once: the mark is consumed)."""
        try:
            self._removed_marker(name).unlink()
        except OSError:
            return False
        return True

    def _forget_old_marks(self) -> None:
        """Removal marks kept past the retention period go (their sessions are long gone)."""
        cutoff = time.time() - self.retention_seconds
        with contextlib.suppress(OSError), os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.endswith(REMOVED_SUFFIX):
                    with contextlib.suppress(OSError):
                        if entry.stat().st_mtime < cutoff:
                            os.unlink(entry.path)
