"""Hosted servers that stop reading their stdin, and callers that stop reading their stream
(tests/hosted_servers/deaf.py in real sandboxes behind a real server): every write to an
instance ends within the call's timeout, a deaf instance is ended, a cancel never waits on it,
an execution ends by its own timeout whatever its servers do, and neither a deaf server nor a
caller that does not read holds up another principal."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hosted_harness import catalog_server, message_of, script_entry, text_of
from mcp_harness import (
    Conn,
    ServerProcess,
    eventually,
    memory_of,
    open_client,
)

from sandbox_runtime.servers.outbox import MAX_QUEUED_NOTIFICATIONS

pytestmark = pytest.mark.e2e

ALICE, BOB = "writes-alice-token-0123456789", "writes-bob-token-0123456789"
PAD = 400_000  # the argument: far past a pipe's 64 KiB
QUICK = 3  # a call_timeout: a write that cannot finish fails the call this soon
SLOW = 10  # a call_timeout past the executions' own timeouts (3 s, 4 s)
# How a deaf server stops: after its answer; in the middle of the next message; or while the
# host answers its own requests (20000 pings: more answers than a pipe holds).
MODES = {
    "deaf": {},
    "mid-message": {"partial": 5000},
    "pings": {"pings": 20000},
}


def entry(**fields: Any) -> dict[str, Any]:
    return script_entry("deaf.py", **fields)


# An entry per test and mode: each deaf instance ended is a crash of its entry, and crashes
# back an entry's next starts off.
CATALOG = {
    **{f"code-{mode}": entry(call_timeout=QUICK) for mode in MODES},
    **{f"slow-{mode}": entry(call_timeout=SLOW) for mode in MODES},
    **{f"cancel-{mode}": entry(call_timeout=SLOW) for mode in MODES},
    **{f"ep-{mode}": entry(call_timeout=QUICK) for mode in MODES},
    **{f"epcancel-{mode}": entry(call_timeout=SLOW) for mode in MODES},
    "slots": entry(call_timeout=SLOW, scope="session"),
    "cell": entry(call_timeout=SLOW),
    "chatty": entry(call_timeout=30, scope="shared"),
    "escaped": entry(call_timeout=QUICK),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with catalog_server(
        tmp_path_factory.mktemp("writes"),
        CATALOG,
        f"alice:{ALICE},bob:{BOB}",
        SANDBOX_MAX_CONCURRENT="3",
        SANDBOX_POOL_SIZE="0",
    ) as server:
        yield server


def rss_mb(pid: int) -> float:
    return memory_of(pid)["VmRSS"] / (1 << 20)


def code_for(name: str, mode: dict[str, int], then: str = "time.sleep(3600)") -> str:
    """Code that deafens `name` (as `mode` says), then sends it the issue's 400 KB argument."""
    return f"""
import json, time, mcp_servers
s = mcp_servers.server({name!r})
print(json.dumps(["id", s.id()]), flush=True)
print(json.dumps(["deafened", s.deafen(**{mode!r})]), flush=True)
started = time.monotonic()
try:
    s.ok(pad="x" * {PAD})
    print(json.dumps(["answered"]), flush=True)
except mcp_servers.BridgeError as exc:
    print(json.dumps([exc.kind, str(exc), round(time.monotonic() - started, 1)]), flush=True)
{then}
"""


def lines(result: dict[str, Any]) -> list[Any]:
    text = "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")
    return [json.loads(line) for line in text.splitlines() if line.startswith("[")]


async def ids_of(url: str, token: str) -> str:
    async with open_client(url, token) as conn:
        return text_of(await conn.client.call_tool("id", {}))


async def a_fresh_instance(url: str, token: str, first: str, within: float) -> float:
    """Wait until a call meets another instance than `first` (calls meanwhile may meet the
    deaf one's end); how long that took."""
    started = time.monotonic()

    async def fresh() -> bool:
        try:
            return await asyncio.wait_for(ids_of(url, token), within) != first
        except Exception as exc:  # (a call that met the deaf instance's end)
            assert "did not read its input" in message_of(exc), exc
            return False

    await eventually(fresh, within, "a fresh instance")
    return time.monotonic() - started


async def output_has(conn: Conn, execution_id: str, session: str, word: str) -> bool:
    page = await conn.ok("get_execution_output", execution_id=execution_id, session=session)
    return word in json.dumps(page["output"])


