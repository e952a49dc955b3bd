"""The proxy's way out: a name resolved once, every address vetted, a vetted one dialled.

The host's own addresses (every interface's, read from /proc and cached a few seconds) are
refused unless the operator named one exactly, and a dialled connection is checked again: a
local source address means a local destination (an address routed through the local table).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import time
from typing import Any

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.hosts import IPAddress, as_ip
from sandbox_runtime.egress.request import Refused

CHUNK = 256 * 1024
LOCAL_REFRESH = 5.0  # seconds the host's own addresses are cached


class Outbound:
    """Resolving (the system's resolver, or the DNS servers `resolvers` names) and dialling
    under a sandbox's policy. Raises `Refused` with the reason."""

    def __init__(
        self, resolvers: list[tuple[str, int]], resolve_timeout: float, connect_timeout: float
    ) -> None:
        self.resolve_timeout = resolve_timeout
        self.connect_timeout = connect_timeout
        self._local: set[IPAddress] = set()
        self._local_at = 0.0
        self._resolver: Any = None
        if resolvers:
            import dns.asyncresolver

            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [host for host, _ in resolvers]
            resolver.port = resolvers[0][1]
            resolver.lifetime = resolve_timeout
            self._resolver = resolver

    async def resolve(self, host: str) -> list[IPAddress]:
        """Every address `host` (canonical) has, once each, in the resolver's order."""
        literal = as_ip(host)
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
                    self.resolve_timeout,
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

    async def dial(
        self, policy: EgressPolicy, host: str, port: int, addresses: list[IPAddress]
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], str]:
        """A connection to the first of `addresses` that is vetted and answers in time, and
        the address it went to."""
        exact = policy.exact  # (the server's: a caller's narrowing adds none)
        vetted = vet(policy, addresses, self._local_addresses(), host, port)
        deadline = time.monotonic() + self.connect_timeout
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
            if peer == mine and unmapped(address) not in exact:  # routed through the local table
                writer.close()
                raise Refused(403, "local_address", host, port)
            return (reader, writer), str(address)
        raise Refused(502, "connect_failed", host, port)


def vet(
    policy: EgressPolicy, addresses: list[IPAddress], local: set[IPAddress], host: str, port: int
) -> list[IPAddress]:
    """The addresses `policy` lets a sandbox dial, the host's own (`local`) refused but for
    those the operator named exactly. Raises Refused (the last refusal's reason) if none."""
    vetted: list[IPAddress] = []
    reason = "not_allowed"
    exact = policy.exact  # (the server's: a caller's narrowing adds none)
    for address in addresses:
        problem = policy.vet_address(address)
        plain = unmapped(address)  # (::ffff:a.b.c.d is a.b.c.d on the wire)
        if problem is None and plain in local and plain not in exact:
            problem = "local_address"
        if problem is None:
            vetted.append(address)
        else:
            reason = problem
    if not vetted:
        raise Refused(403, reason, host, port)
    return vetted


def unmapped(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv4-mapped IPv6 address is on the wire; any other as it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


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
