"""A snapshot's manifest: what the workspace held, and where each piece of data is stored
(pure: no I/O).

The manifest lists entries in walk order (a directory before what it holds):

    {"t": "d"|"f"|"l"|"h", "p": path (or "pb": base64 of a path that is not UTF-8), "m": mode,
     "mt": mtime_ns, "s": size, "x": [[offset, length, chunk], ...], "l": link target
     (or "lb"), "h": the path of the file a hard link shares (or "hb"),
     "sig": [ino, ctime_ns, mtime_ns, size]}

A hard link ("h") names a file ("f") listed before it: the file's data is kept once and the
link is made again as a link, so a snapshot needs on restore what the workspace used.

A file's data is listed by extent (a sparse file's holes are not stored) and cut at CHUNK
boundaries; each piece is a chunk named by the SHA-256 of its bytes, stored once per
principal in a pack (`chunks`: name -> [pack, offset, stored length, length, compressed]).
`sig` lets the next snapshot of the same workspace reuse a file's chunks without reading it.

Nothing in a manifest is trusted on restore: `validate` checks every path (no `..`, `.`,
empty or absolute components, no NUL, bounded lengths, parents listed before children and
being directories), type (directories, regular files, symlinks, and hard links to a regular
file listed earlier: no devices, FIFOs or sockets), mode (permission bits only: no setuid,
setgid or sticky), extents (inside the file, in order, each a known chunk of the stated
length) and the totals (entries, and the bytes the restore allocates, in filesystem blocks,
within the workspace's usable size).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any

from sandbox_runtime.errors import SandboxRuntimeError

FORMAT = "srt-snapshot/1"
CHUNK = 4 * 1024 * 1024
MAX_STORED_CHUNK = CHUNK + 64 * 1024  # (a compressed chunk that grew: never stored so)
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
MAX_FILE_SIZE = 1 << 44  # 16 TiB, ext4's largest file
HASH = re.compile(r"[0-9a-f]{64}")
PACK = re.compile(r"[0-9a-f]{32}")
MODE_BITS = 0o777
BLOCK = 4096  # the workspace filesystem's block (images.mkfs_argv): what each file rounds to
FAST_SYMLINK = 60  # ext4 keeps a shorter symlink target in its inode: no block


class ManifestError(SandboxRuntimeError):
    """A manifest (or the data it names) is corrupt or not acceptable."""


@dataclass(frozen=True)
class Bounds:
    """What a snapshot may hold: the workspace's usable bytes (allocated, see `allocated`)
    and entries."""

    max_bytes: int
    max_entries: int


def allocated(length: int) -> int:
    """The bytes `length` bytes of a file's data take on the workspace's filesystem."""
    return -(-length // BLOCK) * BLOCK


def symlink_bytes(target_length: int) -> int:
    return BLOCK if target_length >= FAST_SYMLINK else 0


CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def max_manifest_bytes(bounds: Bounds) -> int:
    """The largest manifest (JSON) a workspace within `bounds` may have: what a restore
    accepts, so what a capture may make."""
    return bounds.max_entries * 2048 + 1024 * 1024


def _encoded(text: str, key: str) -> dict[str, str]:
    """Text from the filesystem (surrogate-escaped str) as a manifest field: as it is when
    it is UTF-8 without control characters (JSON would spell each as 6 bytes), else the
    base64 of its bytes under `key`+"b"."""
    try:
        if not CONTROL.search(text):
            return {key: text.encode("utf-8").decode("utf-8")}
    except UnicodeEncodeError:
        pass
    raw = text.encode("utf-8", "surrogateescape")
    return {f"{key}b": base64.b64encode(raw).decode("ascii")}


def encode_path(path: str) -> dict[str, str]:
    return _encoded(path, "p")


def encode_target(target: str) -> dict[str, str]:
    return _encoded(target, "l")


def encode_hard_link(first: str) -> dict[str, str]:
    return _encoded(first, "h")


def _raw(entry: dict[str, Any], text_key: str, b64_key: str) -> bytes:
    if text_key in entry:
        value = entry[text_key]
        if not isinstance(value, str):
            raise ManifestError(f"{text_key} is not a string")
        return value.encode("utf-8", "surrogatepass")
    value = entry.get(b64_key)
    if not isinstance(value, str):
        raise ManifestError(f"an entry has no {text_key}")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise ManifestError(f"{b64_key} is not base64") from None


def path_of(entry: dict[str, Any]) -> tuple[bytes, ...]:
    """An entry's path as components (bytes), checked."""
    return _parts(_raw(entry, "p", "pb"))


def _parts(raw: bytes) -> tuple[bytes, ...]:
    if not raw or len(raw) > MAX_PATH_BYTES or b"\x00" in raw or raw.startswith(b"/"):
        raise ManifestError(f"unacceptable path {raw[:100]!r}")
    parts = tuple(raw.split(b"/"))
    for part in parts:
        if part in (b"", b".", b"..") or len(part) > MAX_NAME_BYTES:
            raise ManifestError(f"unacceptable path {raw[:100]!r}")
    return parts


