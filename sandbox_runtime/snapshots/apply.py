"""Restoring a snapshot into an empty workspace, by the host (runs in a thread).

The manifest is validated whole first (manifest.validate): nothing is written for one that
is corrupt or over the workspace's bounds. Then every entry is made relative to its parent
directory's descriptor, a directory this restore made itself: O_CREAT|O_EXCL|O_NOFOLLOW for
files, mkdirat, symlinkat (a link is made, never followed: no entry can be reached through
one, since a parent must be a directory listed earlier). Modes are permission bits only,
owners are the sandbox user's, no device or FIFO is ever made; a hard link is made only to a
file this restore wrote (listed before it), so the workspace holds its data once, as it did.
Each chunk is read from its pack by offset, decompressed within its stated length and
checked against its SHA-256 before a byte of it is written; a file's holes stay holes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_runtime.snapshots.manifest import Bounds, Entry, ManifestError, validate

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Applied:
    files: int = 0
    directories: int = 0
    links: int = 0
    hard_links: int = 0
    bytes: int = 0


class Chunks:
    """Verified chunk bytes, read from local pack files (`pack_path(pack)`)."""

    def __init__(self, table: dict[str, list[Any]], pack_path: Callable[[str], Path]) -> None:
        self.table = table
        self.pack_path = pack_path
        self._fds: dict[str, int] = {}

    def read(self, name: str) -> bytes:
        pack, offset, stored, length, compressed = self.table[name]
        fd = self._fds.get(pack)
        if fd is None:
            try:
                fd = os.open(self.pack_path(pack), os.O_RDONLY | os.O_CLOEXEC)
            except (FileNotFoundError, KeyError):
                raise ManifestError(f"pack {pack} of the snapshot is missing") from None
            self._fds[pack] = fd
        data = os.pread(fd, stored, offset)
        if len(data) != stored:
            raise ManifestError(f"pack {pack} is shorter than its manifest says")
        if compressed:
            inflater = zlib.decompressobj()
            try:
                data = inflater.decompress(data, length + 1)
            except zlib.error:
                raise ManifestError(f"a chunk in pack {pack} does not decompress") from None
        if len(data) != length or hashlib.sha256(data).hexdigest() != name:
            raise ManifestError(f"a chunk in pack {pack} does not match its checksum")
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def packs_of(manifest: dict[str, Any], bounds: Bounds) -> set[str]:
    """The packs a (validated) manifest reads from."""
    entries, table = validate(manifest, bounds)
    used = {name for e in entries for _, _, name in e.extents}
    return {table[name][0] for name in used}


def apply(
    root: Path,
    manifest: dict[str, Any],
    bounds: Bounds,
    pack_path: Callable[[str], Path],
    owner_ids: tuple[int, int] | None,
) -> Applied:
    """Make the manifest's entries under the empty directory `root`. Raises ManifestError
    (corrupt, over bounds: before anything is written, or a chunk that fails its check
    meanwhile), OSError (the workspace's own limits, e.g. ENOSPC)."""
    entries, table = validate(manifest, bounds)
    chunks = Chunks(table, pack_path)
    done = Applied()
    root_fd = os.open(root, DIR_FLAGS)
    dirs = _Dirs(root_fd)
    directories: list[Entry] = []
    try:
        for entry in entries:
            parent = dirs.fd(entry.parts[:-1])
            name = entry.parts[-1]
            if entry.kind == "d":
                os.mkdir(name, 0o700, dir_fd=parent)
                fd = os.open(name, DIR_FLAGS, dir_fd=parent)
                _own(fd, entry.mode, owner_ids)
                dirs.add(entry.parts, fd)
                directories.append(entry)
                done.directories += 1
            elif entry.kind == "l":
                os.symlink(entry.target, name, dir_fd=parent)
                if owner_ids is not None:
                    os.chown(name, *owner_ids, dir_fd=parent, follow_symlinks=False)
                with contextlib.suppress(OSError):
                    os.utime(name, ns=(entry.mtime_ns, entry.mtime_ns), dir_fd=parent,
                             follow_symlinks=False)  # fmt: skip
                done.links += 1
            elif entry.kind == "h":
                _link(dirs, name, entry)
                done.hard_links += 1
            else:
                _write_file(parent, name, entry, chunks, owner_ids)
                done.files += 1
                done.bytes += sum(length for _, length, _ in entry.extents)
        for entry in reversed(directories):  # (their times, once nothing more is made in them)
            with contextlib.suppress(OSError):
                os.utime(dirs.fd(entry.parts), ns=(entry.mtime_ns, entry.mtime_ns))
    finally:
        chunks.close()
        dirs.close()
    return done


def _link(dirs: _Dirs, name: bytes, entry: Entry) -> None:
    """A hard link to a file this restore made (validate: listed before it): from its
    directory's descriptor, never following a symlink."""
    # (a copy: looking up the other directory may close descriptors _Dirs holds)
    source = os.dup(dirs.fd(entry.shares[:-1]))
    try:
        parent = dirs.fd(entry.parts[:-1])
        os.link(entry.shares[-1], name, src_dir_fd=source, dst_dir_fd=parent,
                follow_symlinks=False)  # fmt: skip
    finally:
        os.close(source)


def _own(fd: int, mode: int, owner_ids: tuple[int, int] | None) -> None:
    if owner_ids is not None:
        os.fchown(fd, *owner_ids)
    os.fchmod(fd, mode)


def _write_file(
    parent: int, name: bytes, entry: Entry, chunks: Chunks, owner_ids: tuple[int, int] | None
) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=parent)
    try:
        if owner_ids is not None:
            os.fchown(fd, *owner_ids)
        for offset, _, chunk in entry.extents:
            data = memoryview(chunks.read(chunk))
            while data:
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written
        os.ftruncate(fd, entry.size)
        os.fchmod(fd, entry.mode)
        os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
    finally:
        os.close(fd)


class _Dirs:
    """Descriptors of the directories this restore made (all of them: a workspace's
    directories are bounded by its inode quota, and each is one descriptor while open; past
    LIMIT the oldest are closed and opened again from the root when needed)."""

    LIMIT = 512

    def __init__(self, root_fd: int) -> None:
        self._fds: dict[tuple[bytes, ...], int] = {(): root_fd}

    def add(self, parts: tuple[bytes, ...], fd: int) -> None:
        self._fds[parts] = fd
        if len(self._fds) > self.LIMIT:
            for key in [k for k in self._fds if k][: self.LIMIT // 2]:
                os.close(self._fds.pop(key))

    def fd(self, parts: tuple[bytes, ...]) -> int:
        fd = self._fds.get(parts)
        if fd is not None:
            return fd
        # (from the nearest open ancestor, level by level: no recursion, a tree may be
        # nested deeper than Python's recursion limit)
        depth = len(parts) - 1
        while parts[:depth] not in self._fds:
            depth -= 1
        fd = self._fds[parts[:depth]]
        for level in range(depth + 1, len(parts) + 1):
            fd = os.open(parts[level - 1], DIR_FLAGS, dir_fd=fd)
            self.add(parts[:level], fd)  # (closes only older ones than this)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
