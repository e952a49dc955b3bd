"""Host-side file operations inside a workspace whose contents sandboxed code controls.

Every name in a workspace is hostile: sandboxed code may make any component of a path a
symlink (to /etc/shadow, to another session's workspace, to /proc/1/root), swap directories
while the server walks them, leave FIFOs that would block an open, or fill a directory with
100k entries. So, with the server running as root:
- a path is checked (workspaces/paths.py) and resolved beneath the workspace root's fd by openat2()
  with RESOLVE_BENEATH, NO_SYMLINKS, NO_MAGICLINKS and NO_XDEV, or component by component
  with O_NOFOLLOW where there is no openat2 (workspaces/beneath.py). We chose this over doing the
  work as the sandbox user inside a sandbox: it costs one system call instead of a process,
  streams without a pipe in between, and the kernel makes the check, not a parser of ours.
- the last component is acted on through its parent's fd (unlinkat, renameat, linkat,
  fstatat without following), never by a path;
- a file is opened O_PATH first and its type checked; only a regular file is reopened for
  I/O, so a FIFO, socket or device is refused before any open that could block or act;
- writes go to a new file beside the target, owned by the sandbox user, renamed over it at
  the end (a failed upload leaves the old file: workspaces/uploads.py); reads and writes go in
  chunks; listings, and the scan for files a call changed, are bounded (workspaces/walking.py).
- nothing is acknowledged before it is on disk: a written file is fsynced before it is put
  in place and its directory after; a delete fsyncs the directory. An I/O error from the
  workspace's filesystem fails the call with WorkspaceDamagedError and tells the owner of the
  workspace (`on_damage`), never a success (workspaces/fserrors.py).
This module is the facade, `WorkspaceFiles`; the names other modules import from here stay
importable here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from sandbox_runtime.errors import (
    DiskFullError,
    FileAccessError,
    InvalidRequestError,
    WorkspaceFullError,
)
from sandbox_runtime.workspaces.beneath import (
    lstat_at,
    open_beneath,
    open_parent,
    openat2_available,
    root_fd,
    sync_dir,
)
from sandbox_runtime.workspaces.fserrors import domain_error
from sandbox_runtime.workspaces.paths import (
    UPLOAD_PREFIX,
    Entry,
    clean_path,
    display,
    kind_of,
)
from sandbox_runtime.workspaces.uploads import Upload, remove_partial_uploads
from sandbox_runtime.workspaces.walking import scan, walk

CHUNK = 1024 * 1024

__all__ = [
    "CHUNK",
    "UPLOAD_PREFIX",
    "Entry",
    "Upload",
    "WorkspaceFiles",
    "clean_path",
    "display",
    "kind_of",
    "openat2_available",
    "remove_partial_uploads",
]


class WorkspaceFiles:
    """Safe access to one workspace directory's contents (the server's side).

    Every method is synchronous (callers run them in a worker thread) and raises
    InvalidRequestError (a bad path), FileAccessError (missing, wrong type, a link, exists),
    WorkspaceFullError (the quota) or WorkspaceDamagedError (the filesystem failed; then
    `on_damage` is called first with what failed).
    """

    def __init__(
        self,
        root: Path,
        uid: int,
        gid: int,
        *,
        use_openat2: bool | None = None,
        on_damage: Callable[[str], None] | None = None,
        stopped: Callable[[], str | None] | None = None,
    ) -> None:
        self.root = root
        self.uid, self.gid = uid, gid
        self.use_openat2 = openat2_available() if use_openat2 is None else use_openat2
        self.on_damage = on_damage
        self.stopped = stopped  # why writes are stopped on a full host (None: they are not)

    # -- resolution --------------------------------------------------------------------------

    def _open(self, root_fd: int, parts: tuple[str, ...], flags: int, mode: int = 0) -> int:
        """An fd of `parts` beneath `root_fd`; a symlink at any component refused. OSError."""
        return open_beneath(root_fd, parts, flags, mode, openat2=self.use_openat2)

    def _parent(self, root_fd: int, parts: tuple[str, ...], create: bool = False) -> int:
        """An O_PATH fd of the directory holding `parts[-1]` (made, owned by the sandbox
        user, with `create`). Raises OSError."""
        return open_parent(
            root_fd, parts, openat2=self.use_openat2, create=create, owner=(self.uid, self.gid)
        )

    def _fail(
        self, exc: OSError, parts: tuple[str, ...], doing: str, synced: bool = False
    ) -> Exception:
        """The domain error for `exc` met while `doing` `parts` (workspaces/fserrors.py); a
        failed filesystem is reported to `on_damage` first; a write refused while the state
        filesystem is full is DiskFullError, saying so."""
        error = domain_error(exc, parts, doing, synced, self.on_damage)
        why = self.stopped() if self.stopped is not None else None
        return DiskFullError(why) if isinstance(error, WorkspaceFullError) and why else error

    # -- reading -----------------------------------------------------------------------------

    def stat(self, path: str) -> Entry:
        """What `path` is (a link is reported, not followed)."""
        parts = clean_path(path)
        try:
            with root_fd(self.root) as root:
                fd = self._open(root, parts, os.O_PATH)
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            raise self._fail(exc, parts, "inspect") from None
        if stat.S_ISLNK(st.st_mode):  # (the last component: a link in between is refused)
            return self._link_entry(parts)
        return Entry(display(parts), kind_of(st.st_mode), st.st_size, st.st_mtime)

    def _link_entry(self, parts: tuple[str, ...]) -> Entry:
        """The entry of a last component that is a symlink, with its target (not followed)."""
        try:
            with root_fd(self.root) as root:
                parent = self._parent(root, parts)
                try:
                    st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
                    target = (
                        os.readlink(parts[-1], dir_fd=parent) if stat.S_ISLNK(st.st_mode) else None
                    )
                finally:
                    os.close(parent)
        except OSError as exc:
            raise self._fail(exc, parts, "inspect") from None
        if not stat.S_ISLNK(st.st_mode):  # replaced meanwhile
            raise FileAccessError(f"{display(parts)}: changed while it was inspected; retry")
        return Entry(display(parts), "symlink", st.st_size, st.st_mtime, target)

    def open_read(self, path: str) -> tuple[int, os.stat_result]:
        """A read-only fd of the regular file at `path` and its stat (the caller closes it).

        The type is checked on an O_PATH fd before the file is opened for reading: a FIFO
        or device is refused without an open that could block or act.
        """
        parts = clean_path(path)
        if not parts:
            raise FileAccessError(".: is a directory")
        try:
            with root_fd(self.root) as root:
                handle = self._open(root, parts, os.O_PATH)
            try:
                st = os.fstat(handle)
                if not stat.S_ISREG(st.st_mode):
                    raise FileAccessError(
                        f"{display(parts)}: is a {kind_of(st.st_mode)}, not a regular file"
                    )
                # Reopening an O_PATH fd through /proc gives the same inode, for reading.
                fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)
            finally:
                os.close(handle)
        except OSError as exc:
            raise self._fail(exc, parts, "read") from None
        return fd, st

    def read(self, path: str, offset: int, length: int) -> tuple[bytes, int]:
        """Up to `length` bytes of `path` from `offset`, and the file's size."""
        fd, st = self.open_read(path)
        try:
            chunks: list[bytes] = []
            got = 0
            while got < length:
                chunk = os.pread(fd, min(CHUNK, length - got), offset + got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks), st.st_size
        finally:
            os.close(fd)

    def listing(self, path: str, depth: int, limit: int) -> tuple[list[Entry], bool]:
        """Entries under `path`, `depth` levels down (1: its children), at most `limit`; and
        whether the listing was cut short. Links are listed, never entered."""
        parts = clean_path(path)
        out: list[Entry] = []
        try:
            with root_fd(self.root) as root:
                fd = self._open(root, parts, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise self._fail(exc, parts, "list") from None
        truncated = walk(fd, parts, depth, limit, out)
        out.sort(key=lambda e: e.path)
        return out, truncated

    def changed_since(self, since: float, visit: int, report: int) -> tuple[list[Entry], bool]:
        """Regular files whose status changed at or after `since` (ctime: sandboxed code
        cannot set it), at most `report`, visiting at most `visit` names and SCAN_DEPTH
        levels; and whether the scan stopped early. Names that are not UTF-8 are skipped
        (no path or link could name them)."""
        found: list[Entry] = []
        budget = [visit]
        try:
            with root_fd(self.root) as root:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root)
        except OSError:
            return [], False
        complete = scan(fd, (), since, budget, report, found)
        found.sort(key=lambda e: e.path)
        return found, not complete

    # -- writing -----------------------------------------------------------------------------

    def open_upload(self, path: str, overwrite: bool) -> Upload:
        """A new file to fill and then put at `path` (parents made as needed)."""
        parts = clean_path(path)
        if not parts:
            raise FileAccessError(".: is a directory")
        name = parts[-1]
        try:
            with root_fd(self.root) as root:
                parent = self._parent(root, parts, create=True)
            try:
                existing = lstat_at(parent, name)
                if existing is not None:
                    if stat.S_ISDIR(existing.st_mode):
                        raise FileAccessError(f"{display(parts)}: is a directory")
                    if not overwrite:
                        raise FileAccessError(
                            f"{display(parts)}: already exists (pass overwrite=true to replace it)"
                        )
                temp = UPLOAD_PREFIX + secrets.token_hex(8)
                fd = os.open(
                    temp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o644,
                    dir_fd=parent,
                )
            except BaseException:
                os.close(parent)
                raise
        except OSError as exc:
            raise self._fail(exc, parts, "write") from None
        try:
            os.fchown(fd, self.uid, self.gid)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=parent)
            os.close(parent)
            raise self._fail(exc, parts, "write") from None
        return Upload(self._fail, parts, parent, temp, fd, overwrite)

    def write(self, path: str, data: bytes, overwrite: bool) -> int:
        """Write `data` to `path` (atomically replacing it with `overwrite`); its size."""
        upload = self.open_upload(path, overwrite)
        try:
            upload.write(data)
            return upload.commit()
        finally:
            upload.abort()

    def delete(self, path: str, recursive: bool) -> str:
        """Remove `path` (a directory only if empty, or with `recursive`); what it was."""
        parts = clean_path(path)
        if not parts:
            raise InvalidRequestError("the workspace root itself cannot be deleted")
        try:
            with root_fd(self.root) as root:
                parent = self._parent(root, parts)
            try:
                st = lstat_at(parent, parts[-1])
                if st is None:
                    raise OSError(errno.ENOENT, "missing")
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(parts[-1], dir_fd=parent)
                elif recursive:
                    dir_fd = os.open(
                        ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent
                    )
                    try:
                        shutil.rmtree(parts[-1], dir_fd=dir_fd)
                    except RecursionError:  # shutil.rmtree recurses once per level
                        raise FileAccessError(
                            f"{display(parts)}: nested too deep to delete here; remove it with "
                            "execute_code (rm -rf)"
                        ) from None
                    finally:
                        os.close(dir_fd)
                else:
                    os.rmdir(parts[-1], dir_fd=parent)
                try:
                    sync_dir(parent)
                except OSError as exc:
                    raise self._fail(exc, parts, "delete", synced=True) from None
            finally:
                os.close(parent)
        except OSError as exc:
            raise self._fail(exc, parts, "delete") from None
        return kind_of(st.st_mode)

    def make_dir(self, path: str) -> bool:
        """Make directory `path` and its parents (owned by the sandbox user); false: it was
        there already."""
        parts = clean_path(path)
        if not parts:
            return False
        try:
            with root_fd(self.root) as root:
                parent = self._parent(root, parts, create=True)
            try:
                existing = lstat_at(parent, parts[-1])
                if existing is not None:
                    if not stat.S_ISDIR(existing.st_mode):
                        raise FileAccessError(f"{display(parts)}: exists and is not a directory")
                    return False
                os.mkdir(parts[-1], 0o755, dir_fd=parent)
                os.chown(parts[-1], self.uid, self.gid, dir_fd=parent, follow_symlinks=False)
                sync_dir(parent)
            finally:
                os.close(parent)
        except OSError as exc:
            raise self._fail(exc, parts, "make") from None
        return True

    def move(self, source: str, destination: str) -> Entry:
        """Rename `source` to `destination` (parents made; an existing file replaced, as
        rename(2) does); what it is now."""
        src, dst = clean_path(source), clean_path(destination)
        if not src or not dst:
            raise InvalidRequestError("the workspace root itself cannot be moved or replaced")
        if dst[: len(src)] == src:
            raise InvalidRequestError(f"{display(src)} cannot be moved into itself")
        try:
            with root_fd(self.root) as root:
                src_parent = self._parent(root, src)
                try:
                    dst_parent = self._parent(root, dst, create=True)
                except BaseException:
                    os.close(src_parent)
                    raise
            try:
                if lstat_at(src_parent, src[-1]) is None:
                    raise OSError(errno.ENOENT, "missing")
                os.rename(src[-1], dst[-1], src_dir_fd=src_parent, dst_dir_fd=dst_parent)
                sync_dir(src_parent)
                sync_dir(dst_parent)
            finally:
                os.close(src_parent)
                os.close(dst_parent)
        except OSError as exc:
            raise self._fail(exc, src, "move") from None
        return self.stat(display(dst))
