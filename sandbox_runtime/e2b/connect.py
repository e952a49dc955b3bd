"""The Connect protocol, JSON codec: what envd's SDK clients speak.

Unary: `POST /pkg.Service/Method`, `Content-Type: application/json`, the message as the body;
the answer is the message (200) or an error `{code, message}` with the HTTP status of its
code. Server streaming (and client streaming, which StreamInput uses):
`application/connect+json`, each message in a frame of 5 bytes (flags, big-endian u32 length)
and its JSON; the last frame of a response has flag 0x02 and holds `{}` or `{"error": ...}`.
Frames are bounded (MAX_FRAME): a larger one is refused, not read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sandbox_runtime.e2b.sandboxes import E2BSandbox

MAX_FRAME = 4 * 1024 * 1024  # one message, either way
END_STREAM = 0x02
COMPRESSED = 0x01
STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

Unary = Callable[[dict[str, Any], E2BSandbox], Awaitable[dict[str, Any]]]
Streaming = Callable[[dict[str, Any], E2BSandbox, Request], AsyncIterator[dict[str, Any]]]
ClientStreaming = Callable[[AsyncIterator[dict[str, Any]], E2BSandbox], Awaitable[dict[str, Any]]]


class ConnectError(Exception):
    """An error answered as Connect's `{code, message}`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class Method:
    kind: str  # "unary", "server", "client"
    handler: Any


def error_response(code: str, message: str) -> Response:
    return JSONResponse({"code": code, "message": message}, status_code=STATUS.get(code, 500))


def frame(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_frame(error: ConnectError | None = None) -> bytes:
    return frame({"error": error.wire()} if error is not None else {}, END_STREAM)


async def read_frames(request: Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of a framed request body, each bounded by MAX_FRAME. Raises ConnectError."""
    buffer = bytearray()
    stream = request.stream()
    ended = False

    async def fill(n: int) -> bool:
        nonlocal ended
        while len(buffer) < n and not ended:
            try:
                buffer.extend(await stream.__anext__())
            except StopAsyncIteration:
                ended = True
        return len(buffer) >= n

    while True:
        if not await fill(5):
            if buffer:
                raise ConnectError("invalid_argument", "a truncated Connect frame header")
            return
        flags, length = struct.unpack(">BI", bytes(buffer[:5]))
        if length > MAX_FRAME:
            raise ConnectError(
                "resource_exhausted", f"a frame of {length} bytes is over the limit of {MAX_FRAME}"
            )
        if flags & COMPRESSED:
            raise ConnectError("unimplemented", "compressed frames are not supported")
        if not await fill(5 + length):
            raise ConnectError("invalid_argument", "a truncated Connect frame")
        data = bytes(buffer[5 : 5 + length])
        del buffer[: 5 + length]
        if flags & END_STREAM:
            return
        yield _message(data)


def _message(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data) if data.strip() else {}
    except ValueError:
        raise ConnectError("invalid_argument", "a message that is not JSON") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "a message must be a JSON object")
    return message


async def _unary_body(request: Request) -> dict[str, Any]:
    raw = bytearray()
    async for chunk in request.stream():
        raw.extend(chunk)
        if len(raw) > MAX_FRAME:
            raise ConnectError("resource_exhausted", f"a message over {MAX_FRAME} bytes")
    return _message(bytes(raw))


async def serve(request: Request, method: Method, sandbox: E2BSandbox) -> Response:
    if request.method != "POST":
        return error_response("unimplemented", "Connect methods are called with POST")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if method.kind == "unary":
        if content_type not in ("application/json", ""):
            return error_response(
                "invalid_argument", f"unsupported content type {content_type!r}: JSON only"
            )
        try:
            return JSONResponse(await method.handler(await _unary_body(request), sandbox))
        except ConnectError as exc:
            return error_response(exc.code, exc.message)
    if content_type != "application/connect+json":
        return error_response(
            "invalid_argument",
            f"a streaming method needs application/connect+json, not {content_type!r}",
        )
    if method.kind == "client":
        try:
            result = await method.handler(read_frames(request), sandbox)
            body = frame(result) + end_frame()
        except ConnectError as exc:
            body = end_frame(exc)
        return Response(body, media_type="application/connect+json")
    try:
        messages = read_frames(request)
        first = await anext(messages, None)
    except ConnectError as exc:
        return Response(end_frame(exc), media_type="application/connect+json")
    return StreamingResponse(
        _stream(method.handler(first or {}, sandbox, request)),
        media_type="application/connect+json",
    )


async def _stream(messages: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The frames of a server stream; a client that goes away cancels this (its generator is
    closed), never the execution behind it."""
    try:
        async for message in messages:
            yield frame(message)
    except ConnectError as exc:
        yield end_frame(exc)
        return
    yield end_frame()
