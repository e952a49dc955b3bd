"""The workspaces of this replica, in one of three modes chosen at start (SANDBOX_WORKSPACE_QUOTA):

- project: a directory of the state filesystem with a quota that filesystem enforces (an
  ext4/XFS project quota, or a btrfs subvolume with a qgroup limit: workspaces/quotamode.py,
  projects.py, subvolumes.py). A few syscalls to make, nothing mounted or preallocated: a
  workspace costs what it holds, a full disk is an ENOSPC/EDQUOT to the writer. `auto` takes
  it first where the state filesystem has it.
- image: one ext4 image per workspace (its quota), mounted while used. An image file
  formatted with `mkfs.ext4 -N` and loop-mounted costs a few ms to make and ~3 ms to mount; it
  puts the workspace on a filesystem of its own (a hard link to a file outside cannot exist,
  host-side file operations cannot cross into another mount). The sandbox only ever sees the
  mounted filesystem; the image file is root's, 0600, outside. `auto` takes it where project
  quotas are missing and the host can mount images (root, loop devices, mkfs.ext4).
- directory: plain directories without a quota (neither is possible, or `none`), and said
  so (doctor, /health).

Workspaces made in another mode before are served as they were made: an image stays an image
(mounted, counted by the mount caps), a plain directory with files stays one.

Image layout under the root: `<name>.img` (the image) and `<name>/` (its mount point,
root-owned mode 0 while nothing is mounted, so nothing is ever written to the host's disk
through it). An image is mounted when first used, unmounted after UNMOUNT_IDLE_SECONDS
without use, and removed with its mount point after the retention period. Each mount holds a
loop device and a journal thread in the kernel, so mounts are capped per replica and per
principal: a mount past a cap first unmounts the least recently used idle workspace (its
image stays: its files come back on its next use), and is refused (LimitExceededError) when
every one is in use. Mounts a killed server left are detached at start. Images are thin: a
workspace costs the disk what it holds. A new mount is refused when the state filesystem has no
room above its floor for what the mounted ones may still take, and a watchdog stops writes
(ENOSPC) before a full disk could fail one it accepted (workspaces/diskspace.py,
diskguard.py). Project-mode workspaces are `<name>/` only; the mount caps do not count them.

The store is put together here from its parts: images.py (making and mounting an image,
stateless), quotamode.py (project mode), store_state.py (what the store knows, naming, use),
mountcaps.py (the mount caps and making room), blanks.py (workspaces made ahead of need, as
many as new sessions come in), retention.py (unmounting idle workspaces,
removing expired ones), budget.py (the byte budgets of idle workspaces) and damage.py (a
failed filesystem's course). This module keeps the lifecycle (start, close), making a
workspace ready (ensure) and handing a warm slot's workspace to a session (adopt: a rename,
or for an image a bind then a rename of its file).

A workspace whose filesystem fails is marked damaged, checked before its next use, then
repaired or set aside: workspaces/damage.py says how (an image), quotamode.py (a project-mode
directory: set aside whole, it cannot be checked on its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path

from loguru import logger

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import (
    LimitExceededError,
    SandboxSpawnError,
    SandboxUnavailableError,
)
from sandbox_runtime.workspaces.blanks import Blanks
from sandbox_runtime.workspaces.damage import DamageCourse
from sandbox_runtime.workspaces.fsops import WorkspaceFiles, remove_partial_uploads
from sandbox_runtime.workspaces.images import (
    bind,
    images_problem,
    make_image,
    mount,
    mounts_under,
    umount,
)
from sandbox_runtime.workspaces.images import loop_devices_under as loop_devices_under
from sandbox_runtime.workspaces.mountcaps import MountCaps
from sandbox_runtime.workspaces.quotamode import QuotaMode
from sandbox_runtime.workspaces.store_state import BLANK_PREFIX

CLOSE_WAIT_STEPS = 200  # times 0.05 s: for a blank being made when the store closes


class WorkspaceStore(Blanks, MountCaps, DamageCourse, QuotaMode):
    """Creates, mounts, measures and removes this replica's workspaces (its state, hooks and
    constructor: workspaces/store_state.py)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, uid: int, gid: int) -> None:
        """Prepare the root, detach mounts a dead server left, and decide on the mode
        (project, image or directory); files are made for the sandbox user uid/gid.

        Raises SandboxUnavailableError when quota="project" or "image" and that mode cannot
        be used.
        """
        self.uid, self.gid = uid, gid
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        for point in mounts_under(self.root):
            with contextlib.suppress(OSError):
                umount(point)
                logger.info("detached a workspace a previous server left mounted: {}", point)
        self.remove_all(BLANK_PREFIX)  # (a previous server's, made ahead of need)
        if self._start_project():
            return
        if self.wanted == "project":
            raise SandboxUnavailableError(
                "project-quota workspaces (SANDBOX_WORKSPACE_QUOTA=project) cannot be used: "
                f"{self.project_problem}. To enable them: {self.enable_hint}"
            )
        if self.wanted == "none":
            self.problem = "workspace quotas are turned off (SANDBOX_WORKSPACE_QUOTA=none)"
        else:
            self.problem = self._probe()
        if self.problem is None:
            self.mode = "image"
            return
        if self.wanted == "image":
            raise SandboxUnavailableError(
                f"workspace images (SANDBOX_WORKSPACE_QUOTA=image) cannot be used: {self.problem}"
            )
        if self.wanted != "none":
            logger.warning("workspaces have no quota: {}", self.problem)
        if self.project_problem is not None:
            logger.info(
                "workspaces are {} rather than directories with a project quota ({}; to enable: "
                "{})",
                "images" if self.mode == "image" else "plain directories",
                self.project_problem,
                self.enable_hint,
            )

    def _probe(self) -> str | None:
        """Why workspace images cannot be made and mounted here (None: they can)."""
        return images_problem(self.root, (self.uid, self.gid), self.disk, self._remove_sync)

    async def aclose(self) -> None:
        """Remove the blanks and unmount every workspace (the server is stopping; nothing runs
        in them now). A blank being made is removed by its fill, which this waits for."""
        self._closing = True
        for _ in range(CLOSE_WAIT_STEPS):
            if not self._filling:
                break
            await asyncio.sleep(0.05)
        if self._taker_threads is not None:  # (no take runs now: nothing runs here)
            await asyncio.to_thread(self._taker_threads.shutdown)
            self._taker_threads = None
        for name in list(self._leaving):  # (taken blanks' old paths not let go yet)
            await asyncio.to_thread(self._let_go_sync, name)
        blanks, self._blanks = self._blanks, []
        for name in blanks:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._remove_sync, name)
        for name in list(self._mounted):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(umount, self.root / name)
            self._mounted.discard(name)
            self._principals.pop(name, None)
        self._ready.clear()

    # -- use ---------------------------------------------------------------------------------

    def files(self, name: str) -> WorkspaceFiles:
        """Safe access to the contents of an ensured workspace (an I/O error of its
        filesystem marks it damaged)."""
        return WorkspaceFiles(
            self.path(name),
            self.uid,
            self.gid,
            on_damage=lambda detail: self.mark_damaged(name, detail),
            stopped=self.guard.why_stopped,
        )

    async def ensure(
        self, name: str, principal: str | None = None, *, ahead: bool = False
    ) -> tuple[Path, bool]:
        """The workspace, made and mounted if needed, and whether it existed before; marks
        it used. A mount counts against the caps of the replica and of `principal` (None: a
        warm interpreter's slot, the replica's cap only). `ahead`: made ready ahead of an
        operation, which reports (and counts) a refusal itself.

        Raises InvalidRequestError, SandboxSpawnError (it cannot be made), LimitExceededError
        (a mount cap is reached and every mounted workspace in its scope is in use),
        DiskFullError (no room on the state filesystem for a new one), WorkspaceDamagedError
        (its filesystem failed and it cannot be checked now: something still runs in it).
        """
        self._check(name)
        # (Not while its lock is held: an unmount, removal or replacement under way ends
        # first; one handed out meanwhile would be destroyed under its user.)
        if self.is_ready(name) and not self.check_damage(name):
            self._ready[name] = time.monotonic()
            self._touch(name)
            return self.path(name), True
        async with self._lock(name):
            existed = self.exists(name)
            if name in self._damaged and name in self._mounted:
                await self._release_damaged(name)
            elif name in self._damaged and name in self._quotaed:
                await self._release_damaged_dir(name)
            if name in self._ready:  # made ready by the call this one waited for
                self._ready[name] = time.monotonic()
                return self.path(name), True
            mounting = self._needs_mount(name)
            if mounting:
                await self._make_room(principal, host=True, count=not ahead)
                self._principals[name] = principal  # (counted from now: no await since)
            try:
                fresh = mounting and not existed and not name.startswith(BLANK_PREFIX)
                if not (fresh and await self._take_blank(name, principal)):
                    await asyncio.to_thread(self._ensure_sync, name)
            except (OSError, subprocess.SubprocessError) as exc:
                raise SandboxSpawnError(f"could not prepare the workspace: {exc}") from exc
            finally:
                if mounting and name not in self._mounted:
                    self._principals.pop(name, None)
        return self.path(name), existed

    def _needs_mount(self, name: str) -> bool:
        """Whether making `name` ready mounts an image (not a quota'd or plain directory)."""
        if self.mode == "project":  # (an image from before project mode is served as one)
            return self.image(name).exists()
        if self.mode != "image":
            return False
        point = self.path(name)
        with contextlib.suppress(OSError):
            if point.is_dir() and not self.image(name).exists() and any(point.iterdir()):
                return False  # a plain directory from before images
        return True

    def _ensure_sync(self, name: str) -> None:
        point, image = self.path(name), self.image(name)
        if self.mode == "project" and not image.exists():
            self._ensure_quota_dir(name)
            if name in self._quotaed:
                self._sweep_uploads(name)
                self._ready[name] = time.monotonic()
                self._touch(name)
                return
        images = self.mode == "image" or (self.mode == "project" and image.exists())
        if not images or (point.is_dir() and not image.exists() and any(point.iterdir())):
            # No images here, or a plain directory from before images (kept as it is; nothing
            # can check or repair it: a failure found in it was reported, and it is served on).
            self._damaged.pop(name, None)
            point.mkdir(mode=0o700, exist_ok=True)
            if os.geteuid() == 0:
                os.chown(point, self.uid, self.gid)
            self._sweep_uploads(name)
            self._ready[name] = time.monotonic()
            self._touch(name)
            return
        fresh = not image.exists()
        checked = None if fresh else self._check_image(name)
        fresh = fresh or checked == "quarantined"  # (set aside: replaced by a new one)
        if fresh:
            make_image(image, self.size_mb, self.inodes, (self.uid, self.gid), self.disk)
        else:
            self.disk.check_room(self.size_mb * 1024 * 1024)
            self.disk.allocate_existing(image)
        with contextlib.suppress(FileExistsError):
            point.mkdir(mode=0)
        os.chmod(point, 0)  # never writable while nothing is mounted on it
        try:
            mount(image, point, self.disk)
        except OSError as exc:
            if fresh or checked is not None:
                raise
            self.mark_damaged(name, f"it would not mount: {exc}")
            if self._check_image(name) == "quarantined":
                fresh = True
                make_image(image, self.size_mb, self.inodes, (self.uid, self.gid), self.disk)
            mount(image, point, self.disk)
        if fresh:
            with contextlib.suppress(OSError):
                os.rmdir(point / "lost+found")
        os.chmod(point, 0o700)  # the filesystem's root, owned by the sandbox user (mkfs)
        self.guard.mounted(point, image)
        self._sweep_uploads(name)
        self._mounted.add(name)
        self._ready[name] = time.monotonic()
        self._touch(name)

    def _sweep_uploads(self, name: str) -> None:
        """Remove what uploads cut off by an earlier server's death left (hidden from listings
        but using space), once per workspace and process, before anything can use it."""
        if name in self._swept:
            return
        self._swept.add(name)
        try:
            removed = remove_partial_uploads(self.path(name))
        except OSError as exc:
            logger.warning("workspace {}: partial uploads not removed: {}", name, exc)
            return
        if removed:
            logger.info(
                "workspace {}: removed {} partial uploads left by a cut-off upload", name, removed
            )

    # -- moving ------------------------------------------------------------------------------

    async def adopt(self, slot: str, name: str, principal: str | None = None) -> bool:
        """Make workspace `slot` (a warm interpreter's) into `name`, if `name` is new or
        empty and nothing uses it (no execution, interpreter, file operation, sandbox waiting
        in it); whether it did. A kernel started in `slot` keeps its bind of the filesystem.

        The check and the swap are one step for every other user of `name`: `name` is not
        ready meanwhile, so a call that would start in it waits for its lock (ensure).
        """
        self._check(slot)
        self._check(name)
        async with self._lock(name):
            if name in self._in_use() or name in self._standing_by():
                return False
            last_used = self._ready.pop(name, None)  # (from here, new users wait for the lock)
            adopted = reserved = False
            try:
                if self.mode == "image" and name not in self._principals:  # (a mount more)
                    try:
                        await self._make_room(principal, host=False, count=False)
                    except LimitExceededError:
                        return False
                    self._principals[name] = principal  # (counted from now)
                    reserved = True
                for hook in self.before_release:  # (an empty `name` is replaced)
                    await hook(name)
                if name in self._in_use() or name in self._standing_by():
                    return False  # (whatever started meanwhile waits for this lock)
                adopted = await asyncio.to_thread(self._adopt_sync, slot, name, principal)
                return adopted
            finally:
                if not adopted and last_used is not None and name not in self._ready:
                    self._ready[name] = last_used
                if not adopted and reserved and name not in self._mounted:
                    self._principals.pop(name, None)

    def _adopt_sync(
        self, slot: str, name: str, principal: str | None, leave_source: bool = False
    ) -> bool:
        """`adopt`'s swap (its lock held). `leave_source`: a mounted `slot` stays mounted
        at its old path too, for the caller to unmount later (blanks.py: an unmount waits
        for the kernel's grace period, 4 ms or more, which a new session need not wait for)."""
        target = self.path(name)
        if self.exists(name):
            if name in self._mounted or not self.image(name).exists():
                with contextlib.suppress(OSError):
                    if any(target.iterdir()):
                        return False
            else:
                return False  # an unmounted image: the session has been used
            known = self._owner(name)  # (whose it is stays recorded: budget.py)
            self._remove_sync(name)
            if known is not None:
                self.record_owner(name, Owner(principal=known[0], session_id=known[1]))
        source = self.path(slot)
        if slot not in self._mounted:  # a quota'd or plain directory
            os.rename(source, target)
            self._ready.pop(slot, None)
            if slot in self._quotaed:
                self._quotaed.discard(slot)
                self._quotaed.add(name)
            self._ready[name] = time.monotonic()
            return True
        target.mkdir(mode=0)
        try:
            bind(source, target)
        except OSError:
            target.rmdir()
            raise
        if not leave_source:
            umount(source)
        os.rename(self.image(slot), self.image(name))
        with contextlib.suppress(OSError):
            if not leave_source:
                source.rmdir()
        self._mounted.discard(slot)
        self._principals.pop(slot, None)
        self._ready.pop(slot, None)
        self._mounted.add(name)
        self._principals[name] = principal
        self._ready[name] = time.monotonic()
        self._touch(name)
        return True
