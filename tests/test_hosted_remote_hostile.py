"""A hostile remote server (tests/hosted_servers/remote_hostile.py) behind a real server: an
endless SSE line or event costs the entry's max_message_kb, not the stream (the server's RSS
measured); raw U+2028 in JSON passes; a call or cancellation never answered does not hold the
caller; the URL's credentials and query are never shown; a transport session on
/servers/NAME/mcp is its principal's alone."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hosted_harness import catalog_server, message_of, remote_server, script_entry, text_of
from mcp_harness import (
    ServerProcess,
    eventually,
    free_port,
    memory_of,
    open_client,
)

pytestmark = pytest.mark.e2e

ALICE, BOB = "hostile-remote-alice-token-01", "hostile-remote-bob-token-0123"
BEARER = "Bearer far-upstream-bearer-5150"
PASSWORD, QUERY_KEY = "pa55-in-the-url", "K3Y-in-the-query"
CALL_TIMEOUT = 4
MiB = 1024 * 1024


def with_credentials(port: int) -> str:
    return f"http://agent:{PASSWORD}@127.0.0.1:{port}/mcp?api_key={QUERY_KEY}#frag"


@pytest.fixture(scope="module")
def remote() -> Iterator[int]:
    with remote_server("remote_hostile.py", "/stats") as port:
        yield port


@pytest.fixture(scope="module")
def server(remote: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("hostileremote")
    catalog = {
        "far": {
            "url": with_credentials(remote),
            "headers": {"Authorization": "env:FAR_BEARER"},
            "call_timeout": CALL_TIMEOUT,
            "max_message_kb": 1024,
        },
        "nokey": {"url": with_credentials(remote), "headers": {"Authorization": "env:FAR_UNSET"}},
        "gone": {"url": with_credentials(free_port()), "call_timeout": CALL_TIMEOUT},
        "nosecret": script_entry("echoenv.py", secrets={"API_KEY": "env:FAR_UNSET_SECRET"}),
    }
    with catalog_server(workdir, catalog, f"alice:{ALICE},bob:{BOB}", FAR_BEARER=BEARER) as server:
        yield server


def far(server: ServerProcess) -> str:
    return f"{server.base_url}/servers/far/mcp"


def stats(port: int) -> dict[str, Any]:
    return dict(httpx2.get(f"http://127.0.0.1:{port}/stats", timeout=5).json())


def no_credentials(text: str) -> None:
    for secret in (PASSWORD, QUERY_KEY, "api_key", "agent:", "frag", BEARER.split()[1]):
        assert secret not in text, (secret, text)


async def answers_promptly(server: ServerProcess, token: str = BOB) -> None:
    """Another principal's call to the same remote, and the server itself, answer at once."""
    started = time.monotonic()
    async with open_client(far(server), token) as conn:
        result = await conn.client.call_tool("echo", {"text": "still here"})
        assert text_of(result) == "still here", result
    assert httpx2.get(f"{server.base_url}/health", timeout=5).status_code == 200
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("tool", ["endless_line", "endless_event"])
async def test_an_endless_sse_line_or_event_costs_the_limit_not_the_stream(
    server: ServerProcess, remote: int, tool: str
) -> None:
    before = memory_of(server.pid)
    async with open_client(far(server), ALICE) as conn:
        call = asyncio.ensure_future(conn.client.call_tool(tool, {}))
        await answers_promptly(server)  # (while the remote streams)
        with pytest.raises(Exception) as failed:
            await call
    assert "sent an event over 1024 KiB" in message_of(failed.value), failed.value
    after = memory_of(server.pid)
    grown = {k: (after[k] - before[k]) // MiB for k in after}
    print(f"{tool}: server memory before {before}, after {after}; grown MiB {grown}")
    assert after["VmRSS"] - before["VmRSS"] < 100 * MiB, (before, after)
    assert after["VmHWM"] - before["VmHWM"] < 100 * MiB, (before, after)  # (the peak too)
    # The reply was dropped at the limit, not read to its end (800 MiB).
    sent = await eventually(lambda: stats(remote)["endless_sent"], 10, "the stream to stop")
    assert sent < 200 * MiB, sent
    await answers_promptly(server, ALICE)


async def test_raw_line_separators_inside_json_strings_pass(server: ServerProcess) -> None:
    async with open_client(far(server), ALICE) as conn:
        result = await conn.client.call_tool("u2028", {})
    assert text_of(result) == "one\u2028two\u2029three\x85four", result


async def test_an_encoded_reply_is_refused(server: ServerProcess) -> None:
    """Asked for identity, a remote that compresses anyway is refused: bytes read are bytes
    held only when nothing inflates them."""
    async with open_client(far(server), ALICE) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("gzipped", {})
    assert "sent a gzip-encoded reply" in message_of(failed.value), failed.value
    await answers_promptly(server, ALICE)


async def test_a_call_and_a_cancellation_never_answered_do_not_hold_the_caller(
    server: ServerProcess, remote: int
) -> None:
    cancels = stats(remote)["cancels"]
    async with open_client(far(server), ALICE) as conn:
        started = time.monotonic()
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("hang", {})
        took = time.monotonic() - started
    print(f"hang: the timeout's error after {took:.2f} s (call_timeout {CALL_TIMEOUT} s)")
    # The error comes at the call's timeout; the cancellation the remote never answers is
    # sent in the background (it used to hold the caller as long again).
    assert f"did not answer tools/call within {CALL_TIMEOUT} s" in message_of(failed.value)
    assert took < CALL_TIMEOUT + 2.5, took
    await eventually(lambda: stats(remote)["cancels"] > cancels, 10, "the cancellation")
    await answers_promptly(server, ALICE)
    # The client cancels: the server's request ends, its cancellation is sent (and never
    # answered), and the remote's other callers are not held.
    hangs, cancels = stats(remote)["hangs"], stats(remote)["cancels"]
    async with open_client(far(server), ALICE) as conn:
        call = asyncio.ensure_future(conn.client.call_tool("hang", {}))
        await eventually(lambda: stats(remote)["hangs"] > hangs, 10, "the call to arrive")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await eventually(lambda: stats(remote)["cancels"] > cancels, 10, "the cancellation")
        result = await conn.client.call_tool("echo", {"text": "after the cancel"})
        assert text_of(result) == "after the cancel"
    await answers_promptly(server)


async def test_credentials_in_a_url_are_never_shown(server: ServerProcess, remote: int) -> None:
    async with open_client(server.url, ALICE) as conn:
        listed = (await conn.client.call_tool("list_servers", {})).structured_content
    assert listed is not None
    no_credentials(json.dumps(listed))
    servers = {s["name"]: s for s in listed["servers"]}
    assert servers["far"]["source"] == f"http://127.0.0.1:{remote}/mcp", servers["far"]
    assert servers["far"]["ready"], servers["far"]
    # The remote got them (the test would pass vacuously if the URL lost them on the way).
    assert f"api_key={QUERY_KEY}" in stats(remote)["queries"]
    errors = []
    async with open_client(far(server), ALICE) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("denied", {})
        errors.append(message_of(failed.value))
    assert "answered HTTP 500: denied: query" in errors[0], errors
    with pytest.raises(Exception) as failed:
        async with open_client(f"{server.base_url}/servers/gone/mcp", ALICE) as conn:
            await conn.client.call_tool("echo", {"text": "x"})
    errors.append(message_of(failed.value))
    assert "ConnectError" in errors[1] and "server gone (http://127.0.0.1:" in errors[1], errors
    for text in errors:
        no_credentials(text)


async def test_code_mode_servers_shows_no_credentials(server: ServerProcess) -> None:
    code = """
import json, mcp_servers
from mcp_servers import far
print(json.dumps(mcp_servers.servers()))
try:
    far.denied()
except mcp_servers.BridgeError as exc:
    print(json.dumps(str(exc)))
"""
    async with open_client(server.url, ALICE) as conn:
        result = await conn.call("execute_code", command=["python3", "-c", code], servers=["far"])
    body = result.structured_content
    assert body is not None and body["exit_code"] == 0, body
    out = "".join(e.get("data", "") for e in body["output"] if e["type"] == "stdout")
    described, error = [json.loads(line) for line in out.splitlines()]
    assert [s["name"] for s in described] == ["far"], described
    assert described[0]["url"].endswith("/mcp") and described[0]["url"].startswith("http://1")
    assert "answered HTTP 500" in error, error
    no_credentials(out)
    no_credentials(json.dumps(body))


async def test_ready_is_false_while_a_referenced_secret_is_unset(server: ServerProcess) -> None:
    async with open_client(server.url, BOB) as conn:
        listed = (await conn.client.call_tool("list_servers", {})).structured_content
    assert listed is not None
    servers = {s["name"]: s for s in listed["servers"]}
    for name, ref in (("nokey", "env:FAR_UNSET"), ("nosecret", "env:FAR_UNSET_SECRET")):
        assert not servers[name]["ready"], servers[name]
        assert f"secret {ref} is not set" in servers[name]["problem"], servers[name]
    assert servers["far"]["ready"], servers["far"]


async def test_a_foreign_session_id_is_not_found(server: ServerProcess) -> None:
    """Bob, holding Alice's Mcp-Session-Id for /servers/far/mcp, gets 404 for POST, GET and
    DELETE (as on /mcp); her session goes on."""
    ping = {"jsonrpc": "2.0", "id": 99, "method": "ping"}
    async with open_client(far(server), ALICE) as conn:
        session = conn.session_id
        assert session is not None

        def headers(token: str) -> dict[str, str]:
            return {
                "authorization": f"Bearer {token}",
                "mcp-session-id": session,
                "mcp-protocol-version": "2025-11-25",
                "accept": "application/json, text/event-stream",
                "content-type": "application/json",
            }

        async with httpx2.AsyncClient(timeout=10) as http:
            # The same request with her own token is answered: the 404s are about the owner.
            own = await http.post(far(server), json=ping, headers=headers(ALICE))
            assert own.status_code == 200, (own.status_code, own.text)
            for method in ("POST", "GET", "DELETE"):
                body = json.dumps(ping) if method == "POST" else None
                answer = await http.request(method, far(server), content=body, headers=headers(BOB))
                assert answer.status_code == 404, (method, answer.status_code, answer.text)
        result = await conn.client.call_tool("echo", {"text": "mine still"})
        assert text_of(result) == "mine still", result
