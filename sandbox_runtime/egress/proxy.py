"""The host's egress proxy: one process, one unix socket per sandbox, HTTP CONNECT and
absolute-form HTTP, strict.

It runs as a child of the server (`python -m sandbox_runtime.egress.proxy`), as the sandbox
user rather than root: it parses what hostile programs send. The server talks to it over a
socketpair (`--control-fd`), one JSON object per line:

    server -> proxy  {"op": "open", "id", "path", "allow", "deny", "cidrs", "exact", "max_bytes",
                      "max_connections"}          listen on `path` for one sandbox
                     {"op": "close", "id"}        stop listening, cut its connections
    proxy -> server  {"op": "opened", "id"} | {"op": "error", "id", "error"}
                     {"op": "closed", "id", "bytes", "connections", "denied"}
                     {"op": "denied", "id", "host", "port", "reason", "method"}
                     {"op": "connected", "id", "host", "port", "address"}

For one request: the head is read (bounded, timed), parsed strictly, the authority made
canonical and decided on by name before any lookup; the name is resolved once (the system's
resolver, or the DNS servers `--resolver` names); every address is vetted and the host's own
addresses refused; a vetted address is dialled and the connection checked again (a local
source address means a local destination). Plain HTTP goes out as one request with `Host`
rewritten from the checked authority and `Connection: close`: a second request on the same
connection cannot reach another name behind the same address.

When the proxy stops, every sandbox's socket stops answering: no sandbox has a way out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ipaddress
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from sandbox_runtime.domain.egress import (
    EgressDenied,
    EgressPolicy,
    IPAddress,
    _as_ip,
    parse_authority,
)
from sandbox_runtime.sandbox.spawner import drop_privileges

MAX_HEAD = 16 * 1024
MAX_HEADERS = 100
CHUNK = 256 * 1024
MAX_EVENTS = 50  # denial events sent per sandbox; more are only counted
LOCAL_REFRESH = 5.0  # seconds the host's own addresses are cached
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
class Settings:
    connect_timeout: float = 10.0
    idle_timeout: float = 120.0
    head_timeout: float = 30.0
    resolve_timeout: float = 5.0
    max_total: int = 1024
    resolvers: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class Request:
    method: str
    host: str
    port: int
    connect: bool
    head: bytes = b""  # plain HTTP: the head to send on, rewritten
    body_length: int = 0


class Sandbox:
    """One sandbox's listener, policy, counters and live connections."""

    def __init__(self, proxy: Proxy, sid: str, policy: EgressPolicy, spec: dict[str, Any]):
        self.proxy = proxy
        self.id = sid
        self.policy = policy
        self.max_bytes = int(spec.get("max_bytes") or 0)
        self.max_connections = int(spec.get("max_connections") or 64)
        self.path = str(spec["path"])
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.bytes = 0
        self.connections = 0
        self.denied = 0
        self.closed = False

    def deny(self, method: str, host: str, port: int, reason: str) -> None:
        self.denied += 1
        if self.denied <= MAX_EVENTS:
            self.proxy.send(
                {
                    "op": "denied",
                    "id": self.id,
                    "host": host[:300],
                    "port": port,
                    "reason": reason,
                    "method": method[:20],
                }
            )

    def count(self, n: int) -> bool:
        """Add `n` bytes; False once the sandbox's byte budget is spent."""
        self.bytes += n
        return not self.max_bytes or self.bytes <= self.max_bytes


