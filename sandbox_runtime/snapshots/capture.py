"""Taking a snapshot of a workspace: a walk of its files by the host, writing new chunks into
packs in a staging directory (runs in a thread; the workspace's code may still be running).

The walk trusts nothing in the workspace: every directory is opened relative to its parent's
descriptor with O_NOFOLLOW (a symlink swapped in is skipped, never followed), every file
with O_NOFOLLOW|O_NONBLOCK and its type checked on the descriptor (a FIFO swapped in is not
waited on); symlinks are recorded as links, and a file's further hard links as links to the
first path seen (its data is read and counted once: a restore makes the links again); FIFOs,
sockets, devices and paths longer than a manifest may hold are left out (and counted). A
file's data is read by extent (SEEK_DATA/SEEK_HOLE), so a sparse file costs what it holds,
not its apparent size; what a restore will allocate (data in filesystem blocks, a block per
directory and long symlink) is bounded by the workspace's usable size. A file that changes
while read is kept as read (a short read ends it there) and counted. A file whose inode,
ctime, mtime and size are those the previous snapshot recorded is not read again: its chunks
are reused.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_runtime.snapshots.manifest import (
    BLOCK,
    CHUNK,
    FORMAT,
    MAX_PATH_BYTES,
    MODE_BITS,
    Bounds,
    ManifestError,
    allocated,
    encode_hard_link,
    encode_path,
    encode_target,
    max_manifest_bytes,
    symlink_bytes,
)

PACK_TARGET = 16 * 1024 * 1024
ENTRY_BYTES = 160  # an entry's JSON besides its path and extents (at most)
EXTENT_BYTES = 96  # one extent's JSON
RECENT_NS = 50_000_000  # (ext4's coarsest timestamp tick is a jiffy, 1-10 ms)
SAMPLE = 4096  # bytes tried from the start and the middle (zlib: ~20 MB/s on random data)
SKIPPED_AT_ROOT = ("lost+found",)
UPLOAD_PREFIX = ".srt-upload-"  # (workspaces.paths: partial uploads are not workspace data)


class CaptureError(ManifestError):
    """The workspace cannot be snapshotted (over its bounds)."""


@dataclass
class Captured:
    manifest: dict[str, Any]
    packs: list[tuple[str, Path]]  # new packs: (id, staging file)
    files: int = 0
    directories: int = 0
    links: int = 0
    hard_links: int = 0  # paths of a file seen before (kept as links to it)
    bytes: int = 0  # data held (extents), the sum of what a restore writes
    allocated: int = 0  # what a restore allocates (blocks), bounded by the usable size
    new_bytes: int = 0  # stored for the first time (compressed)
    reused_files: int = 0
    changed_while_read: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    # A file changed this recently (ctime) is read again next time whatever its signature
    # says: a write within the same timestamp tick as this read would not change it.
    recent_ns: int = 0
    manifest_bytes: int = 0  # an upper bound of the manifest's JSON, kept as it grows
    # (device, inode) -> the first path of a file with more than one link (bounded by the
    # entries a workspace may hold)
    linked: dict[tuple[int, int], str] = field(default_factory=dict)


class Packer:
    """New chunks, appended to pack files in `staging`; chunks already stored are skipped."""

    def __init__(self, staging: Path, known: dict[str, list[Any]]) -> None:
        self.staging = staging
        self.known = known  # name -> ref, of the principal's chunks this run may reuse
        self.used: dict[str, list[Any]] = {}
        self.packs: list[tuple[str, Path]] = []
        self._fd = -1
        self._pack = ""
        self._offset = 0
        self.new_bytes = 0

    def add(self, data: bytes) -> str:
        name = hashlib.sha256(data).hexdigest()
        ref = self.used.get(name) or self.known.get(name)
        if ref is None:
            ref = self._write(data)
        self.used[name] = ref
        return name

    def reuse(self, name: str) -> bool:
        ref = self.known.get(name) or self.used.get(name)
        if ref is None:
            return False
        self.used[name] = ref
        return True

    def _write(self, data: bytes) -> list[Any]:
        stored, compressed = data, 0
        middle = len(data) // 2
        sample = data[:SAMPLE] + data[max(SAMPLE, middle) : max(SAMPLE, middle) + SAMPLE]
        if len(zlib.compress(sample, 1)) < 0.9 * len(sample):
            packed = zlib.compress(data, 1)
            if len(packed) < len(data):
                stored, compressed = packed, 1
        if self._fd < 0 or self._offset >= PACK_TARGET:
            self._open()
        offset = self._offset
        view = memoryview(stored)
        while view:
            view = view[os.write(self._fd, view) :]
        self._offset += len(stored)
        self.new_bytes += len(stored)
        return [self._pack, offset, len(stored), len(data), compressed]

    def _open(self) -> None:
        self.close()
        self._pack = secrets.token_hex(16)
        path = self.staging / self._pack
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._offset = 0
        self.packs.append((self._pack, path))

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


def capture(
    root: Path,
    staging: Path,
    bounds: Bounds,
    previous: dict[str, Any] | None,
    known: dict[str, list[Any]],
) -> Captured:
    """Walk the workspace at `root` into a manifest and new packs in `staging`. `previous`:
    the last manifest of this workspace (its unchanged files are reused); `known`: chunks of
    the principal already stored. Raises CaptureError (over the bounds), OSError."""
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    packer = Packer(staging, known)
    reusable = _reusable(previous)
    result = Captured({}, [], recent_ns=time.time_ns() - RECENT_NS)
    entries: list[dict[str, Any]] = []
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _walk(root_fd, entries, packer, reusable, bounds, result)
    finally:
        os.close(root_fd)
        packer.close()
    result.manifest = {"format": FORMAT, "entries": entries, "chunks": packer.used}
    result.packs = packer.packs
    result.new_bytes = packer.new_bytes
    return result


def _reusable(previous: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    if not previous:
        return {}
    found = {}
    for entry in previous.get("entries", ()):
        if isinstance(entry, dict) and entry.get("t") == "f" and "sig" in entry and "p" in entry:
            found[entry["p"]] = entry
    return found


def _walk(
    root_fd: int,
    entries: list[dict[str, Any]],
    packer: Packer,
    reusable: dict[str, dict[str, Any]],
    bounds: Bounds,
    result: Captured,
) -> None:
    """Depth first, a directory before what it holds, without recursion (a workspace may be
    nested deeper than Python's recursion limit): one descriptor open per level, and levels
    are bounded by MAX_PATH_BYTES (a longer path is left out: no manifest may hold it)."""
    first = _names(root_fd, bounds.max_entries)
    stack: list[tuple[int, tuple[str, ...], Iterator[str]]] = [(root_fd, (), first)]
    try:
        while stack:
            dir_fd, prefix, names = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                if prefix:  # (the root's descriptor is the caller's)
                    os.close(dir_fd)
                continue
            child = _entry(dir_fd, prefix, name, entries, packer, reusable, bounds, result)
            if child is not None:
                stack.append(child)
    finally:
        for dir_fd, prefix, _ in stack:
            if prefix:
                os.close(dir_fd)


def _names(dir_fd: int, room: int) -> Iterator[str]:
    """A directory's names, sorted; CaptureError past `room` (the entries still allowed: a
    directory of millions of hard links must not be read whole into memory first)."""
    names = []
    with os.scandir(dir_fd) as listing:
        for entry in listing:
            names.append(entry.name)
            if len(names) > room:
                raise CaptureError("the workspace holds more entries than it may keep")
    return iter(sorted(names))


def _entry(
    dir_fd: int,
    prefix: tuple[str, ...],
    name: str,
    entries: list[dict[str, Any]],
    packer: Packer,
    reusable: dict[str, dict[str, Any]],
    bounds: Bounds,
    result: Captured,
) -> tuple[int, tuple[str, ...], Iterator[str]] | None:
    """Record one entry of the directory `dir_fd`; a directory's (descriptor, path, names)
    to walk next."""
    if not prefix and (name in SKIPPED_AT_ROOT or name.startswith(UPLOAD_PREFIX)):
        return None
    if len(entries) >= bounds.max_entries:
        raise CaptureError(
            f"the workspace holds more than {bounds.max_entries} entries: too many to keep"
        )
    path = "/".join((*prefix, name))
    size = len(path.encode("utf-8", "surrogateescape"))
    if size > MAX_PATH_BYTES:
        result.skipped["long_path"] = result.skipped.get("long_path", 0) + 1
        return None
    _grow(result, size * 4 // 3 + ENTRY_BYTES, bounds)  # (base64 at worst, and the fields)
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        result.changed_while_read += 1
        return None
    base = {**encode_path(path), "m": st.st_mode & MODE_BITS, "mt": st.st_mtime_ns}
    if stat.S_ISDIR(st.st_mode):
        try:
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            result.changed_while_read += 1
            return None
        try:
            names = _names(child, bounds.max_entries - len(entries))
        except BaseException:
            os.close(child)
            raise
        entries.append({"t": "d", **base})
        result.directories += 1
        _allocate(result, BLOCK, bounds)
        return child, (*prefix, name), names
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            result.changed_while_read += 1
            return None
        if target:
            entries.append({"t": "l", **base, **encode_target(target)})
            result.links += 1
            length = len(target.encode("utf-8", "surrogateescape"))
            _grow(result, length * 4 // 3, bounds)
            _allocate(result, symlink_bytes(length), bounds)
    elif stat.S_ISREG(st.st_mode):
        entry = _file(dir_fd, name, path, base, packer, reusable, bounds, result)
        if entry is not None and entry["t"] == "h":
            entries.append(entry)
            result.hard_links += 1
            _grow(result, len(entry.get("h") or entry.get("hb") or "") * 4 // 3, bounds)
        elif entry is not None:
            entries.append(entry)
            result.files += 1
            _grow(result, EXTENT_BYTES * len(entry["x"]), bounds)
    else:
        kind = "fifo" if stat.S_ISFIFO(st.st_mode) else (
            "socket" if stat.S_ISSOCK(st.st_mode) else "device")  # fmt: skip
        result.skipped[kind] = result.skipped.get(kind, 0) + 1
    return None


def _file(
    dir_fd: int,
    name: str,
    path: str,
    base: dict[str, Any],
    packer: Packer,
    reusable: dict[str, dict[str, Any]],
    bounds: Bounds,
    result: Captured,
) -> dict[str, Any] | None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        result.changed_while_read += 1
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # (swapped since the listing)
            result.changed_while_read += 1
            return None
        if st.st_nlink < 2:
            return _data(fd, st, path, base, packer, reusable, bounds, result)
        first = result.linked.get((st.st_dev, st.st_ino))
        if first is not None:  # (its data is in the first path's entry)
            return {"t": "h", **base, **encode_hard_link(first)}
        entry = _data(fd, st, path, base, packer, reusable, bounds, result)
        result.linked[(st.st_dev, st.st_ino)] = path
        return entry
    finally:
        os.close(fd)


def _data(
    fd: int,
    st: os.stat_result,
    path: str,
    base: dict[str, Any],
    packer: Packer,
    reusable: dict[str, dict[str, Any]],
    bounds: Bounds,
    result: Captured,
) -> dict[str, Any]:
    """A regular file's entry: its extents, read (or reused from the previous snapshot)."""
    sig = [st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size]
    if st.st_ctime_ns >= result.recent_ns:
        sig = [0, 0, 0, -1]  # (too recent to trust: read again next time)
    base = {**base, "m": st.st_mode & MODE_BITS, "mt": st.st_mtime_ns}
    old = reusable.get(path)
    if old is not None and sig[3] >= 0 and old.get("sig") == sig and _reuse(old, packer):
        for x in old["x"]:
            _count(result, x[1], bounds)
        result.reused_files += 1
        return {"t": "f", **base, "s": st.st_size, "x": old["x"], "sig": sig}
    size = st.st_size
    extents: list[list[Any]] = []
    for start, end in _data_ranges(fd, size):
        offset = start
        while offset < end:
            length = min(end, (offset // CHUNK + 1) * CHUNK) - offset
            _count(result, length, bounds)
            data = _read(fd, offset, length)
            if data:
                extents.append([offset, len(data), packer.add(data)])
            if len(data) < length:  # (it shrank while read)
                result.changed_while_read += 1
                result.bytes -= length - len(data)
                size = offset + len(data)
                return {"t": "f", **base, "s": size, "x": extents}
            offset += length
    after = os.fstat(fd)
    if (after.st_mtime_ns, after.st_size) != (st.st_mtime_ns, st.st_size):
        result.changed_while_read += 1
        sig = [0, 0, 0, -1]  # (read again next time)
    return {"t": "f", **base, "s": size, "x": extents, "sig": sig}


def _grow(result: Captured, size: int, bounds: Bounds) -> None:
    result.manifest_bytes += size
    if result.manifest_bytes > max_manifest_bytes(bounds):
        raise CaptureError("the workspace's names and files are too many to keep in one manifest")


def _reuse(old: dict[str, Any], packer: Packer) -> bool:
    extents = old.get("x")
    if not isinstance(extents, list):
        return False
    return all(isinstance(x, list) and len(x) == 3 and packer.reuse(x[2]) for x in extents)


def _count(result: Captured, length: int, bounds: Bounds) -> None:
    """A piece of a file's data (an extent, or a chunk of one: a chunk ends on a block
    boundary unless its extent ends there)."""
    result.bytes += length
    _allocate(result, allocated(length), bounds)


def _allocate(result: Captured, size: int, bounds: Bounds) -> None:
    result.allocated += size
    if result.allocated > bounds.max_bytes:
        raise CaptureError(
            f"the workspace's files need more than its {bounds.max_bytes} usable bytes "
            "when restored (data in blocks, directories, hard links kept as links): too much "
            "to keep"
        )


def _data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The file's data extents within `size` (holes left out)."""
    ranges = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break
            if exc.errno == errno.EINVAL:  # (no SEEK_DATA here: all of it)
                return [(0, size)] if size else []
            raise
        if start >= size:
            break
        end = size
        with contextlib.suppress(OSError):
            end = min(size, os.lseek(fd, start, os.SEEK_HOLE))
        if end <= start:
            break
        ranges.append((start, end))
        offset = end
    return ranges


def _read(fd: int, offset: int, length: int) -> bytes:
    parts = []
    while length > 0:
        data = os.pread(fd, length, offset)
        if not data:
            break
        parts.append(data)
        offset += len(data)
        length -= len(data)
    return b"".join(parts)
