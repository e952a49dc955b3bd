"""Writing a file into a workspace: an `Upload` fills a new file beside its target and puts it
in place at the end, and what an upload cut off by the server's death left is removed.

The new file is owned by the sandbox user and hidden from listings (UPLOAD_PREFIX); a failed
or abandoned upload leaves the old file as it was. Nothing is acknowledged before it is on
disk: the file is fsynced before any name points at it and its directory after (on ext4 a
directory's fsync commits the journal, with the parents a write made).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from sandbox_runtime.workspaces.beneath import lstat_at, sync_dir
from sandbox_runtime.workspaces.fserrors import Fail
from sandbox_runtime.workspaces.paths import UPLOAD_PREFIX


class Upload:
    """A file being written beside its target; `commit()` puts it in place, `abort()` drops it."""

    def __init__(
        self,
        fail: Fail,
        parts: tuple[str, ...],
        parent: int,
        temp: str,
        fd: int,
        overwrite: bool,
    ) -> None:
        self._fail = fail  # the workspace's OSError -> domain error
        self.parts = parts
        self._parent = parent
        self._temp = temp
        self._fd = fd
        self._overwrite = overwrite
        self.size = 0
        self._done = False

    def write(self, data: bytes) -> None:
        """Append `data`. Raises WorkspaceFullError at the quota, FileAccessError otherwise."""
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
                self.size += written
        except OSError as exc:
            raise self._fail(exc, self.parts, "write") from None

    def commit(self) -> int:
        """Put the file at its path (replacing a file or link there if allowed); its size."""
        name = self.parts[-1]
        try:
            os.fsync(self._fd)  # the data, before any name points at it
        except OSError as exc:
            raise self._fail(exc, self.parts, "write", synced=True) from None
        try:
            os.close(self._fd)
            self._fd = -1
            if self._overwrite:
                os.rename(self._temp, name, src_dir_fd=self._parent, dst_dir_fd=self._parent)
            else:  # link(2) refuses an existing name: no replacing a file made meanwhile
                os.link(
                    self._temp,
                    name,
                    src_dir_fd=self._parent,
                    dst_dir_fd=self._parent,
                    follow_symlinks=False,
                )
                os.unlink(self._temp, dir_fd=self._parent)
            self._done = True  # (in place: an abort must not remove it)
        except OSError as exc:
            raise self._fail(exc, self.parts, "write") from None
        try:
            sync_dir(self._parent)  # the name
        except OSError as exc:
            raise self._fail(exc, self.parts, "write", synced=True) from None
        self._done = True
        self.abort()
        return self.size

    def abort(self) -> None:
        """Drop the file if it was not committed, and release everything. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._parent >= 0:
            if not self._done:
                with contextlib.suppress(OSError):
                    os.unlink(self._temp, dir_fd=self._parent)
            os.close(self._parent)
            self._parent = -1


def remove_partial_uploads(root: Path, max_dirs: int = 100_000) -> int:
    """Remove the partial upload files (UPLOAD_PREFIX) an upload cut off by the server's death
    left anywhere under the workspace `root`; returns how many went. For a workspace nothing
    runs in yet (just mounted): the walk follows no symlink and stays on its filesystem, and
    only regular files are unlinked, through their directory's fd. Raises OSError (root)."""
    removed = 0
    device = os.stat(root, follow_symlinks=False).st_dev
    for _dirpath, dirnames, filenames, dir_fd in os.fwalk(root, follow_symlinks=False):
        max_dirs -= 1
        if max_dirs < 0:
            break  # (bounded: a workspace of a hundred thousand directories is left as it is)
        dirnames[:] = [
            d for d in dirnames if (st := lstat_at(dir_fd, d)) is not None and st.st_dev == device
        ]
        for name in filenames:
            if not name.startswith(UPLOAD_PREFIX):
                continue
            st = lstat_at(dir_fd, name)
            if st is not None and stat.S_ISREG(st.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
                    removed += 1
    return removed
