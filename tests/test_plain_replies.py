"""Legacy-era (2025) replies: a JSON body unless the call needs a stream (it asked for
progress, or its reply takes longer than the server waits before streaming), on the wire
with raw HTTP, and through the official client (which then keeps its connection). With
Redis, a reply that turned into a stream starts with a resumable event id, as before.

A real server (and a real redis-server for the event store).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from mcp_harness import ServerProcess, Servers, open_client
from redis_harness import RedisServer

pytestmark = pytest.mark.e2e

TOKEN = "plain-token-1"
LEGACY = "2025-11-25"
BOTH = "application/json, text/event-stream"


@pytest.fixture(scope="module")
def servers(redis_server: RedisServer, serve: Servers) -> dict[str, ServerProcess]:
    return {
        "alone": serve("plain-alone", SANDBOX_AUTH_TOKEN=TOKEN),
        "redis": serve("plain-redis", SANDBOX_AUTH_TOKEN=TOKEN, REDIS_URL=redis_server.url),
    }


class Session:
    """A legacy MCP session spoken in raw HTTP."""

    def __init__(self, http: httpx2.Client, url: str) -> None:
        self.http, self.url, self.ids = http, url, 0
        opened = self.post("initialize", {
            "protocolVersion": LEGACY, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"},
        }, session=False)  # fmt: skip
        assert opened.headers["content-type"] == "application/json"
        self.id = opened.headers["mcp-session-id"]
        assert self.post_notification("notifications/initialized").status_code == 202

    def headers(self, accept: str = BOTH, session: bool = True) -> dict[str, str]:
        out = {"Authorization": f"Bearer {TOKEN}", "Accept": accept}
        if session:
            out |= {"mcp-session-id": self.id, "mcp-protocol-version": LEGACY}
        return out

    def post(
        self, method: str, params: dict[str, Any], accept: str = BOTH, session: bool = True
    ) -> httpx2.Response:
        self.ids += 1
        body = {"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params}
        return self.http.post(
            self.url, json=body, headers=self.headers(accept, session), timeout=30
        )

    def post_notification(self, method: str) -> httpx2.Response:
        body = {"jsonrpc": "2.0", "method": method}
        return self.http.post(self.url, json=body, headers=self.headers())

    def call(
        self, arguments: dict[str, Any], meta: dict[str, Any] | None = None
    ) -> httpx2.Response:
        params: dict[str, Any] = {"name": "execute_code", "arguments": arguments}
        if meta is not None:
            params["_meta"] = meta
        return self.post("tools/call", params)


def sse_events(text: str) -> list[dict[str, str]]:
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if line and not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value.removeprefix(" ")
        if fields:
            events.append(fields)
    return events


def result_of(message: dict[str, Any]) -> dict[str, Any]:
    return dict(message["result"]["structuredContent"])


@pytest.fixture
def http() -> Iterator[httpx2.Client]:
    with httpx2.Client() as client:
        yield client


@pytest.mark.parametrize("where", ["alone", "redis"])
def test_a_quick_reply_is_a_json_body_with_the_session_id(
    servers: dict[str, ServerProcess], http: httpx2.Client, where: str
) -> None:
    session = Session(http, servers[where].url)
    answered = session.call({"command": "echo hi"})
    assert answered.status_code == 200
    assert answered.headers["content-type"] == "application/json"
    assert answered.headers["mcp-session-id"] == session.id
    assert result_of(answered.json())["output"][1]["data"] == "hi\n"
    listed = session.post("tools/list", {})
    assert listed.headers["content-type"] == "application/json"
    assert {t["name"] for t in listed.json()["result"]["tools"]} >= {"execute_code"}


@pytest.mark.parametrize("where", ["alone", "redis"])
def test_a_call_that_asks_for_progress_streams(
    servers: dict[str, ServerProcess], http: httpx2.Client, where: str
) -> None:
    session = Session(http, servers[where].url)
    for spelled in ('"progressToken"', '"progress\\u0054oken"'):  # (the same key, escaped)
        body = json.dumps({
            "jsonrpc": "2.0", "id": 99, "method": "tools/call",
            "params": {"name": "execute_code", "_meta": {"progressToken": "p-1"},
                       "arguments": {"command": "echo one; sleep 0.3; echo two"}},
        }).replace('"progressToken"', spelled)  # fmt: skip
        headers = {**session.headers(), "content-type": "application/json"}
        answered = http.post(session.url, content=body, headers=headers, timeout=30)
        assert answered.headers["content-type"].startswith("text/event-stream"), spelled
        messages = [json.loads(e["data"]) for e in sse_events(answered.text) if e.get("data")]
        progress = [m for m in messages if m.get("method") == "notifications/progress"]
        assert progress and all(m["params"]["progressToken"] == "p-1" for m in progress)
        assert result_of(messages[-1])["exit_code"] == 0


@pytest.mark.parametrize("where", ["alone", "redis"])
def test_a_slow_reply_turns_into_a_stream(
    servers: dict[str, ServerProcess], http: httpx2.Client, where: str
) -> None:
    session = Session(http, servers[where].url)
    started = time.monotonic()
    answered = session.call({"command": "sleep 4; echo late"})
    assert time.monotonic() - started >= 4
    assert answered.status_code == 200
    assert answered.headers["content-type"] == "text/event-stream"
    assert answered.headers["mcp-session-id"] == session.id
    events = sse_events(answered.text)
    with_data = [e for e in events if e.get("data")]
    assert len(with_data) == 1
    assert result_of(json.loads(with_data[0]["data"]))["output"][1]["data"] == "late\n"
    if where == "redis":  # resumable: an event id comes first, with the retry interval
        assert events[0].get("id") and events[0].get("data") == "" and events[0].get("retry")
    else:
        assert not any(e.get("id") for e in events)


def test_a_client_that_takes_only_json_is_refused_as_before(
    servers: dict[str, ServerProcess], http: httpx2.Client
) -> None:
    session = Session(http, servers["alone"].url)
    refused = session.post("tools/list", {}, accept="application/json")
    assert refused.status_code == 406


def test_a_client_gone_during_a_slow_reply_leaves_the_session_working(
    servers: dict[str, ServerProcess], http: httpx2.Client
) -> None:
    session = Session(http, servers["alone"].url)
    with pytest.raises(httpx2.TimeoutException):
        http.post(
            session.url,
            json={"jsonrpc": "2.0", "id": 500, "method": "tools/call",
                  "params": {"name": "execute_code", "arguments": {"command": "sleep 5"}}},
            headers=session.headers(),
            timeout=1.0,
        )  # fmt: skip
    time.sleep(5)  # (past the stream's start and the reply, to a connection gone)
    again = session.call({"command": "echo still"})
    assert result_of(again.json())["output"][1]["data"] == "still\n"
    assert "Traceback" not in servers["alone"].stderr_text()


async def test_the_official_client_keeps_its_connection(
    servers: dict[str, ServerProcess],
) -> None:
    """Legacy-era calls through the official client reuse one TCP connection now (after an
    SSE reply it opened a new one per call)."""
    server = servers["alone"]
    before = connections_to(server.port)
    async with open_client(server.url, TOKEN, "legacy") as conn:
        for i in range(10):
            done = await conn.ok("execute_code", command=f"echo {i}")
            assert done["exit_code"] == 0
        opened = connections_to(server.port) - before
        long = await conn.ok("execute_code", command="sleep 3.5; echo streamed")
        assert long["output"][1]["data"] == "streamed\n"
    # The client's GET stream and its POSTs: a few, not one per call.
    assert len(opened) <= 4, opened


def connections_to(port: int) -> set[int]:
    """The local ports of this machine's TCP connections to `port`, in every state (closed
    ones linger in TIME_WAIT on the side that closed)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, remote = line.split()[1:3]
                if int(remote.rsplit(":", 1)[1], 16) == port:
                    found.add(int(local.rsplit(":", 1)[1], 16))
    return found


