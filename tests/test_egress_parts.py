"""The egress proxy's pure parts, in-process: a request head's grammar, the refusal reply,
the vetting of resolved addresses, and the copy both ways over socketpairs (no network)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket

import pytest

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.hosts import as_ip, canonical_host, parse_authority, parse_port
from sandbox_runtime.egress.outbound import unmapped, vet
from sandbox_runtime.egress.pipe import pipe
from sandbox_runtime.egress.request import Refused, parse_head, refusal

pytestmark = pytest.mark.unit


def reason_of(head: bytes) -> tuple[int, str]:
    with pytest.raises(Refused) as refused:
        parse_head(head)
    return refused.value.status, refused.value.reason


def test_connect_names_an_authority() -> None:
    request = parse_head(b"CONNECT Example.COM.:443 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (request.method, request.host, request.port, request.connect) == (
        "CONNECT",
        "example.com",
        443,
        True,
    )
    assert reason_of(b"CONNECT example.com HTTP/1.1\r\n\r\n") == (400, "bad_port")


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"GET https://a.example/ HTTP/1.1\r\n\r\n", (400, "https_needs_connect")),
        (b"GET /path HTTP/1.1\r\n\r\n", (400, "not_a_proxy_request")),
        (b"GET http://a.example/ HTTP/2\r\n\r\n", (400, "bad_request")),
        (b"get http://a.example/ HTTP/1.1\r\n\r\n", (400, "bad_request")),
        (b"GET http://a.example/ HTTP/1.1\r\n folded\r\n\r\n", (400, "bad_request")),
        (
            b"POST http://a.example/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            (411, "chunked_body"),
        ),
        (
            b"POST http://a.example/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            (400, "bad_request"),
        ),
        (b"POST http://a.example/ HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
         (400, "bad_request")),
        (b"GET http://a.example/ HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n",
         (431, "too_many_headers")),
    ],
)  # fmt: skip
def test_a_malformed_head_is_refused_with_its_reason(head: bytes, expected: tuple) -> None:
    assert reason_of(head) == expected


def test_plain_http_keeps_its_body_length_and_an_empty_path_becomes_slash() -> None:
    request = parse_head(b"POST http://a.example:8080?q HTTP/1.0\r\nContent-Length: 7\r\n\r\n")
    assert (request.host, request.port, request.body_length) == ("a.example", 8080, 7)
    assert request.head.startswith(b"POST /?q HTTP/1.1\r\nHost: a.example:8080\r\n")
    v6 = parse_head(b"GET http://[::1]/ HTTP/1.1\r\n\r\n")
    assert b"\r\nHost: [::1]\r\n" in v6.head


def test_a_refusal_carries_its_reason_and_the_authority() -> None:
    reply = refusal(403, "egress denied: not_allowed", "a.example", 443)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert b"\r\nX-Egress-Denied: not_allowed\r\n" in head
    assert body == b"egress denied: not_allowed (a.example:443)\n"
    assert f"Content-Length: {len(body)}".encode() in head
    assert refusal(599, "odd").startswith(b"HTTP/1.1 599 Error\r\n")


def test_hosts_module_parses_as_the_policy_does() -> None:
    assert canonical_host("0x7f.1") == "127.0.0.1"
    assert parse_authority("[::FFFF:7f00:1]:80", None) == ("::ffff:7f00:1", 80)
    assert as_ip("example.com") is None and as_ip("::1") == ipaddress.ip_address("::1")
    assert parse_port("65535") == 65535


def test_vetting_refuses_the_hosts_own_addresses_unless_named_exactly() -> None:
    local = {ipaddress.ip_address("10.0.0.5")}
    ranged = EgressPolicy("", "", "10.0.0.0/24")
    addresses = [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("10.0.0.6")]
    assert vet(ranged, addresses, local, "h", 80) == [addresses[1]]
    with pytest.raises(Refused) as refused:
        vet(ranged, addresses[:1], local, "h", 80)
    assert (refused.value.status, refused.value.reason) == (403, "local_address")
    mapped = ipaddress.ip_address("::ffff:10.0.0.5")
    assert unmapped(mapped) == addresses[0]
    with pytest.raises(Refused):
        vet(ranged, [mapped], local, "h", 80)
    named = EgressPolicy("", "", "10.0.0.5/32")
    assert vet(named, addresses[:1], local, "h", 80) == addresses[:1]
    with pytest.raises(Refused) as refused:
        vet(EgressPolicy("a.example"), [ipaddress.ip_address("192.168.1.1")], set(), "h", 80)
    assert refused.value.reason == "private_address"


Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def stream_pair() -> tuple[Streams, Streams]:
    """Two ends of one socketpair, as asyncio streams."""
    a, b = socket.socketpair()
    return await asyncio.open_unix_connection(sock=a), await asyncio.open_unix_connection(sock=b)


def test_pipe_copies_both_ways_and_stops_at_the_body_length() -> None:
    async def run() -> tuple[bytes, bytes]:
        sandbox, client = await stream_pair()  # client: what the proxy holds of the sandbox
        origin_side, origin = await stream_pair()  # origin: what the proxy dialled
        counted: list[int] = []

        def count(n: int) -> bool:
            counted.append(n)
            return True

        task = asyncio.ensure_future(
            pipe(client, origin, idle=5, body_length=4, count=count, on_limit=lambda: None)
        )
        sandbox[1].write(b"bodyEXTRA")
        got = await origin_side[0].readexactly(4)
        origin_side[1].write(b"reply")
        origin_side[1].write_eof()
        back = await sandbox[0].read()
        await asyncio.wait_for(task, 5)
        for _, writer in (sandbox, client, origin_side, origin):
            writer.close()
        assert sum(counted) == 9
        return got, back

    assert asyncio.run(run()) == (b"body", b"reply")


def test_pipe_does_not_half_close_the_origin_after_a_plain_http_request() -> None:
    """Some origins and mirrors take a FIN after the request for an abort and reset."""

    async def run() -> bool:
        sandbox, client = await stream_pair()
        origin_side, origin = await stream_pair()
        task = asyncio.ensure_future(
            pipe(client, origin, idle=5, body_length=0, count=lambda n: True, on_limit=print)
        )
        try:
            # (the request's head was sent by the proxy; no body: nothing more, and no EOF)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(origin_side[0].read(1), 0.5)
            eof = origin_side[0].at_eof()
            origin_side[1].write(b"reply")
            origin_side[1].write_eof()
            assert await sandbox[0].read() == b"reply"
            await asyncio.wait_for(task, 5)
        finally:
            for _, writer in (sandbox, client, origin_side, origin):
                writer.close()
        return eof

    assert asyncio.run(run()) is False


def test_pipe_stops_when_the_budget_is_spent() -> None:
    async def run() -> list[str]:
        sandbox, client = await stream_pair()
        origin_side, origin = await stream_pair()
        limited: list[str] = []
        task = asyncio.ensure_future(
            pipe(
                client,
                origin,
                idle=5,
                body_length=None,
                count=lambda n: False,
                on_limit=lambda: limited.append("byte_limit"),
            )
        )
        sandbox[1].write(b"x")
        await asyncio.wait_for(task, 5)
        for _, writer in (sandbox, client, origin_side, origin):
            writer.close()
        return limited

    assert asyncio.run(run()) == ["byte_limit"]
