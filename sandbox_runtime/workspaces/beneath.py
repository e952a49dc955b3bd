"""Opening a name beneath a workspace's root without ever following a link or leaving it.

With the server running as root, every name in a workspace is hostile (sandboxed code may
make any component a symlink, or swap directories while the server walks them). A path is
resolved by openat2() from the root's fd with RESOLVE_BENEATH, RESOLVE_NO_SYMLINKS,
RESOLVE_NO_MAGICLINKS and RESOLVE_NO_XDEV: the kernel refuses a symlink at any component and
any step out of the root or onto another mount, within the one system call (a rename racing
the walk fails it with EAGAIN, retried, never lets it out). Without openat2 (kernels before
5.6) every component is opened with O_NOFOLLOW from the fd of the one before: the same
guarantees, a call per step. The last component is acted on through its parent's fd.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Iterator
from pathlib import Path

SYS_OPENAT2 = 437  # the same number on every architecture (asm-generic, 5.6+)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
EAGAIN_RETRIES = 8


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


@contextlib.contextmanager
def root_fd(root: Path) -> Iterator[int]:
    """An O_PATH fd of the workspace's root directory, closed on leaving."""
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def open_beneath(
    root_fd: int, parts: tuple[str, ...], flags: int, mode: int = 0, *, openat2: bool
) -> int:
    """An fd of `parts` beneath `root_fd`; a symlink at any component refused. OSError."""
    if not parts:
        return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=root_fd)
    if openat2:
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


def open_parent(
    root_fd: int,
    parts: tuple[str, ...],
    *,
    openat2: bool,
    create: bool = False,
    owner: tuple[int, int] = (-1, -1),
) -> int:
    """An O_PATH fd of the directory holding `parts[-1]` (made, owned by `owner`'s uid and
    gid, with `create`). Raises OSError."""
    parents = parts[:-1]
    try:
        return open_beneath(root_fd, parents, os.O_PATH | os.O_DIRECTORY, openat2=openat2)
    except OSError as exc:
        if not create or exc.errno != errno.ENOENT:
            raise
    fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
    try:
        for part in parents:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
                os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
            step = os.open(
                part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            os.close(fd)
            fd = step
    except BaseException:
        os.close(fd)
        raise
    return fd


def sync_dir(dir_fd: int) -> None:
    """fsync the directory `dir_fd` (an O_PATH fd cannot be synced: it is reopened). OSError."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
