"""The network lab's origin servers: HTTP, HTTPS and DNS inside the lab's network namespace.

tests/netlab.py starts this as `ip netns exec <ns> <python> netlab_origin.py <config.json>`;
it runs with the standard library and dnspython only (no sandbox_runtime imports), so it
starts fast and stays what the proxy under test talks to, nothing more. The config (written by
NetLab) says where to bind and where everything lives:

    {"binds": ["10.213.7.42", "fd..::2"], "http_ports": [80, 8080, 8081],
     "https_ports": [443, 8443], "cert": ".../server.pem", "key": ".../server.key",
     "dns_map": ".../dns.json", "dns_ttl": 0, "dns_log": ".../dns.log",
     "access_log": ".../access.log", "ready": ".../ready"}

HTTP (the same on every HTTP and HTTPS port; HTTP/1.1 with keep-alive, HEAD too):
    GET  /hello                     200 "hello from origin <port>\\n"
    ANY  /echo                      200 JSON: method, path, target, http_version, headers
                                    (lowercased name -> value, repeats joined with ", "),
                                    header_list ([name, value] as sent), port, tls, sni,
                                    client (peer address), body_length, body_sha256
    GET  /bytes/<n>                 200, n bytes of "0123456789abcdef"..., 64 KiB writes
    GET  /slow/<n>?rate=<bytes/s>   the same bytes, paced at `rate` (default 16384)
    GET  /redirect?to=<url>         302 to `url`
    GET  /hangup                    200 "bye\n" (keep-alive if asked), then the origin closes
    GET  /auth/<anything>           401 unless the request's Authorization or X-Api-Key is
                                    one of the values in the "auth" JSON file (read afresh);
                                    then /auth/simple/<project>/ is a package index page of
                                    the "files" directory and /auth/files/<name> a file of it
    anything else                   404

DNS (UDP and TCP port 53): A and AAAA answers from the JSON mapping file, read afresh for
every query so NetLab.set_dns() takes effect at once. Names are matched case-insensitively,
without the trailing dot; a key "*.example.test" answers for names below example.test that
have no key of their own. A name's value is a list of addresses (an empty list, or only
addresses of the other family: NOERROR with no answer), or "SERVFAIL", or "TIMEOUT" (no reply
at all). A name with no key is NXDOMAIN.

Every DNS question, accepted connection and HTTP request is appended to a log file (one JSON
object a line) *before* it is answered, so once a client has its answer the log shows it:
tests assert from them that a refused name was never looked up, or a refused request never
reached an origin.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import ipaddress
import json
import os
import resource
import signal
import ssl
import struct
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype
import dns.rrset

# /bytes and /slow content: this pattern repeated; a 64 KiB chunk is a whole number of them,
# so every chunk of a response is the same bytes object.
PATTERN = b"0123456789abcdef"
CHUNK_SIZE = 64 * 1024
CHUNK = PATTERN * (CHUNK_SIZE // len(PATTERN))

MAX_HEAD = 1024 * 1024  # request line plus headers
SLOW_DEFAULT_RATE = 16 * 1024
SLOW_TICK = 0.05  # /slow sends what is due every 50 ms

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
}


def pattern_bytes(offset: int, length: int) -> bytes:
    """`length` bytes of the repeated pattern, starting at `offset` of the response body."""
    start = offset % len(PATTERN)
    repeats = (start + length) // len(PATTERN) + 1
    return (PATTERN * repeats)[start : start + length]


class Logs:
    """The lab's append-only JSON-lines logs. One write per record, opened in append mode
    each time, so NetLab may truncate a file between records (clear_logs)."""

    def __init__(self, dns_log: str, access_log: str) -> None:
        self.dns_log = dns_log
        self.access_log = access_log

    @staticmethod
    def _append(path: str, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)

    def dns(self, record: dict[str, Any]) -> None:
        self._append(self.dns_log, {"time": time.time(), **record})

    def access(self, record: dict[str, Any]) -> None:
        self._append(self.access_log, {"time": time.time(), **record})


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


class BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass
class Request:
    method: str
    target: str
    version: str
    header_list: list[tuple[str, str]]
    headers: dict[str, str] = field(default_factory=dict)  # lowercased, repeats joined

    @property
    def path(self) -> str:
        """The origin-form path and query, also when a client sent the absolute form."""
        if self.target.startswith("/"):
            return self.target
        parts = urllib.parse.urlsplit(self.target)
        return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request's line and headers; None when the client closed between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise BadRequest(400, "incomplete request head") from None
    except asyncio.LimitOverrunError:
        raise BadRequest(431, "request head too large") from None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, f"bad request line {lines[0]!r}")
    header_list: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, f"bad header line {line!r}")
        header_list.append((name, value.strip()))
    request = Request(parts[0], parts[1], parts[2], header_list)
    for name, value in header_list:
        key = name.lower()
        request.headers[key] = (
            f"{request.headers[key]}, {value}" if key in request.headers else value
        )
    return request


async def read_body(
    request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[int, str]:
    """Read (and count and hash, never keep) the request's body: (length, sha256 hex)."""
    digest = hashlib.sha256()
    length = 0
    if request.headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise BadRequest(400, "bad chunk size") from None
            if size == 0:
                # Trailers, then the empty line.
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                break
            remaining = size
            while remaining:
                data = await reader.read(min(remaining, CHUNK_SIZE))
                if not data:
                    raise BadRequest(400, "body ended early")
                digest.update(data)
                remaining -= len(data)
            length += size
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in request.headers:
        try:
            remaining = int(request.headers["content-length"])
        except ValueError:
            raise BadRequest(400, "bad Content-Length") from None
        while remaining > 0:
            data = await reader.read(min(remaining, CHUNK_SIZE))
            if not data:
                raise BadRequest(400, "body ended early")
            digest.update(data)
            length += len(data)
            remaining -= len(data)
    return length, digest.hexdigest()