# -- code mode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_write_a_deaf_server_never_takes_fails_the_call_and_ends_it(
    server: ServerProcess, mode: str
) -> None:
    """call_timeout 3 s: the code's call fails within it, saying why; the instance is ended
    and the next call starts a fresh one."""
    started = time.monotonic()
    async with open_client(server.url, ALICE) as conn:
        result = await conn.ok(
            "execute_code",
            command=["python3", "-c", code_for(f"code-{mode}", MODES[mode], then="")],
            servers=[f"code-{mode}"],
            timeout_seconds=60,
        )
    took = time.monotonic() - started
    got = lines(result)
    print(f"{mode}: the execution took {took:.1f} s; it printed {got}")
    assert result["status"] == "completed", result
    (_, first), (_, deafened), (kind, message, waited) = got
    assert deafened.startswith("deaf after"), got
    assert kind == "failed" and "did not read its input" in message, got
    assert waited < QUICK + 5, got
    assert took < 30, took
    fresh = await ids_of(f"{server.base_url}/servers/code-{mode}/mcp", ALICE)
    assert fresh != first, "the deaf instance was not ended"


@pytest.mark.parametrize("mode", list(MODES))
async def test_an_execution_stuck_on_a_deaf_server_ends_by_its_timeout(
    server: ServerProcess, mode: str
) -> None:
    """The issue's reproduction: call_timeout 10 s, the execution's timeout 3 s. The execution
    ends by its timeout (its bridge's call is abandoned, the cancel never waits on the pipe),
    the instance is ended once its input has waited a call timeout, and the next call starts
    a fresh one."""
    rss_before = rss_mb(server.pid)
    started = time.monotonic()
    async with open_client(server.url, ALICE) as conn:
        result = await conn.ok(
            "execute_code",
            command=["python3", "-c", code_for(f"slow-{mode}", MODES[mode])],
            servers=[f"slow-{mode}"],
            timeout_seconds=3,
        )
    took = time.monotonic() - started
    print(f"{mode}: ended in {took:.1f} s as {result['status']}; RSS {rss_before:.0f} MB -> "
          f"{rss_mb(server.pid):.0f} MB")  # fmt: skip
    assert result["status"] == "timeout", result
    assert took < 15, f"the execution took {took:.1f} s (its timeout is 3 s)"
    (_, first), (_, deafened) = lines(result)[:2]
    assert deafened.startswith("deaf after"), deafened
    url = f"{server.base_url}/servers/slow-{mode}/mcp"
    took = await a_fresh_instance(url, ALICE, first, 3 * SLOW)
    print(f"{mode}: a fresh instance answered {took:.1f} s after")


@pytest.mark.parametrize("mode", list(MODES))
async def test_cancel_execution_answers_while_its_call_writes_to_a_deaf_server(
    server: ServerProcess, mode: str
) -> None:
    """cancel_execution answers at once while the execution's call is being written to a
    deaf server (before: never, and the execution stayed running)."""
    session = f"cancel-{mode}"
    async with open_client(server.url, BOB) as conn:
        execution = await conn.ok(
            "execute_code_async",
            command=["python3", "-c", code_for(f"cancel-{mode}", MODES[mode])],
            servers=[f"cancel-{mode}"],
            timeout_seconds=60,
            session=session,
        )
        execution_id = execution["execution_id"]
        try:
            await eventually(
                lambda: output_has(conn, execution_id, session, "deafened"), 20, "deafened"
            )
        finally:
            started = time.monotonic()
            cancelled = await asyncio.wait_for(
                conn.ok("cancel_execution", execution_id=execution_id, session=session), 20
            )
        took = time.monotonic() - started
        print(f"{mode}: cancel_execution answered in {took:.2f} s")
        assert cancelled["success"], cancelled
        assert took < 10, took
        status = await conn.ok("get_execution_status", execution_id=execution_id, session=session)
        assert status["status"] == "cancelled", status


async def test_a_run_code_cell_stuck_on_a_deaf_server_ends_by_its_timeout(
    server: ServerProcess,
) -> None:
    """In an interpreter: the cell ends by its timeout, and the session's next call runs (the
    cell's bridge is closed after it within a short grace, whatever its call waits on)."""
    code = (
        "import mcp_servers\n"
        "s = mcp_servers.server('cell')\n"
        "print(s.deafen(), flush=True)\n"
        f"s.ok(pad='x' * {PAD})\n"
    )
    async with open_client(server.url, BOB) as conn:
        started = time.monotonic()
        stuck = await conn.ok(
            "run_code", code=code, servers=["cell"], timeout_seconds=3, session="cell"
        )
        took = time.monotonic() - started
        assert stuck["status"] == "timeout", stuck
        started = time.monotonic()
        after = await conn.ok("run_code", code="print(6 * 7)", session="cell")
        later = time.monotonic() - started
    print(
        f"the stuck cell took {took:.1f} s (with its interpreter's start); the next {later:.1f} s"
    )
    assert "42" in json.dumps(after["output"]), after
    assert later < 10, later


