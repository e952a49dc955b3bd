"""One proxy request's head: parsed strictly, plain HTTP rewritten, a refusal answered.

Pure but for `answer` (which writes the refusal): what a hostile program sends is read here,
so the grammar is narrow. `parse_head` takes the head (up to the blank line) and returns a
`Request` or raises `Refused` with the status and the machine-readable reason. A CONNECT names
an authority; a plain HTTP request an absolute `http://` URL, and goes out as one request with
`Host` rewritten from the checked authority, hop-by-hop headers (and those the client's
`Connection` names) dropped, and `Connection: close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass

from sandbox_runtime.domain.hosts import EgressDenied, parse_authority

MAX_HEAD = 16 * 1024
MAX_HEADERS = 100
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_METHOD = re.compile(rb"[A-Z]{1,20}")
_TARGET = re.compile(rb"[\x21-\x7e]{1,8192}")
_FRAMING = {b"content-length", b"transfer-encoding", b"host"}
_HOP_BY_HOP = {
    b"connection",
    b"proxy-connection",
    b"keep-alive",
    b"proxy-authorization",
    b"proxy-authenticate",
    b"te",
    b"trailer",
    b"upgrade",
    b"host",
}


class Refused(Exception):
    """A request the proxy answers with an error status and a reason."""

    def __init__(self, status: int, reason: str, host: str = "", port: int = 0) -> None:
        super().__init__(reason)
        self.status, self.reason, self.host, self.port = status, reason, host, port


@dataclass
class Request:
    method: str
    host: str
    port: int
    connect: bool
    head: bytes = b""  # plain HTTP: the head to send on, rewritten
    body_length: int = 0


def parse_head(head: bytes) -> Request:
    """Parse a proxy request's head strictly. Raises Refused."""
    lines = head[:-4].split(b"\r\n")
    if len(lines) > MAX_HEADERS + 1:
        raise Refused(431, "too_many_headers")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _METHOD.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise Refused(400, "bad_request")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise Refused(400, "bad_request")
    headers: list[tuple[bytes, bytes, bytes]] = []  # (lower-case name, name, value)
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name) or any(c < 0x20 and c != 9 for c in value):
            raise Refused(400, "bad_request")  # (obs-fold, bare CR or LF, controls)
        headers.append((name.lower(), name, value.strip(b" \t")))
    if method == b"CONNECT":
        host, port = _authority(target, None)
        return Request("CONNECT", host, port, connect=True)
    if not target[:7].lower() == b"http://":
        if target[:8].lower() == b"https://":
            raise Refused(400, "https_needs_connect")
        raise Refused(400, "not_a_proxy_request")
    rest = target[7:]
    cut = min((i for i in (rest.find(b"/"), rest.find(b"?"), rest.find(b"#")) if i >= 0),
              default=len(rest))  # fmt: skip
    authority, path = rest[:cut], rest[cut:]
    if path.startswith(b"?"):
        path = b"/" + path
    path = path.split(b"#", 1)[0] or b"/"
    host, port = _authority(authority, 80)
    lengths = [v for n, _, v in headers if n == b"content-length"]
    if any(n == b"transfer-encoding" for n, _, _ in headers):
        raise Refused(411, "chunked_body")  # plain HTTP bodies need a Content-Length
    if len(set(lengths)) > 1 or (lengths and not (lengths[0].isdigit() and len(lengths[0]) < 19)):
        raise Refused(400, "bad_request")  # (19+ digits: past any body, and int()'s limit)
    body = int(lengths[0]) if lengths else 0
    request = Request(method.decode(), host, port, connect=False, body_length=body)
    return _rewrite(request, method, path, headers)


def _authority(raw: bytes, default_port: int | None) -> tuple[str, int]:
    """(host, port) of an authority, syntax only (the policy makes the host canonical)."""
    try:
        return parse_authority(raw.decode("ascii"), default_port)
    except UnicodeDecodeError:
        raise Refused(400, "bad_host", raw.decode("ascii", "replace")) from None
    except EgressDenied as exc:
        raise Refused(400, exc.reason, raw.decode("ascii", "replace")) from None


def _host_header(host: str, port: int) -> bytes:
    shown = f"[{host}]" if ":" in host else host
    return (shown if port == 80 else f"{shown}:{port}").encode()


def _rewrite(
    request: Request, method: bytes, path: bytes, headers: list[tuple[bytes, bytes, bytes]]
) -> Request:
    out = [
        method + b" " + path + b" HTTP/1.1",
        b"Host: " + _host_header(request.host, request.port),
    ]
    dropped = set(_HOP_BY_HOP)
    for name, _, value in headers:  # headers the client's Connection header names are hop-by-hop
        if name == b"connection":
            named = {v.strip().lower() for v in value.split(b",")}
            if named & _FRAMING:  # dropping one would change where the request ends
                raise Refused(400, "bad_request", request.host, request.port)
            dropped |= named
    out += [shown + b": " + value for name, shown, value in headers if name not in dropped]
    out.append(b"Connection: close")
    request.head = b"\r\n".join(out) + b"\r\n\r\n"
    return request


def refusal(status: int, text: str, host: str = "", port: int = 0) -> bytes:
    """The whole reply refusing a request: `status`, `text` (with the authority, if any) as
    the body, and the reason (the text without "egress denied: ") in X-Egress-Denied."""
    phrase = {400: "Bad Request", 403: "Forbidden", 411: "Length Required",
              431: "Request Header Fields Too Large", 502: "Bad Gateway",
              503: "Service Unavailable"}.get(status, "Error")  # fmt: skip
    where = f" ({host}:{port})" if host else ""
    body = f"{text}{where}\n".encode("ascii", "replace")
    reason = text.removeprefix("egress denied: ")
    return (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nX-Egress-Denied: {reason}\r\n"
        "Connection: close\r\n\r\n".encode("ascii", "replace")
        + body
    )


async def answer(
    writer: asyncio.StreamWriter, status: int, text: str, host: str = "", port: int = 0
) -> None:
    """Write the `refusal` and wait (at most 5 s) for it to go."""
    writer.write(refusal(status, text, host, port))
    with contextlib.suppress(ConnectionError, OSError):
        await asyncio.wait_for(writer.drain(), 5)