def response_head(
    status: int, length: int, content_type: str, keep_alive: bool, port: int
) -> bytes:
    return (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"
        f"Content-Length: {length}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n"
        f"Server: netlab-origin\r\n"
        f"X-Netlab-Port: {port}\r\n\r\n"
    ).encode("latin-1")


@dataclass
class Connection:
    """What a handler knows of its connection."""

    port: int
    tls: bool
    sni: str | None
    client: str


class HttpOrigin:
    def __init__(self, logs: Logs, config: dict[str, Any] | None = None) -> None:
        self.logs = logs
        self.config = config or {}

    async def handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int, tls: bool
    ) -> None:
        peer = writer.get_extra_info("peername")
        ssl_object = writer.get_extra_info("ssl_object")
        conn = Connection(
            port=port,
            tls=tls,
            sni=getattr(ssl_object, "netlab_sni", None) if ssl_object is not None else None,
            client=str(peer[0]) if peer else "",
        )
        self.logs.access({"kind": "connection", "port": port, "tls": tls, "client": conn.client})
        transport = writer.transport
        if isinstance(transport, asyncio.WriteTransport):
            # Room for a few 64 KiB chunks before drain() waits: large downloads stay fast.
            transport.set_write_buffer_limits(high=1024 * 1024)
        try:
            while True:
                try:
                    request = await read_request(reader)
                except BadRequest as e:
                    body = f"{e}\n".encode()
                    writer.write(response_head(e.status, len(body), "text/plain", False, port))
                    writer.write(body)
                    await writer.drain()
                    break
                if request is None:
                    break
                if not await self.respond(request, reader, writer, conn):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, BadRequest):
            pass  # the client went away (or sent garbage mid-body): nothing more to answer
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def respond(
        self,
        request: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
    ) -> bool:
        """Answer one request; returns whether the connection stays open for another."""
        self.logs.access(
            {
                "kind": "request",
                "port": conn.port,
                "tls": conn.tls,
                "sni": conn.sni,
                "client": conn.client,
                "method": request.method,
                "target": request.target,
                "host": request.headers.get("host"),
                "headers": request.headers,
            }
        )
        body_length, body_sha256 = await read_body(request, reader, writer)
        keep = request.keep_alive
        head_only = request.method == "HEAD"
        split = urllib.parse.urlsplit(request.path)
        path = split.path
        query = urllib.parse.parse_qs(split.query)

        def simple(status: int, body: bytes, content_type: str = "text/plain") -> None:
            writer.write(response_head(status, len(body), content_type, keep, conn.port))
            if not head_only:
                writer.write(body)

        if path == "/hello":
            simple(200, f"hello from origin {conn.port}\n".encode())
        elif path == "/echo":
            echo = {
                "method": request.method,
                "path": request.path,
                "target": request.target,
                "http_version": request.version,
                "headers": request.headers,
                "header_list": request.header_list,
                "port": conn.port,
                "tls": conn.tls,
                "sni": conn.sni,
                "client": conn.client,
                "body_length": body_length,
                "body_sha256": body_sha256,
            }
            simple(200, json.dumps(echo).encode(), "application/json")
        elif path.startswith(("/bytes/", "/slow/")):
            try:
                size = int(path.rsplit("/", 1)[1])
                rate = int(query.get("rate", [str(SLOW_DEFAULT_RATE)])[0])
            except ValueError:
                simple(400, b"bad size or rate\n")
                return keep
            if size < 0 or rate <= 0:
                simple(400, b"bad size or rate\n")
                return keep
            writer.write(response_head(200, size, "application/octet-stream", keep, conn.port))
            if not head_only:
                if path.startswith("/bytes/"):
                    await self.send_bytes(writer, size)
                else:
                    await self.send_slowly(writer, size, rate)
        elif path == "/hangup":  # (a kept-alive connection the origin then closes)
            simple(200, b"bye\n")
            await writer.drain()
            return False
        elif path == "/redirect":
            location = query.get("to", ["/hello"])[0].encode()
            writer.write(
                b"HTTP/1.1 302 Found\r\nLocation: "
                + location
                + b"\r\nContent-Length: 0\r\n"
                + (b"" if keep else b"Connection: close\r\n")
                + b"\r\n"
            )
        elif path.startswith("/auth/"):
            self.authorized(request, path, simple)
        else:
            simple(404, b"not found\n")
        await writer.drain()
        return keep

    def authorized(self, request: Request, path: str, simple: Any) -> None:
        """/auth/...: the private package index (see the module's docstring)."""
        try:
            accepted = json.loads(Path(self.config["auth"]).read_text())
        except (KeyError, OSError, ValueError):
            accepted = []
        sent = [request.headers.get("authorization"), request.headers.get("x-api-key")]
        if not any(value in accepted for value in sent if value):
            simple(401, b"unauthorized\n")
            return
        files = Path(self.config.get("files", "/nonexistent"))
        if path.startswith("/auth/simple/"):
            links = "".join(
                f'<a href="/auth/files/{f.name}">{f.name}</a>\n' for f in sorted(files.glob("*"))
            )
            simple(200, f"<html><body>\n{links}</body></html>\n".encode(), "text/html")
        elif path.startswith("/auth/files/") and (files / path.rsplit("/", 1)[1]).is_file():
            simple(200, (files / path.rsplit("/", 1)[1]).read_bytes(), "application/octet-stream")
        elif path == "/auth/hello":
            simple(200, b"hello, authorized\n")
        else:
            simple(404, b"not found\n")

    @staticmethod
    async def send_bytes(writer: asyncio.StreamWriter, size: int) -> None:
        full, rest = divmod(size, CHUNK_SIZE)
        for _ in range(full):
            writer.write(CHUNK)
            await writer.drain()
        if rest:
            writer.write(CHUNK[:rest])

    @staticmethod
    async def send_slowly(writer: asyncio.StreamWriter, size: int, rate: int) -> None:
        """`size` bytes at `rate` bytes a second: each tick sends what is due by then."""
        started = time.monotonic()
        sent = 0
        while sent < size:
            due = min(size, int(rate * (time.monotonic() - started)))
            if due > sent:
                writer.write(pattern_bytes(sent, due - sent))
                await writer.drain()
                sent = due
            if sent < size:
                await asyncio.sleep(SLOW_TICK)


