"""Host-side file operations inside a workspace whose contents sandboxed code controls.

Every name in a workspace is hostile: sandboxed code may make any component of a path a
symlink (to /etc/shadow, to another session's workspace, to /proc/1/root), swap directories
while the server walks them, leave FIFOs that would block an open, or fill a directory with
100k entries. So, with the server running as root:
- a path is resolved by openat2() from the workspace root's fd with RESOLVE_BENEATH,
  RESOLVE_NO_SYMLINKS, RESOLVE_NO_MAGICLINKS and RESOLVE_NO_XDEV: the kernel refuses a
  symlink at any component and any step out of the root or onto another mount, within the
  one system call (a rename racing the walk fails it with EAGAIN, retried, never lets it out).
  We chose this over doing the work as the sandbox user inside a sandbox: it costs one system
  call instead of a process, streams without a pipe in between, and the kernel makes the
  check, not a parser of ours. Without openat2 (kernels before 5.6) every component is
  opened with O_NOFOLLOW from the fd of the one before: the same guarantees, a call per step.
- the last component is acted on through its parent's fd (unlinkat, renameat, linkat,
  fstatat without following), never by a path;
- a file is opened O_PATH first and its type checked; only a regular file is reopened for
  I/O, so a FIFO, socket or device is refused before any open that could block or act;
- writes go to a new file beside the target, owned by the sandbox user, renamed over it at
  the end (a failed upload leaves the old file); reads and writes go in chunks; listings,
  and the scan for files a call changed, are bounded.
- nothing is acknowledged before it is on disk: a written file is fsynced before it is put
  in place and its directory after (on ext4 a directory's fsync commits the journal, with
  the parents a write made); a delete fsyncs the directory. An I/O error from the workspace's
  filesystem (EIO; EROFS or EUCLEAN once the kernel aborted its journal) fails the call with
  WorkspaceDamagedError and tells the owner of the workspace (`on_damage`), never a success.
Paths are relative to /workspace or absolute inside it; `..` is refused outright.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sandbox_runtime.errors import (
    FileAccessError,
    FileMissingError,
    InvalidRequestError,
    WorkspaceDamagedError,
    WorkspaceFullError,
)

WORKSPACE = "/workspace"
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
UPLOAD_PREFIX = ".srt-upload-"
CHUNK = 1024 * 1024
SCAN_DEPTH = 64  # directory levels the changed-files scan descends, at most

SYS_OPENAT2 = 437  # the same number on every architecture (asm-generic, 5.6+)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
EAGAIN_RETRIES = 8
# The filesystem under the workspace failed: an I/O error, a journal the kernel aborted
# (EROFS), metadata that fails its checksum (EUCLEAN, ext4's EFSCORRUPTED).
DAMAGE_ERRNOS = (errno.EIO, errno.EROFS, errno.EUCLEAN)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_openat2_works: bool | None = None  # None: not tried yet


def _openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """openat2(dir_fd, path, flags, RESOLVE). Raises OSError (ENOSYS: no openat2)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE)
    raw = os.fsencode(path)
    for _ in range(EAGAIN_RETRIES):
        fd = _libc.syscall(
            ctypes.c_long(SYS_OPENAT2),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(raw),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, "the workspace kept changing during the lookup", path)


def openat2_available() -> bool:
    """Whether this kernel has openat2 (tried once)."""
    global _openat2_works
    if _openat2_works is None:
        root = os.open("/", os.O_PATH | os.O_CLOEXEC)
        try:
            os.close(_openat2(root, ".", os.O_PATH))
            _openat2_works = True
        except OSError as exc:
            _openat2_works = exc.errno != errno.ENOSYS
        finally:
            os.close(root)
    return _openat2_works


def clean_path(path: str) -> tuple[str, ...]:
    """The components of a workspace path ("" or "." or "/workspace": the root, ()).

    Raises InvalidRequestError for anything outside /workspace, `..`, NUL or over-long names.
    """
    if not isinstance(path, str) or "\x00" in path:
        raise InvalidRequestError("path must be a string without NUL")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise InvalidRequestError("path must be valid Unicode (no lone surrogates)") from None
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidRequestError(f"path is longer than {MAX_PATH_BYTES} bytes")
    if path.startswith("/"):
        if path != WORKSPACE and not path.startswith(WORKSPACE + "/"):
            raise InvalidRequestError(
                f"path {path!r} is outside the workspace: give it relative to /workspace or "
                "absolute inside it"
            )
        path = path[len(WORKSPACE) :]
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise InvalidRequestError(f"path {path!r} must not contain '..'")
    for part in parts:
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise InvalidRequestError(f"a name in path {path!r} is longer than 255 bytes")
    return parts


def display(parts: tuple[str, ...]) -> str:
    return "/".join(parts) or "."


