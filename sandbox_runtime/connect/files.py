"""Replacing a client's config file safely: under a lock, atomically, with a backup.

A client's file is also written by the client itself and by hand, so a change is read, made
and written while holding an exclusive lock on the file's directory (two `connect` runs do not
interleave), goes to a temporary file in the same directory that replaces the old one in one
rename (a crash leaves the old file or the new one, never half of either), and the previous
content is kept beside it as `NAME.srt-backup`. A symlinked file (dotfiles kept in a repository)
is replaced at its target, so the link stays.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

BACKUP_SUFFIX = ".srt-backup"
MAX_BYTES = 64 << 20  # a client's config is kilobytes; ~/.claude.json can reach megabytes


class FileError(Exception):
    """A config file that cannot be read or written: says which and why."""


def read_text(path: Path) -> str | None:
    """The file's text, None when it does not exist. Only a regular file of at most MAX_BYTES
    is read: a config path that is (or links to) a FIFO would block for ever, /dev/zero never
    end, and a device would be replaced by the edit."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FileError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileError(f"{path}: cannot read it: not a regular file (a directory, a device?)")
        if info.st_size > MAX_BYTES:
            raise FileError(f"{path}: larger than {MAX_BYTES >> 20} MiB: not a config file")
        chunks = []
        size = 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BYTES:  # (it grew while read)
                raise FileError(f"{path}: larger than {MAX_BYTES >> 20} MiB: not a config file")
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise FileError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise FileError(f"{path}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[Path]:
    """Holds an exclusive lock on `path`'s directory (made when missing); yields the real path
    to write (a symlink's target)."""
    real = path.resolve() if path.is_symlink() else path
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(real.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise FileError(f"{real.parent}: cannot use the directory ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield real
    finally:
        os.close(fd)  # releases the lock


def replace(path: Path, text: str, *, private: bool) -> Path | None:
    """Writes `text` to `path` atomically (the caller holds `locked`); returns the backup of
    the previous content (None when there was no file). `private`: mode 0600 (a token is in
    it); otherwise the old file's mode, or 0644 less the umask for a new one."""
    old = read_text(path)
    owner = None
    try:
        info = path.stat() if old is not None else None
    except OSError:
        info = None
    mode = stat.S_IMODE(info.st_mode) if info else None
    if info and os.geteuid() == 0:  # (root, e.g. sudo, editing a user's file: it stays theirs)
        owner = (info.st_uid, info.st_gid)
    if private:
        mode = 0o600
    elif mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o644 & ~umask
    backup = None
    try:
        if old is not None:
            backup = path.with_name(path.name + BACKUP_SUFFIX)
            _write(backup, old, 0o600, owner)
        _write(path, text, mode, owner)
    except OSError as exc:
        raise FileError(f"{path}: cannot write it ({exc.strerror})") from None
    return backup


def _write(path: Path, text: str, mode: int, owner: tuple[int, int] | None = None) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if owner is not None:
                os.fchown(f.fileno(), *owner)  # (still 0600: no one else reads it meanwhile)
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