async def test_three_stuck_executions_free_their_slots_by_their_timeout(
    server: ServerProcess,
) -> None:
    """SANDBOX_MAX_CONCURRENT=3: bob's three executions stuck on a deaf server take every
    slot, and end by their timeout; alice's plain execution then runs."""
    rss_before = rss_mb(server.pid)
    async with open_client(server.url, BOB) as conn:
        held = [
            (
                await conn.ok(
                    "execute_code_async",
                    command=["python3", "-c", code_for("slots", MODES["deaf"])],
                    servers=["slots"],
                    timeout_seconds=4,
                    session=f"slots-{n}",
                )
            )["execution_id"]
            for n in range(3)
        ]
    started = time.monotonic()
    refused = 0

    async def alice_runs() -> bool:
        nonlocal refused
        async with open_client(server.url, ALICE) as conn:
            result = await conn.call("execute_code", command=["echo", "mine"])
        if result.is_error:
            assert "maximum of 3" in text_of(result), text_of(result)
            refused += 1
            return False
        return "mine" in json.dumps(result.structured_content)

    await eventually(alice_runs, 30, "alice's execution")
    waited = time.monotonic() - started
    peak = rss_mb(server.pid)
    print(
        f"alice ran after {waited:.1f} s ({refused} refused); RSS {rss_before:.0f} -> {peak:.0f} MB"
    )
    assert refused, "bob's executions did not hold every slot"
    assert waited < 20, waited
    async with open_client(server.url, BOB) as conn:
        for n, execution_id in enumerate(held):

            async def ended(n: int = n, execution_id: str = execution_id) -> str | None:
                status = await conn.ok(
                    "get_execution_status", execution_id=execution_id, session=f"slots-{n}"
                )
                return None if status["status"] == "running" else str(status["status"])

            assert await eventually(ended, 10, "its timeout") == "timeout"


# -- /servers/NAME/mcp --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
async def test_an_endpoint_call_to_a_deaf_server_fails_in_time(
    server: ServerProcess, mode: str
) -> None:
    url = f"{server.base_url}/servers/ep-{mode}/mcp"
    async with open_client(url, BOB) as conn:
        first = text_of(await conn.client.call_tool("id", {}))
        deafened = text_of(await conn.client.call_tool("deafen", MODES[mode]))
        assert deafened.startswith("deaf after"), deafened
        started = time.monotonic()
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("ok", {"pad": "x" * PAD})
        took = time.monotonic() - started
        print(f"{mode}: failed after {took:.1f} s: {message_of(failed.value)[:200]}")
        assert "did not read its input" in message_of(failed.value), failed.value
        assert took < QUICK + 5, took
        assert text_of(await conn.client.call_tool("id", {})) != first


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_cancelled_endpoint_call_never_waits_on_a_deaf_server(
    server: ServerProcess, mode: str
) -> None:
    """The client cancels its call while the host writes it to a deaf server: the cancel is
    dropped (the pipe is not draining) instead of waiting; the next calls are answered (the
    instance is ended once its input has waited a call timeout, then a fresh one starts)."""
    url = f"{server.base_url}/servers/epcancel-{mode}/mcp"
    async with open_client(url, ALICE) as conn:
        first = text_of(await conn.client.call_tool("id", {}))
        await conn.client.call_tool("deafen", MODES[mode])
        call = asyncio.ensure_future(conn.client.call_tool("ok", {"pad": "x" * PAD}))
        await asyncio.sleep(0.5)  # (the write has begun: the pipe is full well before)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # (This client stays open meanwhile: its cancelled call's reply may come late.)
        took = await a_fresh_instance(url, ALICE, first, 3 * SLOW)
    print(f"{mode}: a fresh instance answered {took:.1f} s after")


# -- callers that do not read -------------------------------------------------------------------