def _is_text(name: str) -> bool:
    """Whether a name read from the filesystem is valid UTF-8 (os gives other bytes as lone
    surrogates, which JSON, URIs and the tools' paths cannot carry)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(name: str) -> str:
    """A name read from the filesystem as text to show: bytes that are not UTF-8 as U+FFFD."""
    return name if _is_text(name) else os.fsencode(name).decode("utf-8", "replace")


@dataclass(frozen=True)
class Entry:
    """One name in a workspace, as a listing shows it (never followed if a link)."""

    path: str  # relative to /workspace
    type: str  # file, directory, symlink, fifo, socket, device
    size: int
    mtime: float
    target: str | None = None  # a symlink's target, as text (never followed)

    def wire(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "type": self.type,
            "size": self.size,
            "mtime": round(self.mtime, 3),
        }
        if self.target is not None:
            out["target"] = self.target
        return out


def kind_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


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
    ) -> None:
        self.root = root
        self.uid, self.gid = uid, gid
        self.use_openat2 = openat2_available() if use_openat2 is None else use_openat2
        self.on_damage = on_damage

    # -- resolution --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _root_fd(self) -> Iterator[int]:
        fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open(self, root_fd: int, parts: tuple[str, ...], flags: int, mode: int = 0) -> int:
        """An fd of `parts` beneath `root_fd`; a symlink at any component refused. OSError."""
        if not parts:
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=root_fd)
        if self.use_openat2:
            return _openat2(root_fd, "/".join(parts), flags | os.O_NOFOLLOW, mode)
        fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
        try:
            for part in parts[:-1]:
                step = os.open(
                    part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
                os.close(fd)
                fd = step
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        finally:
            os.close(fd)

    def _parent(self, root_fd: int, parts: tuple[str, ...], create: bool = False) -> int:
        """An O_PATH fd of the directory holding `parts[-1]` (made, owned by the sandbox
        user, with `create`). Raises OSError."""
        parents = parts[:-1]
        try:
            return self._open(root_fd, parents, os.O_PATH | os.O_DIRECTORY)
        except OSError as exc:
            if not create or exc.errno != errno.ENOENT:
                raise
        fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
        try:
            for part in parents:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.chown(part, self.uid, self.gid, dir_fd=fd, follow_symlinks=False)
                step = os.open(
                    part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
                os.close(fd)
                fd = step
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _fail(
        self, exc: OSError, parts: tuple[str, ...], doing: str, synced: bool = False
    ) -> Exception:
        """The domain error for `exc` met while `doing` `parts`; `synced`: met by an fsync,
        whose every failure means the filesystem lost writes it had taken (a quota's ENOSPC
        comes from write(): ext4 reserves the blocks then; at fsync it is the disk under the
        image failing)."""
        where = display(parts)
        code = exc.errno
        if code in DAMAGE_ERRNOS or synced:
            detail = f"{doing} {where}: {os.strerror(code or 0)}"
            if synced:
                detail += ", putting it on disk"
            if self.on_damage is not None:
                self.on_damage(detail)
            return WorkspaceDamagedError(
                f"the workspace's filesystem failed ({detail}); this call did not complete. "
                "The workspace is checked (and repaired, or set aside for the operator and "
                "replaced) before its next use, which says so in `session_reset`: retry"
            )
        if code in (errno.ENOSPC, errno.EDQUOT):
            return WorkspaceFullError(
                f"the workspace is full ({doing} {where}): its quota of bytes or files is "
                "spent; delete files first"
            )
        if code == errno.ENOENT:
            return FileMissingError(f"{where}: no such file or directory")
        if code in (errno.ELOOP, errno.EXDEV, errno.EMLINK):
            return FileAccessError(
                f"{where}: the path goes through a symbolic link or leaves the workspace "
                "(file tools never follow links)"
            )
        if code == errno.ENOTDIR:
            return FileAccessError(
                f"{where}: a component of the path is not a directory (or is a symbolic link: "
                "file tools never follow links)"
            )
        if code == errno.EISDIR:
            return FileAccessError(f"{where}: is a directory")
        if code == errno.EEXIST:
            return FileAccessError(f"{where}: already exists (pass overwrite=true to replace it)")
        if code == errno.ENOTEMPTY:
            return FileAccessError(
                f"{where}: the directory is not empty (pass recursive=true to delete it all)"
            )
        if code == errno.EAGAIN:
            return FileAccessError(f"{where}: the workspace kept changing; retry")
        return FileAccessError(f"{where}: cannot {doing} it: {os.strerror(code or 0)}")

    # -- reading -----------------------------------------------------------------------------

    def stat(self, path: str) -> Entry:
        """What `path` is (a link is reported, not followed)."""
        parts = clean_path(path)
        try:
            with self._root_fd() as root:
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
            with self._root_fd() as root:
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
            with self._root_fd() as root:
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
            with self._root_fd() as root:
                fd = self._open(root, parts, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise self._fail(exc, parts, "list") from None
        truncated = self._walk(fd, parts, depth, limit, out)
        out.sort(key=lambda e: e.path)
        return out, truncated

    def _walk(
        self, fd: int, parts: tuple[str, ...], depth: int, limit: int, out: list[Entry]
    ) -> bool:
        """List the directory `fd` (consumed) into `out`; True when `limit` cut it short."""
        subdirs: list[str] = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if len(out) >= limit:
                        return True
                    if entry.name.startswith(UPLOAD_PREFIX):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone meanwhile
                    target = None
                    if stat.S_ISLNK(st.st_mode):
                        with contextlib.suppress(OSError):
                            target = _text(os.readlink(entry.name, dir_fd=fd))
                    name = _text("/".join((*parts, entry.name)))
                    out.append(Entry(name, kind_of(st.st_mode), st.st_size, st.st_mtime, target))
                    if depth > 1 and stat.S_ISDIR(st.st_mode):
                        subdirs.append(entry.name)
            for name in subdirs:
                try:
                    child = os.open(
                        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                    )
                except OSError:
                    continue  # replaced or removed meanwhile
                if self._walk(child, (*parts, name), depth - 1, limit, out):
                    return True
            return False
        finally:
            os.close(fd)

    def changed_since(self, since: float, visit: int, report: int) -> tuple[list[Entry], bool]:
        """Regular files whose status changed at or after `since` (ctime: sandboxed code
        cannot set it), at most `report`, visiting at most `visit` names and SCAN_DEPTH
        levels; and whether the scan stopped early. Names that are not UTF-8 are skipped
        (no path or link could name them)."""
        found: list[Entry] = []
        budget = [visit]
        try:
            with self._root_fd() as root:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root)
        except OSError:
            return [], False
        complete = self._scan(fd, (), since, budget, report, found)
        found.sort(key=lambda e: e.path)
        return found, not complete

    def _scan(
        self,
        fd: int,
        parts: tuple[str, ...],
        since: float,
        budget: list[int],
        report: int,
        found: list[Entry],
    ) -> bool:
        subdirs: list[str] = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    budget[0] -= 1
                    if budget[0] < 0 or len(found) > report:
                        return False
                    if not _is_text(entry.name):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        if len(parts) + 1 < SCAN_DEPTH:  # no recursion a hostile tree can exhaust
                            subdirs.append(entry.name)
                    elif (
                        stat.S_ISREG(st.st_mode)
                        and st.st_ctime >= since
                        and not entry.name.startswith(UPLOAD_PREFIX)
                    ):
                        name = "/".join((*parts, entry.name))
                        found.append(Entry(name, "file", st.st_size, st.st_mtime))
            for name in subdirs:
                try:
                    child = os.open(
                        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                    )
                except OSError:
                    continue
                if not self._scan(child, (*parts, name), since, budget, report, found):
                    return False
            return True
        finally:
            os.close(fd)

    # -- writing -----------------------------------------------------------------------------

    def open_upload(self, path: str, overwrite: bool) -> Upload:
        """A new file to fill and then put at `path` (parents made as needed)."""
        parts = clean_path(path)
        if not parts:
            raise FileAccessError(".: is a directory")
        name = parts[-1]
        try:
            with self._root_fd() as root:
                parent = self._parent(root, parts, create=True)
            try:
                existing = _lstat_at(parent, name)
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
        return Upload(self, parts, parent, temp, fd, overwrite)

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
            with self._root_fd() as root:
                parent = self._parent(root, parts)
            try:
                st = _lstat_at(parent, parts[-1])
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
                    _sync_dir(parent)
                except OSError as exc:
                    raise self._fail(exc, parts, "delete", synced=True) from None
            finally:
                os.close(parent)
        except OSError as exc:
            raise self._fail(exc, parts, "delete") from None
        return kind_of(st.st_mode)


class Upload:
    """A file being written beside its target; `commit()` puts it in place, `abort()` drops it."""

    def __init__(
        self,
        files: WorkspaceFiles,
        parts: tuple[str, ...],
        parent: int,
        temp: str,
        fd: int,
        overwrite: bool,
    ) -> None:
        self._files = files
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
            raise self._files._fail(exc, self.parts, "write") from None

    def commit(self) -> int:
        """Put the file at its path (replacing a file or link there if allowed); its size."""
        name = self.parts[-1]
        try:
            os.fsync(self._fd)  # the data, before any name points at it
        except OSError as exc:
            raise self._files._fail(exc, self.parts, "write", synced=True) from None
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
            raise self._files._fail(exc, self.parts, "write") from None
        try:
            _sync_dir(self._parent)  # the name
        except OSError as exc:
            raise self._files._fail(exc, self.parts, "write", synced=True) from None
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


def _sync_dir(dir_fd: int) -> None:
    """fsync the directory `dir_fd` (an O_PATH fd cannot be synced: it is reopened). OSError."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
            d for d in dirnames if (st := _lstat_at(dir_fd, d)) is not None and st.st_dev == device
        ]
        for name in filenames:
            if not name.startswith(UPLOAD_PREFIX):
                continue
            st = _lstat_at(dir_fd, name)
            if st is not None and stat.S_ISREG(st.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
                    removed += 1
    return removed


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