async def test_the_tool_list_made_at_startup_is_the_librarys(
    servers: dict[str, ServerProcess], http: httpx2.Client
) -> None:
    """tools/list is answered from a result made at startup: the same tools, with the same
    schemas, as the library lists for a server built the same way; a cursor changes nothing."""
    from sandbox_runtime.app.services import Root
    from sandbox_runtime.config import Settings
    from sandbox_runtime.server.app import build_mcp
    from sandbox_runtime.server.schemas import make_portable

    mcp = build_mcp(Settings(_env_file=None, auth_token=TOKEN), Root())  # type: ignore[call-arg]
    await make_portable(mcp)
    library = {t.name: t.to_mcp_tool(name=t.name).model_dump(mode="json", by_alias=True,
               exclude_none=True) for t in await mcp.list_tools()}  # fmt: skip
    session = Session(http, servers["alone"].url)
    for params in ({}, {"cursor": "anything"}):
        served = session.post("tools/list", params).json()["result"]["tools"]
        assert {t["name"]: t for t in served} == library


def test_a_stream_that_waits_long_is_kept_alive_with_pings(
    servers: dict[str, ServerProcess], http: httpx2.Client
) -> None:
    """A reply streamed (past 3 s) gets a comment line every 15 s: a proxy does not close it."""
    session = Session(http, servers["alone"].url)
    answered = session.call({"command": "sleep 19; echo awake"})
    assert answered.headers["content-type"] == "text/event-stream"
    assert ": ping" in answered.text
    events = [e for e in sse_events(answered.text) if e.get("data")]
    assert result_of(json.loads(events[-1]["data"]))["output"][1]["data"] == "awake\n"
