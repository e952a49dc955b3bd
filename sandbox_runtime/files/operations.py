"""The file operations of a session, as they run on its home replica (see sessions/operations)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import mimetypes
import time
from typing import Any

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import FileAccessError, InvalidRequestError, PolicyViolationError
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.files.urls import FileUrlSigner
from sandbox_runtime.workspaces.fsops import clean_path, display

DEFAULT_READ_BYTES = 512 * 1024  # a read_file without `length`: fits the client's 1 MiB event
MAX_LIST_ENTRIES = 10_000
MAX_LIST_DEPTH = 16
CHANGED_VISIT = 20_000  # names a call's changed-files scan looks at, at most
CHANGED_REPORT = 50  # files it reports, at most
# A workspace this small is scanned on the event loop (tens of microseconds): a thread's
# hand-off would cost more than the scan. Larger ones are scanned again, in a thread.
CHANGED_INLINE_VISIT = 64
ENCODINGS = ("utf-8", "base64")
METHODS = ("GET", "PUT")
CLOCK_REALTIME_COARSE = 5  # Linux's clock id (the time module does not name it)


def _str(args: dict[str, Any], key: str, default: str | None = None) -> str:
    value = args.get(key, default)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{key} must be a string")
    return value


def _int(args: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = args.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{key} must be an integer")
    if not low <= value <= high:
        raise InvalidRequestError(f"{key} must be between {low} and {high}, got {value}")
    return value


def mime_type_of(path: str) -> str:
    return mimetypes.guess_type(path, strict=False)[0] or "application/octet-stream"


async def _workspace(manager: ExecutionManager, owner: Owner) -> str:
    name = workspace_name(owner)
    await manager.workspaces.ensure(name, owner.principal)
    return name


async def write_file(
    manager: ExecutionManager, owner: Owner, args: dict[str, Any], progress: object = None
) -> dict[str, Any]:
    path = _str(args, "path")
    content = _str(args, "content")
    encoding = _str(args, "encoding", "utf-8").lower()
    overwrite = args.get("overwrite", True)
    if encoding not in ENCODINGS:
        raise InvalidRequestError("encoding must be utf-8 or base64")
    if not isinstance(overwrite, bool):
        raise InvalidRequestError("overwrite must be true or false")
    parts = clean_path(path)
    limit = manager.settings.max_inline_bytes
    if encoding == "base64":
        if len(content) > (limit + 2) // 3 * 4 + 4:
            raise PolicyViolationError(_too_big("write", limit))
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError("content is not valid base64") from None
    else:
        data = content.encode("utf-8", "surrogatepass")
    if len(data) > limit:
        raise PolicyViolationError(_too_big("write", limit))
    name = await _workspace(manager, owner)
    workspaces = manager.workspaces
    with workspaces.hold(name):
        size = await asyncio.to_thread(workspaces.files(name).write, path, data, overwrite)
    return {"path": display(parts), "size": size, "usage": workspaces.usage(name)}


def _too_big(doing: str, limit: int) -> str:
    return (
        f"files over {limit} bytes do not {doing} inline (SANDBOX_MAX_INLINE_BYTES): use "
        "create_file_url and plain HTTP, or read a part with offset and length"
    )


async def read_file(
    manager: ExecutionManager, owner: Owner, args: dict[str, Any], progress: object = None
) -> dict[str, Any]:
    path = _str(args, "path")
    encoding = args.get("encoding")
    if encoding is not None:
        encoding = _str(args, "encoding").lower()
        if encoding not in ENCODINGS:
            raise InvalidRequestError("encoding must be utf-8 or base64 (or left out: either)")
    limit = manager.settings.max_inline_bytes
    offset = _int(args, "offset", 0, 0, 2**62)
    length = _int(args, "length", min(DEFAULT_READ_BYTES, limit), 0, 2**62)
    if length > limit:
        raise PolicyViolationError(_too_big("read", limit))
    parts = clean_path(path)
    name = await _workspace(manager, owner)
    workspaces = manager.workspaces
    with workspaces.hold(name):
        data, size = await asyncio.to_thread(workspaces.files(name).read, path, offset, length)
    text: str | None = None
    if encoding != "base64":
        text, used = _decode(data, complete=offset + len(data) >= size)
        if text is None and encoding == "utf-8":
            raise FileAccessError(
                f"{display(parts)} is not UTF-8 text at offset {offset}: read it with "
                "encoding=base64"
            )
        if text is not None:
            data = data[:used]
            if len(data) <= DEFAULT_READ_BYTES:  # (a larger read is the caller's to fit)
                text, data = _within_wire(text, data, DEFAULT_READ_BYTES)
    return {
        "path": display(parts),
        "size": size,
        "offset": offset,
        "length": len(data),
        "eof": offset + len(data) >= size,
        "encoding": "utf-8" if text is not None else "base64",
        "content": text if text is not None else base64.b64encode(data).decode(),
        "mime_type": mime_type_of(parts[-1]),
    }


def _within_wire(text: str, data: bytes, most: int) -> tuple[str, bytes]:
    """`text` (the UTF-8 of `data`) cut to its start that takes at most `most` bytes as JSON
    escapes it (the 2026 era escapes all but ASCII: a control character is 6 bytes, an emoji
    12), and those bytes of `data`: a read of 512 KiB of such text was 3-6 MB on the wire, past
    the official client's 1 MiB per SSE event. The reply's `length` says where the next read
    starts, as when a character is cut at the end of a part."""
    size = len(json.dumps(text))
    if size <= most:
        return text, data
    keep = len(text) * most // size
    while keep and len(json.dumps(text[:keep])) > most:
        keep = keep * 9 // 10
    text = text[:keep]
    return text, data[: len(text.encode("utf-8"))]


def _decode(data: bytes, complete: bool) -> tuple[str | None, int]:
    """`data` as UTF-8 text and how many bytes that is: a character cut at the end of a part
    of the file is left for the next read. (None, 0): not text."""
    try:
        return data.decode("utf-8"), len(data)
    except UnicodeDecodeError as exc:
        if not complete and exc.start >= len(data) - 3 and exc.reason == "unexpected end of data":
            return data[: exc.start].decode("utf-8"), exc.start
        return None, 0


async def list_files(
    manager: ExecutionManager, owner: Owner, args: dict[str, Any], progress: object = None
) -> dict[str, Any]:
    path = _str(args, "path", ".")
    depth = _int(args, "depth", 1, 1, MAX_LIST_DEPTH)
    limit = _int(args, "limit", 1000, 1, MAX_LIST_ENTRIES)
    name = await _workspace(manager, owner)
    workspaces = manager.workspaces
    with workspaces.hold(name):
        files = workspaces.files(name)
        entries, truncated = await asyncio.to_thread(files.listing, path, depth, limit)
    return {
        "path": display(clean_path(path)),
        "entries": [e.wire() for e in entries],
        "count": len(entries),
        "truncated": truncated,
        "usage": workspaces.usage(name),
    }


async def delete_file(
    manager: ExecutionManager, owner: Owner, args: dict[str, Any], progress: object = None
) -> dict[str, Any]:
    path = _str(args, "path")
    recursive = args.get("recursive", False)
    if not isinstance(recursive, bool):
        raise InvalidRequestError("recursive must be true or false")
    name = await _workspace(manager, owner)
    workspaces = manager.workspaces
    with workspaces.hold(name):
        kind = await asyncio.to_thread(workspaces.files(name).delete, path, recursive)
    return {"path": display(clean_path(path)), "deleted": kind, "usage": workspaces.usage(name)}


async def create_file_url(
    manager: ExecutionManager, signer: FileUrlSigner, owner: Owner, args: dict[str, Any]
) -> dict[str, Any]:
    """A signed token for one method on one path (a GET's file must exist now)."""
    path = _str(args, "path")
    method = _str(args, "method", "GET").upper()
    if method not in METHODS:
        raise InvalidRequestError("method must be GET or PUT")
    maximum = manager.settings.file_url_max_seconds
    expires_in = _int(args, "expires_in_seconds", min(900, maximum), 1, maximum)
    parts = clean_path(path)
    if not parts:
        raise InvalidRequestError("a URL is for a file, not the workspace itself")
    name = await _workspace(manager, owner)
    workspaces = manager.workspaces
    with workspaces.hold(name):
        entry = (
            await asyncio.to_thread(workspaces.files(name).stat, path) if method == "GET" else None
        )
    if entry is not None and entry.type != "file":
        raise FileAccessError(f"{entry.path}: is a {entry.type}, not a regular file")
    expires_at = math.ceil(time.time()) + expires_in  # never shorter than asked
    token = signer.sign(method, owner.principal, owner.session_id, display(parts), expires_at)
    return {
        "token": token,
        "path": display(parts),
        "method": method,
        "expires_at": expires_at,
        "size": entry.size if entry is not None else None,
    }


async def changed_files(
    manager: ExecutionManager, owner: Owner, since: float
) -> list[dict[str, Any]]:
    """Regular files of the owner's workspace changed at or after `since` (on
    CLOCK_REALTIME_COARSE, the clock the kernel stamps ctime with), bounded: [{path, size}]."""
    name = workspace_name(owner)
    workspaces = manager.workspaces
    if not workspaces.exists(name):
        return []
    with workspaces.hold(name):
        files = workspaces.files(name)
        found, stopped = files.changed_since(since, CHANGED_INLINE_VISIT, CHANGED_REPORT)
        # (Stopped with more than it reports: a longer scan would stop at the same file.)
        if stopped and len(found) <= CHANGED_REPORT:
            found, _ = await asyncio.to_thread(
                files.changed_since, since, CHANGED_VISIT, CHANGED_REPORT
            )
    return [{"path": e.path, "size": e.size} for e in found[:CHANGED_REPORT]]


def coarse_now() -> float:
    """Now on the clock file timestamps come from (coarse: a tick behind the precise one)."""
    return time.clock_gettime(CLOCK_REALTIME_COARSE)
