"""A damaged workspace's course: marked when its filesystem fails, checked before its next
use, then repaired or set aside.

A workspace whose filesystem fails (an I/O error, EROFS once the kernel aborted its journal,
found by a file operation or by the mount turning read-only) is marked damaged (in memory and
a `<name>.damaged` file beside the image): the call that found it fails, and its next use
unmounts it, once nothing runs in it (an interpreter idle in it is stopped first: it would
otherwise hold the workspace until its idle timeout, failing every call meanwhile), and
checks it (e2fsck -p), as does any mount of an image whose superblock records an error. A
mount gone from under the server (unmounted by another process) is treated the same way.
Repaired, it is mounted again and the session is told (`workspace_repaired`: files may be
missing); beyond automatic repair, the image is moved to `.quarantine/` for the operator and
the session starts afresh (`workspace_quarantined`).
The checking itself is workspaces/repair.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from loguru import logger

from sandbox_runtime.errors import WorkspaceDamagedError
from sandbox_runtime.workspaces.images import umount
from sandbox_runtime.workspaces.repair import check_image, has_recorded_error, loop_attached
from sandbox_runtime.workspaces.store_state import StoreState

DETACH_WAIT_STEPS = 40  # times 0.05 s: for the loop device of an unmounted image to go
CHECK_ROOM = 16 * 1024 * 1024  # free space e2fsck is given to repair an image in


class DamageCourse(StoreState):
    """Marking, releasing, checking and repairing a store's damaged workspaces."""

    def mark_damaged(self, name: str, detail: str) -> None:
        """Record that the workspace's filesystem failed: its next use checks it (e2fsck)
        before serving it again. Safe from a worker thread."""
        if name in self._damaged:
            return
        self._damaged[name] = detail
        logger.error("workspace {} is damaged ({}): checked before its next use", name, detail)
        with contextlib.suppress(OSError):  # (the host may be full: the mark in memory holds)
            os.close(os.open(self._marker(name), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        for hook in self.on_damage:
            hook("detected")

    def _root_fsid(self) -> int:
        if self._fsid is None:
            self._fsid = os.statvfs(self.root).f_fsid
        return self._fsid

    def damaged(self) -> dict[str, str]:
        """Workspaces marked damaged and not yet checked: name -> what failed."""
        return dict(self._damaged)

    def take_reset(self, name: str) -> str | None:
        """A session_reset reason owed for the workspace (repaired, quarantined), once."""
        return self._resets.pop(name, None)

    def check_damage(self, name: str) -> bool:
        """Whether a ready workspace must be checked before use: marked damaged, its mount
        turned read-only (the kernel's answer to an error: errors=remount-ro), or its mount
        gone (the image is checked and mounted again)."""
        if name in self._damaged:
            return True
        if name in self._mounted:
            try:
                st = os.statvfs(self.path(name))
            except OSError as exc:
                failed, detail = True, f"statfs failed: {exc}"
            else:
                failed = bool(st.f_flag & os.ST_RDONLY)
                detail = "the kernel made its filesystem read-only after an error"
                if st.f_fsid == self._root_fsid():  # (one statfs; the root's is kept)
                    # Unmounted behind this server's back (another process on the state
                    # directory): never served as the bare mount point (mode 0, empty).
                    failed, detail = True, "its mount went away under the server"
            if failed:
                self.mark_damaged(name, detail)
                return True
        return False

    async def _release_damaged(self, name: str) -> None:
        """Unmount a damaged workspace so that it can be checked (the caller holds its lock).

        Raises WorkspaceDamagedError while something still runs in it.
        """
        for release in self.release_idle:  # (an idle interpreter would hold it for good)
            await release(name)
        busy = name in self._in_use()
        if not busy:
            self._ready.pop(name, None)  # (from here, new users wait for the lock)
            for hook in self.before_release:
                await hook(name)
            busy = name in self._in_use()
        if not busy:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(umount, self.path(name))
            self._mounted.discard(name)
            self._principals.pop(name, None)
            with contextlib.suppress(OSError):
                os.chmod(self.path(name), 0)
            for _ in range(DETACH_WAIT_STEPS):  # (the kernel lets a loop device go async)
                if not loop_attached(self.image(name)):
                    break
                await asyncio.sleep(0.05)
            busy = loop_attached(self.image(name))  # a sandbox still holds a bind of it
        if busy:
            raise WorkspaceDamagedError(
                f"the workspace's filesystem failed ({self._damaged.get(name)}) and something "
                "still runs in it (an execution, an interpreter): it is checked and repaired "
                "once that ends (cancel_execution; an idle interpreter is stopped after its "
                "idle timeout). Files written since the failure were not kept"
            )

    def _check_image(self, name: str) -> str | None:
        """Before mounting an existing image: check it if it is marked damaged or records an
        error, and repair it (e2fsck -p) or set it aside (.quarantine/, a fresh image is then
        to be made). How the check ended (None: not needed). Raises OSError,
        SubprocessError."""
        image, marker = self.image(name), self._marker(name)
        why = self._damaged.get(name)
        if why is None and marker.exists():
            why = "marked damaged by an earlier run"
        if why is None and has_recorded_error(image):
            why = "its filesystem records an error"
        if why is None:
            return None
        if self.disk.status().free_bytes < CHECK_ROOM:  # (e2fsck writes into the image)
            self.mark_damaged(name, why)
            raise WorkspaceDamagedError(
                f"the workspace's filesystem failed ({why}) and the state filesystem is too "
                "full to check and repair it: it is checked once there is room again; retry"
            )
        outcome = check_image(image, name)
        if outcome.result == "quarantined":
            self._resets[name] = "workspace_quarantined"
            logger.error(
                "workspace {} ({}) could not be repaired (e2fsck -p exit {}: {}): its image is "
                "kept at {} for the operator and the session starts afresh",
                name,
                why,
                outcome.exit_code,
                outcome.output,
                outcome.kept,
            )
        elif outcome.result == "repaired":
            self._resets[name] = "workspace_repaired"
            logger.warning(
                "workspace {} ({}) repaired by e2fsck in {:.2f} s (exit {}): {}",
                name,
                why,
                outcome.seconds,
                outcome.exit_code,
                outcome.output,
            )
        else:
            logger.info("workspace {} ({}) checked clean in {:.2f} s", name, why, outcome.seconds)
        self._damaged.pop(name, None)
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
        for hook in self.on_damage:
            hook(outcome.result)
        return outcome.result
