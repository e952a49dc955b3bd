"""The host's egress proxy: one process, one unix socket per sandbox, HTTP CONNECT and
absolute-form HTTP, strict.

It runs as a child of the server (`python -m sandbox_runtime.egress.proxy`), as the sandbox
user rather than root: it parses what hostile programs send. The server talks to it over a
socketpair (`--control-fd`), one JSON object per line:

    server -> proxy  {"op": "tls", "cert", "key", "upstream_cas"}   the deployment CA (once)
                     {"op": "open", "id", "path", "allow", "deny", "cidrs", "exact", "max_bytes",
                      "max_connections", "secrets"}   listen on `path` for one sandbox
                     {"op": "close", "id"}        stop listening, cut its connections
    proxy -> server  {"op": "opened", "id"} | {"op": "error", "id", "error"}
                     {"op": "closed", "id", "bytes", "connections", "denied"}
                     {"op": "denied", "id", "host", "port", "reason", "method"}
                     {"op": "connected", "id", "host", "port", "address"}
                     {"op": "secret", "id", "rule", "secret", "host", "port", "method", "path",
                      "event"}                    a request got a rule's headers (no value)

For one request: the head is read (bounded, timed), parsed strictly, the authority made
canonical and decided on by name before any lookup; the name is resolved once (the system's
resolver, or the DNS servers `--resolver` names); every address is vetted and the host's own
addresses refused; a vetted address is dialled and the connection checked again (a local
source address means a local destination). Plain HTTP goes out as one request with `Host`
rewritten from the checked authority and `Connection: close`: a second request on the same
connection cannot reach another name behind the same address.

A CONNECT to a host one of the sandbox's secret rules binds is not a tunnel: the proxy
terminates TLS with a leaf of the deployment CA, sets the rule's headers and re-makes TLS to
the host (inject.py); so is a plain HTTP request to such a host.

When the proxy stops, every sandbox's socket stops answering: no sandbox has a way out.

Here: the control channel, each sandbox's listener and one connection's course. The request
grammar is request.py's, resolving and dialling outbound.py's, the copying pipe.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import ipaddress
import json
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.egress import inject
from sandbox_runtime.egress.ca import Leaves, upstream_context
from sandbox_runtime.egress.outbound import Outbound, local_addresses
from sandbox_runtime.egress.pipe import pipe
from sandbox_runtime.egress.request import MAX_HEAD, Request, answer
from sandbox_runtime.egress.request import Refused as Refused
from sandbox_runtime.egress.request import parse_head as parse_head
from sandbox_runtime.sandbox.spawner import drop_privileges

MAX_EVENTS = 50  # denial events sent per sandbox; more are only counted


@dataclass
class Settings:
    connect_timeout: float = 10.0
    idle_timeout: float = 120.0
    head_timeout: float = 30.0
    resolve_timeout: float = 5.0
    max_total: int = 1024
    resolvers: list[tuple[str, int]] = field(default_factory=list)


class Sandbox:
    """One sandbox's listener, policy, counters and live connections."""

    def __init__(self, proxy: Proxy, sid: str, policy: EgressPolicy, spec: dict[str, Any]):
        self.proxy = proxy
        self.id = sid
        self.policy = policy
        self.max_bytes = int(spec.get("max_bytes") or 0)
        self.max_connections = int(spec.get("max_connections") or 64)
        self.path = str(spec["path"])
        # Secret rules this sandbox's requests may get (values rendered by the server).
        self.bindings = [inject.Binding.from_spec(b) for b in spec.get("secrets") or ()]
        self.uses = 0
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

    def used(self, host: str, port: int, binding: inject.Binding, method: str, path: str) -> None:
        """A request to `host` got `binding`'s secret: the server logs it (the audit line),
        counts it and tells the execution (by rule name; never the value)."""
        self.uses += 1
        self.proxy.send(
            {
                "op": "secret",
                "id": self.id,
                "rule": binding.rule.name,
                "secret": binding.rule.secret,
                "host": host,
                "port": port,
                "method": method[:20],
                "path": path[:200],
                "event": self.uses <= MAX_EVENTS,
            }
        )


class Proxy:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sandboxes: dict[str, Sandbox] = {}
        self.active = 0
        self._control: asyncio.StreamWriter | None = None
        self.outbound = Outbound(
            settings.resolvers, settings.resolve_timeout, settings.connect_timeout
        )
        # Terminating TLS for secret rules: the deployment CA's leaves and the context towards
        # real hosts (the server sends the CA and the operator's extra CAs: op "tls").
        self.leaves: Leaves | None = None
        self.upstream = upstream_context(b"")

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
        if message.get("op") == "tls":
            self.leaves = Leaves(message["cert"].encode(), message["key"].encode())
            self.upstream = upstream_context(str(message.get("upstream_cas", "")).encode())
            self.send({"op": "tls_ready", "id": None})
        elif message.get("op") == "open":
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
                await answer(writer, 503, "too many connections through the egress proxy")
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
                await answer(writer, 502, "egress proxy error")
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
            await answer(writer, 431, "request head too large")
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
            addresses = await self.outbound.resolve(request.host)
            remote, address = await self.outbound.dial(
                sandbox.policy, request.host, request.port, addresses
            )
        except Refused as refused:
            host = refused.host or (request.host if request is not None else "")
            port = refused.port or (request.port if request is not None else 0)
            method = request.method if request is not None else ""
            sandbox.deny(method, host, port, refused.reason)
            await answer(writer, refused.status, f"egress denied: {refused.reason}", host, port)
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
        out_writer = remote[1]
        bindings = inject.bound(sandbox.bindings, request.host, request.port, request.connect)
        if bindings and self.leaves is not None:
            try:
                await self._inject(sandbox, request, bindings, (reader, writer), remote)
            finally:
                out_writer.close()
            return
        over_budget = functools.partial(
            sandbox.deny, request.method, request.host, request.port, "byte_limit"
        )
        try:
            if request.connect:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                out_writer.write(request.head)
            await pipe(
                (reader, writer),
                remote,
                idle=self.settings.idle_timeout,
                body_length=None if request.connect else request.body_length,
                count=sandbox.count,
                on_limit=over_budget,
            )
        finally:
            out_writer.close()

    async def _inject(
        self,
        sandbox: Sandbox,
        request: Request,
        bindings: list[inject.Binding],
        client: inject.Streams,
        origin: inject.Streams,
    ) -> None:
        """A request to a host secret rules bind: TLS terminated (CONNECT) or plain HTTP
        rewritten, the rules' headers set, echoes masked (inject.py)."""
        assert self.leaves is not None
        host, port = request.host, request.port
        exchange = inject.Exchange(
            host,
            port,
            bindings,
            sandbox.count,
            self.settings.idle_timeout,
            deny=lambda method, reason: sandbox.deny(method, host, port, reason),
            used=lambda b, method, path: sandbox.used(host, port, b, method, path),
            redial=lambda: self._redial(sandbox, host, port),
        )
        if not request.connect:
            await inject.plain(exchange, request.head, client, origin)
            return
        client[1].write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        context = self.leaves.context(host)
        await inject.terminate(exchange, client, origin, context, self.upstream)

    async def _redial(self, sandbox: Sandbox, host: str, port: int) -> inject.Streams:
        """A new connection for a terminated one whose origin closed: resolved and vetted
        again. Raises Refused."""
        addresses = await self.outbound.resolve(host)
        remote, _ = await self.outbound.dial(sandbox.policy, host, port, addresses)
        sandbox.connections += 1
        return remote


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
