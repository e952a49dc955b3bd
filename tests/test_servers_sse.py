"""The byte-level SSE reader of remote replies (servers/sse.py) and what principals are shown
of a remote's URL (servers/catalog.py): lines end only at CR, LF or CRLF, wherever the
chunks split; a line or an event is refused as it crosses the limit; a URL loses its
credentials and query."""

from __future__ import annotations

import json

import pytest

from sandbox_runtime.servers.catalog import missing_secret, parse_entry, shown_url, url_secrets
from sandbox_runtime.servers.instance import InstanceError
from sandbox_runtime.servers.log_sink import LogSink
from sandbox_runtime.servers.remote import RemoteInstance
from sandbox_runtime.servers.sse import EventReader, EventTooLargeError
from sandbox_runtime.supervisor import Supervisor

pytestmark = pytest.mark.unit


def read(chunks: list[bytes], limit: int = 1 << 20) -> list[bytes]:
    reader = EventReader(limit)
    return [event for chunk in chunks for event in reader.feed(chunk)]


def every_split(stream: bytes) -> list[list[bytes]]:
    """The stream in one chunk, a byte at a time, and cut in two at each position."""
    cuts = [[stream], [stream[i : i + 1] for i in range(len(stream))]]
    return cuts + [[stream[:i], stream[i:]] for i in range(1, len(stream))]


def test_events_end_at_a_blank_line_whatever_the_terminators_and_the_chunks() -> None:
    stream = (
        b'\xef\xbb\xbfdata: {"a":1}\r\n\r\n'
        b": a comment\n"
        b"event: message\rid: 7\rdata:two\rdata:  lines\r\r"
        b'data: {"b":2}\n\n'
        b"data: never ended"
    )
    for chunks in every_split(stream):
        assert read(chunks) == [b'{"a":1}', b"two\n lines", b'{"b":2}'], chunks


def test_unicode_line_breaks_inside_json_survive() -> None:
    text = "one\u2028two\u2029three\x85four\x0bfive\x0csix\x1cseven"
    event = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"text": text}}, ensure_ascii=False)
    stream = b"data: " + event.encode() + b"\n\n"
    for chunks in every_split(stream)[:2]:
        (got,) = read(chunks)
        assert json.loads(got)["result"]["text"] == text


def test_an_endless_line_is_refused_at_the_limit_without_holding_it() -> None:
    reader = EventReader(64 * 1024, "server far")
    chunk = b"x" * 4000
    reader.feed(b"data: ")
    fed, held = 6, 0
    with pytest.raises(EventTooLargeError, match="server far sent an event over 64 KiB"):
        while fed < 10 * 1024 * 1024:
            reader.feed(chunk)
            fed += len(chunk)
            held = max(held, len(reader._line))
    assert fed <= 64 * 1024 and held <= 64 * 1024, (fed, held)  # (refused as it crossed)
    assert fed + len(chunk) > 64 * 1024  # (and not before)


def test_an_endless_event_of_short_lines_is_refused_at_the_limit() -> None:
    reader = EventReader(64 * 1024)
    fed = 0
    with pytest.raises(EventTooLargeError):
        while fed < 10 * 1024 * 1024:
            reader.feed(b"data: " + b"y" * 100 + b"\n")
            fed += 107
    assert fed <= 64 * 1024 < fed + 107, fed  # (refused as the event crossed the limit)


def test_events_under_the_limit_pass_however_many() -> None:
    reader = EventReader(1024)
    event = b"data: " + b"z" * 1000 + b"\n\n"  # (1007 bytes: under the limit each time)
    assert [len(e) for e in reader.feed(event * 50)] == [1000] * 50


def test_urls_are_shown_without_credentials_query_or_fragment() -> None:
    cases = {
        "http://user:pa55@host.example:8443/mcp?api_key=K3Y#frag": "http://host.example:8443/mcp",
        "https://mcp.example/v1/mcp": "https://mcp.example/v1/mcp",
        "http://[::1]:9000/mcp?token=abcd": "http://[::1]:9000/mcp",
        "http://u:p?ss@host/mcp": "(a URL that does not parse)",
    }
    for url, shown in cases.items():
        assert shown_url(url) == shown, url
    hidden = url_secrets("http://user:pa%2055@host/mcp?api_key=K3Y&x=1")
    assert {"user:pa%2055", "pa%2055", "pa 55", "K3Y", "api_key=K3Y&x=1"} <= set(hidden)
    entry = parse_entry("far", {"url": "http://user:pa55@host/mcp?api_key=K3Y"})
    described = json.dumps(entry.describe())
    assert "pa55" not in described and "K3Y" not in described and "user" not in described


def test_a_missing_secret_is_named_never_its_value(tmp_path: object) -> None:
    remote = parse_entry(
        "far",
        {"url": "https://host/mcp", "headers": {"Authorization": "env:FAR_TOKEN", "X": "lit"}},
    )
    assert missing_secret(remote, {}) == (
        "secret env:FAR_TOKEN is not set (the server's environment has no FAR_TOKEN)"
    )
    assert missing_secret(remote, {"FAR_TOKEN": "v"}) is None
    stdio = parse_entry("near", {"command": ["/bin/x"], "secrets": {"K": "file:/nonexistent/k"}})
    problem = missing_secret(stdio, {})
    assert problem is not None and problem.startswith("secret file:/nonexistent/k: cannot read")


async def test_a_url_that_does_not_parse_is_not_quoted() -> None:
    """httpx's InvalidURL quotes the "port", which here is the start of a password."""
    supervisor = Supervisor()
    entry = parse_entry("far", {"url": "http://u:pa55/x@host/mcp"})
    remote = RemoteInstance(entry, LogSink(None), supervisor)
    try:
        with pytest.raises(InstanceError) as failed:
            await remote.request("tools/list", {})
        assert str(failed.value) == "server far: its URL does not parse"
    finally:
        await remote.aclose()
        await supervisor.aclose()