class Proxy:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sandboxes: dict[str, Sandbox] = {}
        self.active = 0
        self._control: asyncio.StreamWriter | None = None
        self._local: set[IPAddress] = set()
        self._local_at = 0.0
        self._resolver: Any = None
        if settings.resolvers:
            import dns.asyncresolver

            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [host for host, _ in settings.resolvers]
            resolver.port = settings.resolvers[0][1]
            resolver.lifetime = settings.resolve_timeout
            self._resolver = resolver

    # -- control channel ---------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        if self._control is not None and not self._control.is_closing():
            self._control.write(json.dumps(message).encode() + b"\n")

    async def serve_control(self, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        self._control = writer
        while True:
            line = await reader.readline()
            if not line:
                return  # the server is gone: so are we (and with us every sandbox's socket)
            try:
                message = json.loads(line)
                await self._command(message)
            except Exception as exc:  # one bad command must not stop the proxy
                self.send({"op": "error", "id": None, "error": f"bad command: {exc}"})

    async def _command(self, message: dict[str, Any]) -> None:
        sid = str(message.get("id"))
        if message.get("op") == "open":
            try:
                await self._open(sid, message)
            except (OSError, ValueError) as exc:
                self.send({"op": "error", "id": sid, "error": str(exc)})
            else:
                self.send({"op": "opened", "id": sid})
        elif message.get("op") == "close":
            sandbox = self.sandboxes.pop(sid, None)
            if sandbox is not None:
                await self._close(sandbox)
                self.send(
                    {
                        "op": "closed",
                        "id": sid,
                        "bytes": sandbox.bytes,
                        "connections": sandbox.connections,
                        "denied": sandbox.denied,
                    }
                )

    async def _open(self, sid: str, spec: dict[str, Any]) -> None:
        if sid in self.sandboxes:
            raise ValueError(f"sandbox {sid} is open already")
        policy = EgressPolicy(
            str(spec.get("allow", "")),
            str(spec.get("deny", "")),
            str(spec.get("cidrs", "")),
            exact=frozenset(ipaddress.ip_address(a) for a in spec.get("exact", [])),
        )
        sandbox = Sandbox(self, sid, policy, spec)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sandbox.path)
        sandbox.server = await asyncio.start_unix_server(
            lambda r, w: self._accept(sandbox, r, w), path=sandbox.path, limit=MAX_HEAD, backlog=128
        )
        os.chmod(sandbox.path, 0o600)  # the sandbox user's (this process's) alone
        self.sandboxes[sid] = sandbox

    async def _close(self, sandbox: Sandbox) -> None:
        sandbox.closed = True
        if sandbox.server is not None:
            sandbox.server.close()
        for task in list(sandbox.tasks):
            task.cancel()
        with contextlib.suppress(OSError):
            os.unlink(sandbox.path)
        if sandbox.tasks:
            await asyncio.gather(*sandbox.tasks, return_exceptions=True)

    # -- one connection ----------------------------------------------------------------------

    async def _accept(
        self, sandbox: Sandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        if sandbox.closed:
            writer.close()
            return
        if len(sandbox.tasks) >= sandbox.max_connections or self.active >= self.settings.max_total:
            sandbox.deny("", "", 0, "connection_limit")
            try:
                await _answer(writer, 503, "too many connections through the egress proxy")
            finally:
                writer.close()  # (not one of the sandbox's tasks: nothing else closes it)
            return
        sandbox.tasks.add(task)
        self.active += 1
        try:
            await self._serve(sandbox, reader, writer)
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must cost one connection, never the proxy
            traceback.print_exc(limit=8, file=sys.stderr)  # (the server's log)
            with contextlib.suppress(Exception):
                await _answer(writer, 502, "egress proxy error")
        finally:
            self.active -= 1
            sandbox.tasks.discard(task)
            writer.close()

    async def _serve(
        self, sandbox: Sandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.settings.head_timeout)
        except (asyncio.LimitOverrunError, ValueError):
            await _answer(writer, 431, "request head too large")
            return
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            return
        request: Request | None = None
        try:
            request = parse_head(head)
            decision = sandbox.policy.check_name(request.host, request.port)
            if not decision.allowed:
                raise Refused(403, decision.reason or "denied", decision.host, request.port)
            request.host = decision.host
            if request.connect and request.port == 80:
                # A raw tunnel to port 80 would carry any Host to the address: plain HTTP goes
                # as checked requests (absolute-form), one per connection.
                raise Refused(403, "connect_to_http_port", request.host, request.port)
            if sandbox.max_bytes and sandbox.bytes >= sandbox.max_bytes:
                raise Refused(403, "byte_limit", request.host, request.port)
            addresses = await self._resolve(request.host)
            remote, address = await self._dial(sandbox, request.host, request.port, addresses)
        except Refused as refused:
            host = refused.host or (request.host if request is not None else "")
            port = refused.port or (request.port if request is not None else 0)
            method = request.method if request is not None else ""
            sandbox.deny(method, host, port, refused.reason)
            await _answer(writer, refused.status, f"egress denied: {refused.reason}", host, port)
            return
        sandbox.connections += 1
        self.send(
            {
                "op": "connected",
                "id": sandbox.id,
                "host": request.host,
                "port": request.port,
                "address": address,
            }
        )
        out_reader, out_writer = remote
        try:
            if request.connect:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await self._pipe(sandbox, request, reader, writer, out_reader, out_writer, None)
            else:
                out_writer.write(request.head)
                await self._pipe(
                    sandbox, request, reader, writer, out_reader, out_writer, request.body_length
                )
        finally:
            out_writer.close()

    async def _resolve(self, host: str) -> list[IPAddress]:
        literal = _as_ip(host)
        if literal is not None:
            return [literal]
        try:
            if self._resolver is not None:
                import dns.exception
                import dns.resolver

                found: list[IPAddress] = []
                answers = await asyncio.gather(  # (A and AAAA at once: one round trip)
                    *(self._resolver.resolve(host, t, search=False) for t in ("A", "AAAA")),
                    return_exceptions=True,
                )
                for answer in answers:
                    if isinstance(answer, dns.resolver.NoAnswer | dns.resolver.NXDOMAIN):
                        continue
                    if isinstance(answer, BaseException):
                        if isinstance(answer, dns.exception.DNSException):
                            raise Refused(502, "resolve_failed", host) from answer
                        raise answer
                    found += [ipaddress.ip_address(r.address) for r in answer]
            else:
                infos = await asyncio.wait_for(
                    asyncio.get_running_loop().getaddrinfo(
                        host, None, type=socket.SOCK_STREAM, flags=socket.AI_ADDRCONFIG
                    ),
                    self.settings.resolve_timeout,
                )
                found = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
        except (OSError, TimeoutError, ValueError) as exc:
            raise Refused(502, "resolve_failed", host) from exc
        if not found:
            raise Refused(502, "resolve_failed", host)
        return list(dict.fromkeys(found))

    def _local_addresses(self) -> set[IPAddress]:
        now = time.monotonic()
        if now - self._local_at > LOCAL_REFRESH:
            self._local = local_addresses()
            self._local_at = now
        return self._local

    async def _dial(
        self, sandbox: Sandbox, host: str, port: int, addresses: list[IPAddress]
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], str]:
        vetted: list[IPAddress] = []
        reason = "not_allowed"
        local = self._local_addresses()
        exact = sandbox.policy.exact  # (the server's: a caller's narrowing adds none)
        for address in addresses:
            problem = sandbox.policy.vet_address(address)
            plain = _unmapped(address)  # (::ffff:a.b.c.d is a.b.c.d on the wire)
            if problem is None and plain in local and plain not in exact:
                problem = "local_address"
            if problem is None:
                vetted.append(address)
            else:
                reason = problem
        if not vetted:
            raise Refused(403, reason, host, port)
        deadline = time.monotonic() + self.settings.connect_timeout
        for address in vetted:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(str(address), port, limit=CHUNK), left
                )
            except (OSError, TimeoutError):
                continue
            sock = writer.get_extra_info("socket")
            peer = ipaddress.ip_address(str(sock.getpeername()[0]).split("%")[0])
            mine = ipaddress.ip_address(str(sock.getsockname()[0]).split("%")[0])
            if peer == mine and _unmapped(address) not in exact:  # routed through the local table
                writer.close()
                raise Refused(403, "local_address", host, port)
            return (reader, writer), str(address)
        raise Refused(502, "connect_failed", host, port)

    async def _pipe(
        self,
        sandbox: Sandbox,
        request: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        out_reader: asyncio.StreamReader,
        out_writer: asyncio.StreamWriter,
        body_length: int | None,
    ) -> None:
        """Copy both ways until both are done, a side is idle too long or the byte budget is
        spent. `body_length` (plain HTTP): only that many bytes go from the sandbox out."""
        idle = self.settings.idle_timeout
        last = [time.monotonic()]

        async def copy(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, limit: int | None
        ) -> None:
            left = limit
            while left is None or left > 0:
                size = CHUNK if left is None else min(CHUNK, left)
                data = await src.read(size)
                if not data:
                    break
                last[0] = time.monotonic()
                if not sandbox.count(len(data)):
                    sandbox.deny(request.method, request.host, request.port, "byte_limit")
                    raise ConnectionAbortedError("byte limit")
                dst.write(data)
                await dst.drain()
                if left is not None:
                    left -= len(data)
            with contextlib.suppress(OSError):
                if dst.can_write_eof():
                    dst.write_eof()

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(min(idle, 5.0))
                if time.monotonic() - last[0] > idle:
                    return

        up = asyncio.ensure_future(copy(reader, out_writer, body_length))
        down = asyncio.ensure_future(copy(out_reader, writer, None))
        dog = asyncio.ensure_future(watchdog())
        try:
            pending = {up, down}
            while pending:
                done, pending = await asyncio.wait(
                    pending | {dog}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(dog)
                if dog in done:
                    break
                if any(t.exception() is not None for t in done if not t.cancelled()):
                    break
                if down in done:
                    break  # the origin is done: nothing more can come back
        finally:
            for task in (up, down, dog):
                task.cancel()
            await asyncio.gather(up, down, dog, return_exceptions=True)


def _unmapped(address: IPAddress) -> IPAddress:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


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
    if len(set(lengths)) > 1 or (lengths and not lengths[0].isdigit()):
        raise Refused(400, "bad_request")
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


async def _answer(
    writer: asyncio.StreamWriter, status: int, text: str, host: str = "", port: int = 0
) -> None:
    phrase = {400: "Bad Request", 403: "Forbidden", 411: "Length Required",
              431: "Request Header Fields Too Large", 502: "Bad Gateway",
              503: "Service Unavailable"}.get(status, "Error")  # fmt: skip
    where = f" ({host}:{port})" if host else ""
    body = f"{text}{where}\n".encode("ascii", "replace")
    reason = text.removeprefix("egress denied: ")
    writer.write(
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nX-Egress-Denied: {reason}\r\n"
        "Connection: close\r\n\r\n".encode("ascii", "replace")
        + body
    )
    with contextlib.suppress(ConnectionError, OSError):
        await asyncio.wait_for(writer.drain(), 5)


def local_addresses() -> set[IPAddress]:
    """The host's own addresses (every interface's): /proc/net/fib_trie's local IPv4 entries and
    /proc/net/if_inet6."""
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError):
        last = ""
        for line in open("/proc/net/fib_trie", encoding="ascii"):
            text = line.strip()
            if text.startswith("|--"):
                last = text[3:].strip()
            elif text.startswith("/32 host LOCAL") and last:
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(last))
    with contextlib.suppress(OSError):
        for line in open("/proc/net/if_inet6", encoding="ascii"):
            raw = line.split()[0]
            with contextlib.suppress(ValueError, IndexError):
                found.add(ipaddress.ip_address(":".join(raw[i : i + 4] for i in range(0, 32, 4))))
    return found


