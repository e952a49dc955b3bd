"""Secrets into requests to bound hosts: TLS terminated and re-made, headers set, echoes masked.

A CONNECT to a host a secret rule binds is answered, then the proxy is the TLS server (a leaf
of the deployment's CA, ca.py) and, to the vetted address it dialled, a TLS client that
verifies the real host's certificate (a wrong one: the connection fails closed, and the
sandbox's events say `upstream_certificate`). In between, HTTP/1.1 requests one after another
(http1.py): `Host` is the CONNECT's authority, whatever the code wrote; a rule that applies
sets its headers (replacing the code's placeholder); the response has every secret masked.
A plain HTTP request to a bound host goes the same way, once. The proxy never follows a
redirect: the client does, to another host, through another CONNECT, which has no rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sandbox_runtime.domain.egress import parse_rules
from sandbox_runtime.domain.secrets import SecretRule
from sandbox_runtime.egress import http1
from sandbox_runtime.egress.request import Refused, refusal

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
HANDSHAKE_SECONDS = 10.0
METHOD_OVERRIDES = (b"x-http-method-override", b"x-http-method", b"x-method-override")
_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}")  # (a token)
_TARGET = re.compile(rb"/[\x21-\x7e]*")


@dataclass
class Binding:
    """One rule as the proxy holds it for a sandbox: its headers rendered, what to mask."""

    rule: SecretRule
    headers: list[tuple[bytes, bytes]]
    masks: list[bytes] = field(default_factory=list)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Binding:
        """From the server's rendering (egress/secrets.py `bindings`)."""
        rule = SecretRule(
            name=str(spec["rule"]),
            secret=str(spec["secret"]),
            hosts=tuple(parse_rules(",".join(spec["hosts"]))),
            headers=(),
            methods=frozenset(spec.get("methods") or ()),
            paths=tuple(spec.get("paths") or ()),
        )
        headers = [(str(n).encode(), str(v).encode()) for n, v in spec["headers"]]
        masks = [str(m).encode() for m in spec.get("masks") or ()]
        return cls(rule, headers, masks)


@dataclass
class Exchange:
    """What one sandbox's terminated connection needs from the proxy."""

    host: str
    port: int
    bindings: list[Binding]
    count: http1.Count
    idle: float
    deny: Callable[[str, str], None]  # (method, reason)
    used: Callable[[Binding, str, str], None]  # (binding, method, path)
    # A new connection to the vetted address (after the origin closed a kept-alive one).
    redial: Callable[[], Awaitable[Streams]] | None = None

    def masker(self) -> http1.Masker:
        return http1.Masker([m for b in self.bindings for m in b.masks])


def bound(bindings: list[Binding], host: str, port: int, tls: bool) -> list[Binding]:
    """The bindings that may send their secret to `host`:`port` (over TLS or in clear)."""
    return [b for b in bindings if b.rule.binds(host, port, tls)]


async def terminate(
    exchange: Exchange,
    client: Streams,
    origin: Streams,
    server_context: ssl.SSLContext,
    upstream_context: ssl.SSLContext,
) -> None:
    """Serve one CONNECT to a bound host (the 200 already written). Returns when either side
    is done. An origin that closed between two requests is dialled again (`exchange.redial`)."""
    reader, writer = client
    try:
        await writer.start_tls(server_context, ssl_handshake_timeout=HANDSHAKE_SECONDS)
    except (OSError, TimeoutError, ssl.SSLError):
        exchange.deny("CONNECT", "client_tls_failed")  # (the sandbox does not trust our CA?)
        return
    if not await _upstream_tls(exchange, origin, upstream_context, writer):
        return
    try:
        while True:
            try:
                raw = await http1.read_head(reader, exchange.idle)
            except (Refused, TimeoutError, ConnectionError, ssl.SSLError):
                return
            if raw is None:
                return
            method = ""
            try:
                head = http1.parse(raw)
                method, target = _request_line(head)
                if origin[0].at_eof() and exchange.redial is not None:
                    origin = await exchange.redial()
                    if not await _upstream_tls(exchange, origin, upstream_context, writer):
                        return
                if not await _one(exchange, head, method, target, client, origin):
                    return
            except Refused as refused:
                exchange.deny(method, refused.reason)
                await _refuse(writer, refused.status, f"egress denied: {refused.reason}", exchange)
                return
            except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                return
    finally:
        origin[1].close()  # (a redialled one too; the first is also closed by its dialler)


async def _upstream_tls(
    exchange: Exchange, origin: Streams, context: ssl.SSLContext, client: asyncio.StreamWriter
) -> bool:
    """TLS to the real host, its certificate verified; False (answered) if it fails."""
    try:
        await origin[1].start_tls(
            context, server_hostname=exchange.host, ssl_handshake_timeout=HANDSHAKE_SECONDS
        )
        return True
    except ssl.SSLCertVerificationError as exc:
        exchange.deny("CONNECT", "upstream_certificate")
        detail = f"egress denied: upstream_certificate: {exc.verify_message}"
        await _refuse(client, 502, detail, exchange)
    except (OSError, TimeoutError, ssl.SSLError):
        exchange.deny("CONNECT", "upstream_tls_failed")
        await _refuse(client, 502, "egress denied: upstream_tls_failed", exchange)
    return False