# ---------------------------------------------------------------------------------------------
# DNS
# ---------------------------------------------------------------------------------------------


class DnsOrigin:
    """Answers from the mapping file; see the module docstring."""

    def __init__(self, map_path: str, ttl: int, logs: Logs) -> None:
        self.map_path = map_path
        self.ttl = ttl
        self.logs = logs

    def mapping(self) -> dict[str, Any]:
        """Read afresh on every query (a few hundred bytes): set_dns() applies at once."""
        try:
            with open(self.map_path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return {}
        return {str(k).lower().rstrip("."): v for k, v in raw.items()}

    @staticmethod
    def lookup(mapping: dict[str, Any], name: str) -> Any:
        """The name's value, else the closest "*." wildcard above it, else None."""
        if name in mapping:
            return mapping[name]
        labels = name.split(".")
        for i in range(1, len(labels)):
            wildcard = "*." + ".".join(labels[i:])
            if wildcard in mapping:
                return mapping[wildcard]
        return None

    def answer(self, wire: bytes, proto: str, client: str) -> bytes | None:
        """The reply to one query's wire bytes; None to send nothing."""
        try:
            query = dns.message.from_wire(wire)
        except Exception:
            return None  # not DNS: ignore, as a real server would
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
            response.set_rcode(dns.rcode.NOTIMP)
            return response.to_wire()
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        self.logs.dns({"name": name, "type": rdtype, "proto": proto, "client": client})
        value = self.lookup(self.mapping(), name)
        if value is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif value == "TIMEOUT":
            return None
        elif value == "SERVFAIL":
            response.set_rcode(dns.rcode.SERVFAIL)
        else:
            version = {"A": 4, "AAAA": 6}.get(rdtype)
            addresses = [a for a in value if ipaddress.ip_address(a).version == version]
            if addresses:
                response.answer.append(
                    dns.rrset.from_text(question.name, self.ttl, "IN", rdtype, *addresses)
                )
        limit = 65535
        if proto == "udp":
            limit = max(512, query.payload) if query.edns >= 0 else 512
        try:
            return response.to_wire(max_size=limit)
        except dns.exception.TooBig:
            response.answer.clear()
            response.flags |= dns.flags.TC  # the client retries over TCP
            return response.to_wire()


class DnsUdp(asyncio.DatagramProtocol):
    def __init__(self, origin: DnsOrigin) -> None:
        self.origin = origin
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (3.11's selector transport is no DatagramTransport subclass, though it is one.)
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        reply = self.origin.answer(data, "udp", str(addr[0]))
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def dns_tcp(
    origin: DnsOrigin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """DNS over TCP: two-byte length, message; as many queries as the client sends."""
    peer = writer.get_extra_info("peername")
    try:
        while True:
            try:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                wire = await reader.readexactly(length)
            except asyncio.IncompleteReadError:
                break
            reply = origin.answer(wire, "tcp", str(peer[0]) if peer else "")
            if reply is not None:
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
            await writer.wait_closed()


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])

    def remember_sni(ssl_object: Any, server_name: str | None, _context: ssl.SSLContext) -> None:
        # Kept on the connection's SSLObject for /echo and the access log.
        ssl_object.netlab_sni = server_name

    context.sni_callback = remember_sni
    return context


async def serve(config: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    logs = Logs(config["dns_log"], config["access_log"])
    http = HttpOrigin(logs, config)
    dns_origin = DnsOrigin(config["dns_map"], int(config["dns_ttl"]), logs)
    context = tls_context(config["cert"], config["key"])
    closers: list[Any] = []
    for host in config["binds"]:
        for port in config["http_ports"]:
            handler = functools.partial(http.handle, port=port, tls=False)
            closers.append(
                await asyncio.start_server(handler, host, port, backlog=4096, limit=MAX_HEAD)
            )
        for port in config["https_ports"]:
            handler = functools.partial(http.handle, port=port, tls=True)
            closers.append(
                await asyncio.start_server(
                    handler,
                    host,
                    port,
                    ssl=context,
                    ssl_handshake_timeout=10,
                    backlog=4096,
                    limit=MAX_HEAD,
                )
            )
        transport, _ = await loop.create_datagram_endpoint(
            lambda: DnsUdp(dns_origin), local_addr=(host, 53)
        )
        closers.append(transport)
        closers.append(
            await asyncio.start_server(
                functools.partial(dns_tcp, dns_origin), host, 53, backlog=1024
            )
        )

    # Bound everywhere: say so (atomically) for NetLab.start().
    ready = Path(config["ready"])
    ready.with_suffix(".tmp").write_text(str(os.getpid()))
    ready.with_suffix(".tmp").replace(ready)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # If the test process dies without close(), we are reparented: exit rather than linger.
    parent = os.getppid()
    while not stop.is_set():
        if os.getppid() != parent:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)
    for closer in closers:
        closer.close()


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: netlab_origin.py CONFIG.json")
    config = json.loads(Path(sys.argv[1]).read_text())
    # Many concurrent connections (through a proxy under load): as many fds as allowed.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
