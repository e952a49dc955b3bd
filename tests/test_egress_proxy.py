"""The egress proxy's decisions on single requests, without a network: what it answers to a
request head (the parser, the policy, the order of checks), and the policy's exemptions
surviving a caller's narrowing. The whole path through real sandboxes is test_egress.py."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import pytest

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.egress.proxy import Proxy, Refused, Sandbox, Settings, parse_head


class Captured:
    """A writer that keeps what the proxy answers."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None

    def can_write_eof(self) -> bool:
        return False


async def answer(policy: EgressPolicy, head: bytes) -> tuple[int, str, list[dict[str, Any]]]:
    """(status, X-Egress-Denied, the events sent) for one request head."""
    proxy = Proxy(Settings(connect_timeout=1, resolve_timeout=1))
    sent: list[dict[str, Any]] = []
    proxy.send = sent.append  # type: ignore[method-assign]
    sandbox = Sandbox(proxy, "t", policy, {"path": "/nonexistent"})
    reader = asyncio.StreamReader()
    reader.feed_data(head)
    reader.feed_eof()
    writer = Captured()
    await proxy._serve(sandbox, reader, writer)  # type: ignore[arg-type]
    status_line, _, rest = writer.data.partition(b"\r\n")
    reason = ""
    for line in rest.split(b"\r\n"):
        if line.lower().startswith(b"x-egress-denied:"):
            reason = line.split(b":", 1)[1].strip().decode()
    return int(status_line.split()[1]), reason, sent


def test_a_caller_naming_one_address_of_a_range_does_not_lift_the_metadata_refusal() -> None:
    server = EgressPolicy("", "", "169.254.0.0/16")
    narrowed = server.narrow(["169.254.169.254"])
    assert narrowed.allow_cidrs == (ipaddress.ip_network("169.254.169.254/32"),)
    assert not narrowed.exact, "a caller's /32 must not count as the operator's exact name"
    decision = narrowed.check_name("169.254.169.254", 80)
    assert not decision.allowed and decision.reason == "metadata_address"
    assert narrowed.vet_address("169.254.169.254") == "metadata_address"
    assert narrowed.vet_address("::ffff:169.254.169.254") == "metadata_address"
    # The operator naming it exactly still allows it, narrowed or not.
    named = EgressPolicy("", "", "169.254.169.254/32")
    assert named.check_name("169.254.169.254", 80).allowed
    assert named.narrow(["169.254.169.254"]).check_name("169.254.169.254", 80).allowed


def test_a_callers_exact_address_does_not_lift_the_local_address_refusal() -> None:
    server = EgressPolicy("", "", "127.0.0.0/8")
    narrowed = server.narrow(["127.0.0.1/32"])
    status, reason, _ = asyncio.run(
        answer(narrowed, b"GET http://127.0.0.1:9/ HTTP/1.1\r\nHost: x\r\n\r\n")
    )
    assert (status, reason) == (403, "local_address")


@pytest.mark.parametrize(
    "connection",
    [b"content-length", b"Content-Length", b"keep-alive, content-length", b"transfer-encoding",
     b"host"],
)  # fmt: skip
def test_a_connection_header_naming_a_framing_header_is_refused(connection: bytes) -> None:
    head = (
        b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 5\r\n"
        b"Connection: " + connection + b"\r\n\r\n"
    )
    with pytest.raises(Refused) as refused:
        parse_head(head)
    assert refused.value.status == 400


def test_connect_to_port_80_is_refused_after_the_name_is_decided() -> None:
    policy = EgressPolicy("allowed.test:80,allowed.test")
    status, reason, sent = asyncio.run(
        answer(policy, b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n")
    )
    assert (status, reason) == (403, "connect_to_http_port")
    assert sent and sent[0]["reason"] == "connect_to_http_port"
    # A name the policy refuses is refused for that, first.
    status, reason, _ = asyncio.run(
        answer(policy, b"CONNECT other.test:80 HTTP/1.1\r\nHost: other.test:80\r\n\r\n")
    )
    assert (status, reason) == (403, "not_allowed")


def test_plain_http_goes_out_as_one_request_with_the_checked_host() -> None:
    request = parse_head(
        b"GET http://Allowed.Test./a?b HTTP/1.1\r\nHost: other.test\r\nConnection: keep-alive, "
        b"x-drop\r\nX-Drop: 1\r\nProxy-Authorization: secret\r\nAccept: */*\r\n\r\n"
    )
    assert request.head.startswith(b"GET /a?b HTTP/1.1\r\nHost: allowed.test\r\n")
    assert b"other.test" not in request.head and b"X-Drop" not in request.head
    assert b"secret" not in request.head
    assert request.head.endswith(b"Accept: */*\r\nConnection: close\r\n\r\n")
