"""Retention: unmounting workspaces idle a while, and removing those unused for the retention
period (their image, mount point and damage marker).

An image is mounted when first used and unmounted after UNMOUNT_IDLE_SECONDS without use (its
files come back on its next use; a thin image gives back its journal's blocks then:
images.release_journal); a workspace unused for the retention period (counted from
the last use recorded on disk, across restarts) is removed. Nothing in use is unmounted or
removed: every release first waits for the `before_release` hooks (a sandbox started ahead
of need holds a bind of it and must end first), under the workspace's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time

from sandbox_runtime.workspaces.images import mounts_under, release_journal, umount
from sandbox_runtime.workspaces.store_state import IMAGE_SUFFIX, NAME, OWNER_SUFFIX, StoreState

UNMOUNT_IDLE_SECONDS = 300.0


class Retention(StoreState):
    """Unmounting, removing and sweeping a store's workspaces."""

    async def remove(self, name: str) -> None:
        """Remove the workspace and its contents (nothing may be running in it)."""
        self._check(name)
        async with self._lock(name):
            for hook in self.before_release:
                await hook(name)
            await asyncio.to_thread(self._remove_sync, name)

    def _remove_sync(self, name: str) -> None:
        point = self.path(name)
        if name in self._mounted or point in mounts_under(self.root):
            umount(point)
        self._mounted.discard(name)
        self._principals.pop(name, None)
        self._ready.pop(name, None)
        self._touched.pop(name, None)
        self._damaged.pop(name, None)
        self._swept.discard(name)
        self._quotaed.discard(name)
        if self.quotas is not None and self.quotas.is_workspace(point):
            self.quotas.remove(point)  # (and its quota: a project's limits, a qgroup)
        with contextlib.suppress(FileNotFoundError):
            self.image(name).unlink()
        with contextlib.suppress(FileNotFoundError):
            self._marker(name).unlink()
        with contextlib.suppress(FileNotFoundError):
            (self.root / f"{name}{OWNER_SUFFIX}").unlink()
        self._owners.pop(name, None)
        self._dir_bytes.pop(name, None)
        shutil.rmtree(point, ignore_errors=True)

    def remove_all(self, prefix: str) -> int:
        """Remove every workspace whose name starts with `prefix`, now (at start, before
        anything runs in them): how many."""
        names = {
            p.name.removesuffix(IMAGE_SUFFIX)
            for p in self.root.glob(f"{prefix}*")
            if NAME.fullmatch(p.name.removesuffix(IMAGE_SUFFIX))
        }
        for name in names:
            with contextlib.suppress(OSError):
                self._remove_sync(name)
        return len(names)

    def idle(self, now: float | None = None) -> list[str]:
        """Workspaces unused for the retention period and not in use now."""
        now = time.time() if now is None else now
        busy = self._in_use()
        names: set[str] = set()
        with contextlib.suppress(OSError), os.scandir(self.root) as entries:
            for entry in entries:
                name = entry.name.removesuffix(IMAGE_SUFFIX)
                if name in busy or not NAME.fullmatch(name) or name in names:
                    continue
                handle = self.image(name) if self.image(name).exists() else self.path(name)
                with contextlib.suppress(OSError):
                    if handle.stat().st_mtime + self.retention_seconds <= now:
                        names.add(name)
        return sorted(names)

    async def sweep(self) -> tuple[int, int]:
        """Unmount workspaces idle a while and remove those idle past retention: how many
        of each."""
        removed = 0
        for name in self.idle():
            if name in self._locks and self._locks[name].locked():
                continue
            await self.remove(name)
            removed += 1
        unmounted = 0
        busy = self._in_use()
        cutoff = time.monotonic() - UNMOUNT_IDLE_SECONDS
        for name in list(self._mounted):
            if self._ready.get(name, 0) > cutoff or name in busy or name in self._blanks:
                continue
            if await self._unmount(name, used_after=cutoff):
                unmounted += 1
        return removed, unmounted

    async def _unmount(self, name: str, used_after: float | None = None) -> bool:
        """Unmount the image of `name` if nothing uses it (nor did after `used_after`); its
        image stays, and its next use mounts it again. Whether it did."""
        async with self._lock(name):
            last_used = self._ready.get(name)
            if name not in self._mounted or last_used is None or name in self._in_use():
                return False
            if used_after is not None and last_used > used_after:
                return False
            del self._ready[name]  # (from here, new users wait for the lock: ensure)
            unmounted = False
            try:
                for hook in self.before_release:
                    await hook(name)
                if name in self._in_use():  # (a call came meanwhile: it waits for the lock)
                    return False
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(umount, self.path(name))
                    self._mounted.discard(name)
                    self._principals.pop(name, None)
                    os.chmod(self.path(name), 0)
                    unmounted = True
                if unmounted and self.disk.thin:
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(release_journal, self.image(name))
                return unmounted
            finally:
                if not unmounted and name in self._mounted:
                    self._ready.setdefault(name, last_used)
