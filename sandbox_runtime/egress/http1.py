"""HTTP/1.1 where the proxy reads the requests: heads, bodies by their framing, masking.

Used inside a TLS connection the proxy terminated (and for plain HTTP to a bound host), where
secret headers are set and responses must not echo a secret. HTTP/1.1 only (the proxy offers
no other by ALPN); keep-alive and chunked bodies both ways. Everything is bounded: a head is
at most MAX_HEAD bytes and MAX_HEADERS lines, a chunk-size line 4 KiB, a masker holds the
longest secret less one byte.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

from sandbox_runtime.egress.request import Refused

MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
CHUNK = 64 * 1024
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
HOP_BY_HOP = {b"connection", b"proxy-connection", b"keep-alive", b"proxy-authorization",
              b"proxy-authenticate", b"te", b"trailer", b"upgrade"}  # fmt: skip

Count = Callable[[int], bool]  # add n bytes; False once the sandbox's budget is spent


class Masker:
    """Streaming replacement of secrets by as many '*' (lengths, and so Content-Length, stay):
    holds back the longest pattern less one byte, so a secret split across reads is caught."""

    def __init__(self, patterns: list[bytes]) -> None:
        self.patterns = sorted(set(patterns), key=len, reverse=True)
        self.keep = max((len(p) for p in self.patterns), default=1) - 1
        self.tail = b""
        self.masked = 0

    def mask(self, data: bytes) -> bytes:
        for pattern in self.patterns:
            if pattern in data:
                self.masked += data.count(pattern)
                data = data.replace(pattern, b"*" * len(pattern))
        return data

    def feed(self, data: bytes) -> bytes:
        buffer = self.mask(self.tail + data)
        if self.keep <= 0:
            self.tail = b""
            return buffer
        cut = max(0, len(buffer) - self.keep)
        self.tail = buffer[cut:]
        return buffer[:cut]

    def flush(self) -> bytes:
        out, self.tail = self.tail, b""
        return out


@dataclass
class Head:
    """A request's or response's head: its first line and headers as sent."""

    first: bytes
    headers: list[tuple[bytes, bytes]]

    def values(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n.lower() == name]

    def remove(self, *names: bytes) -> None:
        self.headers = [(n, v) for n, v in self.headers if n.lower() not in names]

    def put(self, name: bytes, value: bytes) -> None:
        self.remove(name.lower())
        self.headers.append((name, value))

    def tokens(self, name: bytes) -> frozenset[bytes]:
        return frozenset(t.strip().lower() for v in self.values(name) for t in v.split(b","))

    def encode(self) -> bytes:
        lines = [self.first, *(n + b": " + v for n, v in self.headers)]
        return b"\r\n".join(lines) + b"\r\n\r\n"


def parse(raw: bytes) -> Head:
    """A head (up to and with the blank line), strictly. Raises Refused(400)."""
    lines = raw[:-4].split(b"\r\n")
    if len(lines) > MAX_HEADERS + 1:
        raise Refused(431, "too_many_headers")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name) or any(c < 0x20 and c != 9 for c in value):
            raise Refused(400, "bad_request")
        headers.append((name, value.strip(b" \t")))
    return Head(lines[0], headers)


async def read_head(reader: asyncio.StreamReader, idle: float) -> bytes | None:
    """The next head, or None at a clean end of the stream. Raises Refused (too large),
    TimeoutError."""
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle)
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise Refused(400, "bad_request") from None
        return None
    except (asyncio.LimitOverrunError, ValueError):
        raise Refused(431, "head_too_large") from None


def _length(text: bytes) -> bool:
    """Whether `text` is a Content-Length: digits, fewer than 19 (past any body; a
    4300-digit one would be over int()'s limit, an exception nothing expects)."""
    return text.isdigit() and len(text) < 19


def request_framing(head: Head) -> tuple[str, int]:
    """("length", n) or ("chunked", 0) of a request's body. Raises Refused."""
    codings = head.tokens(b"transfer-encoding")
    lengths = head.values(b"content-length")
    if codings:
        if codings != {b"chunked"} or lengths:
            raise Refused(400, "bad_request")
        return "chunked", 0
    if len(set(lengths)) > 1 or (lengths and not _length(lengths[0])):
        raise Refused(400, "bad_request")
    return "length", int(lengths[0]) if lengths else 0


def response_framing(method: str, status: int, head: Head) -> tuple[str, int]:
    """How a response's body ends: ("none"|"length"|"chunked"|"close", n). Raises Refused."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return "none", 0
    codings = head.tokens(b"transfer-encoding")
    if codings:
        if b"chunked" not in codings:
            return "close", 0
        return "chunked", 0
    lengths = head.values(b"content-length")
    if lengths:
        if len(set(lengths)) > 1 or not _length(lengths[0]):
            raise Refused(502, "bad_response")
        return "length", int(lengths[0])
    return "close", 0


async def _write(writer: asyncio.StreamWriter, data: bytes, count: Count) -> None:
    if not data:
        return
    if not count(len(data)):
        raise Refused(403, "byte_limit")
    writer.write(data)
    await writer.drain()


async def _line(src: asyncio.StreamReader, idle: float) -> bytes:
    """A chunk-size or trailer line. Raises Refused (longer than the reader holds), ..."""
    try:
        return await asyncio.wait_for(src.readuntil(b"\r\n"), idle)
    except asyncio.LimitOverrunError:
        raise Refused(400, "bad_chunk") from None


async def copy_body(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    framing: tuple[str, int],
    count: Count,
    idle: float,
    masker: Masker | None = None,
) -> None:
    """Copy one body as `framing` says (a chunked one is re-chunked), through `masker` if
    given. Raises Refused, TimeoutError, ConnectionError, asyncio.IncompleteReadError."""
    kind, left = framing
    mask = masker.feed if masker is not None else (lambda b: b)
    if kind == "length" or kind == "close":
        while kind == "close" or left > 0:
            size = CHUNK if kind == "close" else min(CHUNK, left)
            data = await asyncio.wait_for(src.read(size), idle)
            if not data:
                if kind == "length":
                    raise asyncio.IncompleteReadError(b"", left)
                break
            left -= len(data)
            await _write(dst, mask(data), count)
        if masker is not None:
            await _write(dst, masker.flush(), count)
        return
    if kind != "chunked":
        return
    while True:
        line = await _line(src, idle)
        if len(line) > 4096:
            raise Refused(400, "bad_chunk")
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or not all(c in b"0123456789abcdefABCDEF" for c in size_text):
            raise Refused(400, "bad_chunk")
        size = int(size_text, 16)
        if size == 0:
            while (await _line(src, idle)) != b"\r\n":
                pass  # (trailers: dropped)
            break
        while size > 0:
            data = await asyncio.wait_for(src.read(min(CHUNK, size)), idle)
            if not data:
                raise asyncio.IncompleteReadError(b"", size)
            size -= len(data)
            out = mask(data)
            if out:
                await _write(dst, b"%x\r\n" % len(out) + out + b"\r\n", count)
        if await asyncio.wait_for(src.readexactly(2), idle) != b"\r\n":
            raise Refused(400, "bad_chunk")
    rest = masker.flush() if masker is not None else b""
    if rest:
        await _write(dst, b"%x\r\n" % len(rest) + rest + b"\r\n", count)
    await _write(dst, b"0\r\n\r\n", count)