async def plain(exchange: Exchange, head_bytes: bytes, client: Streams, origin: Streams) -> None:
    """One plain HTTP request to a bound host (its head already rewritten to origin-form with
    `Connection: close` by request.py)."""
    try:
        head = http1.parse(head_bytes)
        method, target = _request_line(head)
        await _one(exchange, head, method, target, client, origin)
    except Refused as refused:
        exchange.deny("", refused.reason)
        await _refuse(client[1], refused.status, f"egress denied: {refused.reason}", exchange)
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        return


def _request_line(head: http1.Head) -> tuple[str, str]:
    parts = head.first.split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1][:1] == b"/":
        raise Refused(400, "bad_request")  # (origin-form only: the authority is the CONNECT's)
    if not _METHOD.fullmatch(parts[0]) or parts[0] == b"CONNECT":
        raise Refused(400, "bad_request")
    if not _TARGET.fullmatch(parts[1]):
        # Visible ASCII only: an origin that ends lines at a bare LF or splits on any
        # whitespace would read headers of the code's own (another Host) from a tab or LF in
        # the target, before the ones the proxy set; and the audit line quotes the path.
        raise Refused(400, "bad_request")
    return parts[0].decode("ascii"), parts[1].decode("ascii", "replace")


async def _one(
    exchange: Exchange,
    head: http1.Head,
    method: str,
    target: str,
    client: Streams,
    origin: Streams,
) -> bool:
    """Carry one request and its response. True: the connection may carry another."""
    reader, writer = client
    up_reader, up_writer = origin
    framing = http1.request_framing(head)
    keep = head.first.endswith(b"HTTP/1.1") and b"close" not in head.tokens(b"connection")
    for token in head.tokens(b"connection") - {b"close", b"keep-alive"}:
        if token in (b"content-length", b"transfer-encoding", b"host"):
            raise Refused(400, "bad_request")
        head.remove(token)
    head.remove(*http1.HOP_BY_HOP)
    shown = f"[{exchange.host}]" if ":" in exchange.host else exchange.host
    default = exchange.port in (80, 443)
    head.put(b"Host", (shown if default else f"{shown}:{exchange.port}").encode())
    path = target.split("?", 1)[0]
    injected = False
    for binding in exchange.bindings:
        if binding.rule.applies(method, path):
            if binding.rule.methods:
                # A rule for some methods: no header that makes the origin take this request
                # for another method (frameworks honour them; the key would go with it).
                head.remove(*METHOD_OVERRIDES)
            for name, value in binding.headers:
                head.put(name, value)
            exchange.used(binding, method, path)
            injected = True
    if injected:
        head.put(b"Accept-Encoding", b"identity")  # (a compressed echo could not be masked)
    head.first = head.first.rsplit(b" ", 1)[0] + b" HTTP/1.1"
    head.put(b"Connection", b"keep-alive")
    if b"100-continue" in head.tokens(b"expect"):
        # Answered here (the body is read next): the origin gets the request whole.
        head.remove(b"expect")
        await http1._write(writer, b"HTTP/1.1 100 Continue\r\n\r\n", exchange.count)
    await http1._write(up_writer, head.encode(), exchange.count)
    await http1.copy_body(reader, up_writer, framing, exchange.count, exchange.idle)
    masker = exchange.masker()
    while True:
        raw = await http1.read_head(up_reader, exchange.idle)
        if raw is None:
            raise ConnectionError("the origin closed the connection")
        response = http1.parse(raw)
        status_parts = response.first.split(b" ", 2)
        if len(status_parts) < 2 or not status_parts[1].isdigit():
            raise Refused(502, "bad_response")
        status = int(status_parts[1])
        if status == 101:
            raise Refused(502, "upgrade_refused")
        if not 100 <= status < 200:
            break
        await http1._write(writer, masker.mask(raw), exchange.count)
    response_frame = http1.response_framing(method, status, response)
    keep = keep and response_frame[0] != "close" and b"close" not in response.tokens(b"connection")
    response.remove(*http1.HOP_BY_HOP)
    response.put(b"Connection", b"keep-alive" if keep else b"close")
    await http1._write(writer, masker.mask(response.encode()), exchange.count)
    await http1.copy_body(up_reader, writer, response_frame, exchange.count, exchange.idle, masker)
    return keep


async def _refuse(writer: asyncio.StreamWriter, status: int, text: str, ex: Exchange) -> None:
    with contextlib.suppress(OSError, ssl.SSLError, RuntimeError):
        writer.write(refusal(status, text, ex.host, ex.port))
        await asyncio.wait_for(writer.drain(), 5)