def unread_call(
    server: ServerProcess, path: str, token: str, body: dict[str, Any]
) -> socket.socket:
    """POST `body` in a legacy session of its own on a socket that is never read (a small
    receive buffer: the server's writes back up at once)."""
    with httpx2.Client(timeout=10) as http:
        headers = {
            "Authorization": f"Bearer {token}",
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
        }
        init = {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "unread", "version": "1"},
            },
        }
        response = http.post(f"{server.base_url}{path}", json=init, headers=headers)
        assert response.status_code == 200, response.text
        headers["Mcp-Session-Id"] = response.headers["mcp-session-id"]
        headers["Mcp-Protocol-Version"] = "2025-11-25"
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        http.post(f"{server.base_url}{path}", json=note, headers=headers)
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(head.encode() + payload)
    return sock


async def test_a_caller_that_never_reads_does_not_stall_a_shared_instance(
    server: ServerProcess,
) -> None:
    """Alice's call floods progress (50000 notifications of 1 KB) on a stream she never reads;
    bob's calls to the same shared instance are answered meanwhile, and the server's memory
    stays bounded (her notifications past a small queue are dropped)."""
    url = f"{server.base_url}/servers/chatty/mcp"
    async with open_client(url, BOB) as conn:
        assert text_of(await conn.client.call_tool("ok", {})) == "fine"
    rss_before = rss_mb(server.pid)
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {
            "name": "chatter",
            "arguments": {"count": 50000, "size": 1000},
            "_meta": {"progressToken": "unread"},
        },
    }
    sock = unread_call(server, "/servers/chatty/mcp", ALICE, body)
    try:
        peak, latencies = rss_before, []
        async with open_client(url, BOB) as conn:
            for _ in range(10):
                started = time.monotonic()
                assert text_of(await conn.client.call_tool("ok", {})) == "fine"
                latencies.append(time.monotonic() - started)
                peak = max(peak, rss_mb(server.pid))
                await asyncio.sleep(0.3)
        print(
            f"bob's calls while alice's stream is unread: {[round(x, 2) for x in latencies]} s;"
            f" RSS {rss_before:.0f} -> peak {peak:.0f} MB"
        )
        assert max(latencies) < 5, latencies  # (call_timeout is 30 s)
        assert peak - rss_before < 200, (rss_before, peak)
        # Her call ended (the flood was read and the answer came) with most of it dropped.
        await eventually(
            lambda: "notifications dropped for a caller" in server.stderr_text(), 30, "the drops"
        )
    finally:
        sock.close()


async def test_a_caller_that_reads_gets_a_burst_of_progress_in_order_ending_with_the_last(
    server: ServerProcess,
) -> None:
    """A server that sends 300 progress notifications at once, then its answer: a caller that
    reads its stream gets them in order, the last one included, before the answer (a burst
    past the caller's queue drops the oldest waiting, never the newest)."""
    seen: list[float] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append(value)

    async with open_client(f"{server.base_url}/servers/chatty/mcp", BOB) as conn:
        result = await conn.client.call_tool(
            "chatter", {"count": 300, "size": 10}, progress_callback=progress
        )
    assert text_of(result) == "chatted 300"
    print(f"a burst of 300 progress notifications: {len(seen)} delivered")
    assert seen and seen[-1] == 300, seen[-5:]
    assert seen == sorted(seen) and len(set(seen)) == len(seen), seen
    assert len(seen) >= MAX_QUEUED_NOTIFICATIONS, len(seen)


async def test_arguments_json_cannot_carry_as_utf8_are_sent_escaped(server: ServerProcess) -> None:
    """A lone surrogate (valid JSON text, no UTF-8) in a code-mode call's arguments: the call is
    answered and leaves nothing pending on the instance (each such call once did, for ever)."""
    code = (
        "import json, socket, struct, os\n"
        "for _ in range(3):\n"
        "    s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MCP_SERVERS_SOCKET'])\n"
        '    body = b\'{"op":"call","server":"escaped","tool":"ok",\'\n'
        '    body += b\'"arguments":{"a":"\\\\ud800"}}\'\n'
        "    s.sendall(struct.pack('>I', len(body)) + body)\n"
        "    size = struct.unpack('>I', s.recv(4))[0]\n"
        "    data = b''\n"
        "    while len(data) < size: data += s.recv(size - len(data))\n"
        "    print(json.loads(data)['ok'])\n"
    )
    async with open_client(server.url, ALICE) as conn:
        result = await conn.ok(
            "execute_code",
            command=["python3", "-c", code],
            servers=["escaped"],
            timeout_seconds=60,
        )
    out = "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")
    assert out.split() == ["True", "True", "True"], result