def _drop_privileges(uid: int, gid: int) -> None:
    """Become the sandbox user, after every import is done, the way sandboxes' spawner does
    (no groups, no capability in any set, no_new_privs, not dumpable; each checked)."""
    if os.geteuid() != 0:
        return
    drop_privileges(ctypes.CDLL(None, use_errno=True), uid, gid)


def _preload() -> None:
    """Import now what would otherwise load on first use, when files only root may read
    are out of reach: DNS record types, codecs, the resolver's message parsing."""
    import encodings.ascii
    import encodings.idna
    import encodings.latin_1  # noqa: F401

    import dns._asyncio_backend
    import dns.asyncquery
    import dns.asyncresolver
    import dns.message
    import dns.rrset

    local_addresses()

    message = dns.message.make_query("a.test", "A")
    reply = dns.message.make_response(message)
    for rdtype, value in (("A", "192.0.2.1"), ("AAAA", "2001:db8::1"), ("CNAME", "b.test.")):
        reply.answer.append(dns.rrset.from_text("a.test.", 60, "IN", rdtype, value))
    dns.message.from_wire(reply.to_wire())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="sandbox_runtime's egress proxy (internal)")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--settings", default="{}", help="JSON of Settings fields")
    parser.add_argument("--user", default="", help="uid:gid to run as")
    args = parser.parse_args(argv)
    raw = json.loads(args.settings)
    raw["resolvers"] = [(str(h), int(p)) for h, p in raw.get("resolvers", [])]
    settings = Settings(**raw)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us (closing the channel)
    control = socket.socket(fileno=args.control_fd)
    try:
        with contextlib.suppress(ImportError):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        _preload()
        if args.user:
            uid, gid = (int(x) for x in args.user.split(":"))
            _drop_privileges(uid, gid)
        proxy = Proxy(settings)
    except Exception as exc:
        control.sendall(json.dumps({"op": "failed", "error": str(exc)}).encode() + b"\n")
        sys.exit(1)
    control.sendall(b'{"op": "ready"}\n')
    asyncio.run(proxy.serve_control(control))
    sys.exit(0)


if __name__ == "__main__":
    main()