def target_of(entry: dict[str, Any]) -> bytes:
    raw = _raw(entry, "l", "lb")
    if not raw or len(raw) > MAX_PATH_BYTES or b"\x00" in raw:
        raise ManifestError("unacceptable symlink target")
    return raw


def _int(entry: dict[str, Any], key: str, low: int, high: int) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ManifestError(f"entry field {key} is missing or out of range")
    return value


@dataclass(frozen=True)
class Entry:
    kind: str  # d, f, l, h
    parts: tuple[bytes, ...]
    mode: int
    mtime_ns: int
    size: int = 0
    extents: tuple[tuple[int, int, str], ...] = ()
    target: bytes = b""
    shares: tuple[bytes, ...] = ()  # a hard link's file (listed before it)


def validate(manifest: Any, bounds: Bounds) -> tuple[list[Entry], dict[str, list[Any]]]:
    """The manifest's entries and chunk table, every field checked (ManifestError)."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError("not a snapshot manifest of this format")
    raw_entries, chunks = manifest.get("entries"), manifest.get("chunks")
    if not isinstance(raw_entries, list) or not isinstance(chunks, dict):
        raise ManifestError("a manifest without entries or chunks")
    if len(raw_entries) > bounds.max_entries:
        raise ManifestError(
            f"the snapshot holds {len(raw_entries)} entries, more than the workspace allows "
            f"({bounds.max_entries})"
        )
    for name, ref in chunks.items():
        if not (isinstance(name, str) and HASH.fullmatch(name) and _ref_ok(ref)):
            raise ManifestError("a malformed chunk reference")
    seen: set[tuple[bytes, ...]] = set()
    directories: set[tuple[bytes, ...]] = {()}
    files: set[tuple[bytes, ...]] = set()
    total = 0
    entries: list[Entry] = []
    for raw in raw_entries:
        if not isinstance(raw, dict):
            raise ManifestError("a malformed entry")
        kind = raw.get("t")
        parts = path_of(raw)
        if parts in seen:
            raise ManifestError(f"a path listed twice: {b'/'.join(parts)[:100]!r}")
        if parts[:-1] not in directories:
            raise ManifestError(f"{b'/'.join(parts)[:100]!r} is listed before its directory")
        seen.add(parts)
        mode = _int(raw, "m", 0, 0o7777) & MODE_BITS
        mtime = _int(raw, "mt", -(1 << 63), (1 << 63) - 1)  # (any time ext4 holds)
        if kind == "d":
            directories.add(parts)
            total += BLOCK
            entries.append(Entry("d", parts, mode, mtime))
        elif kind == "l":
            target = target_of(raw)
            total += symlink_bytes(len(target))
            entries.append(Entry("l", parts, mode, mtime, target=target))
        elif kind == "f":
            size = _int(raw, "s", 0, MAX_FILE_SIZE)
            extents = _extents(raw.get("x"), size, chunks)
            total += sum(allocated(length) for _, length, _ in extents)
            files.add(parts)
            entries.append(Entry("f", parts, mode, mtime, size, extents))
        elif kind == "h":
            shares = _hard_link(raw)
            if shares not in files:
                raise ManifestError("a hard link to a file not listed before it")
            entries.append(Entry("h", parts, mode, mtime, shares=shares))
        else:
            raise ManifestError(f"an entry of type {str(kind)[:10]!r} (only d, f, l, h are kept)")
        if total > bounds.max_bytes:
            raise ManifestError(
                f"the snapshot needs more than the workspace's {bounds.max_bytes} usable bytes"
            )
    return entries, chunks


def _hard_link(entry: dict[str, Any]) -> tuple[bytes, ...]:
    if "h" not in entry and "hb" not in entry:
        raise ManifestError("a malformed hard link entry (no file named)")
    return _parts(_raw(entry, "h", "hb"))


def _ref_ok(ref: Any) -> bool:
    if not isinstance(ref, list) or len(ref) != 5:
        return False
    pack, offset, stored, length, compressed = ref
    return (
        isinstance(pack, str)
        and PACK.fullmatch(pack) is not None
        and all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, stored, length))
        and 0 <= offset < 1 << 40
        and 0 < stored <= MAX_STORED_CHUNK
        and 0 < length <= CHUNK
        and compressed in (0, 1)
    )


def _extents(raw: Any, size: int, chunks: dict[str, list[Any]]) -> tuple[tuple[int, int, str], ...]:
    if not isinstance(raw, list):
        raise ManifestError("a file without extents")
    end = 0
    extents = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3):
            raise ManifestError("a malformed extent")
        offset, length, name = item
        if not (isinstance(offset, int) and isinstance(length, int) and isinstance(name, str)):
            raise ManifestError("a malformed extent")
        ref = chunks.get(name)
        if ref is None or ref[3] != length:
            raise ManifestError("an extent names an unknown chunk, or one of another length")
        if offset < end or length <= 0 or offset + length > size:
            raise ManifestError("extents out of order or outside the file")
        end = offset + length
        extents.append((offset, length, name))
    return tuple(extents)
