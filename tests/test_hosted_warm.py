"""`warm = 1`: a shared entry's instance is started ahead of the first call, kept while idle,
started again after it crashed (after its backoff, bounded: a server that cannot start is not
retried in a loop), and nothing of it outlives the server, even when the server stops while
the start ahead is still in flight; another scope's instance starts as its client initializes
(before any call reaches it)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from hosted_harness import SCRIPTS, catalog_server, message_of, script_entry, text_of
from mcp_harness import ServerProcess, eventually, open_client, processes_with

pytestmark = pytest.mark.e2e

TOKEN = "hosted-warm-token-0123456789"
CATALOG_DIR = str(SCRIPTS)
SLOW_SCRIPT = "/opt/srt-server/crash.py"
# A client's handshake alone (no call follows).
INITIALIZE = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {},
               "clientInfo": {"name": "test", "version": "1"}},
}  # fmt: skip
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream"}
MARK = f"--warm-mark-{uuid.uuid4().hex[:12]}"  # (in each instance's command line, on the host)
COLD_MARK = f"--cold-mark-{uuid.uuid4().hex[:12]}"
MINE_MARK = f"--mine-mark-{uuid.uuid4().hex[:12]}"
BURST_MARK = f"--burst-mark-{uuid.uuid4().hex[:12]}"

CATALOG = {
    "warm": script_entry("crash.py", MARK, scope="shared", warm=1, idle_timeout=1),
    "cold": script_entry("crash.py", COLD_MARK, scope="shared"),
    "mine": script_entry("crash.py", MINE_MARK, warm=1),  # (per principal: at initialize)
    # Per principal, slow to start (3 s before its Python does): initializes pile up meanwhile.
    "burst": {
        "command": ["/bin/sh", "-c", f"sleep 3; exec /usr/bin/python3 {SLOW_SCRIPT} {BURST_MARK}"],
        "directory": CATALOG_DIR,
        "warm": 1,
    },
    # It exits at once: every start ahead fails, each one backs the next off.
    "broken": {"command": ["/bin/false"], "scope": "shared", "warm": 1},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with catalog_server(
        tmp_path_factory.mktemp("warm"), CATALOG, f"alice:{TOKEN}", SANDBOX_POOL_SIZE="0"
    ) as server:
        yield server


def metric(server: ServerProcess, name: str, server_name: str, *labels: str) -> float:
    return server.metric(TOKEN, name, f'server="{server_name}"', *labels)


def starts(server: ServerProcess, name: str, outcome: str = "ok") -> float:
    return metric(server, "srt_hosted_server_starts_total", name, f'outcome="{outcome}"')


def running(server: ServerProcess, name: str) -> float:
    return metric(server, "srt_hosted_server_instances", name)


async def test_a_warm_instance_is_started_ahead_and_kept_while_idle(
    server: ServerProcess,
) -> None:
    await eventually(lambda: running(server, "warm") == 1, 30, "the warm instance")
    assert processes_with(MARK), "its process runs before any call"
    assert running(server, "cold") == 0 and not processes_with(COLD_MARK), "not warm: not started"
    async with open_client(f"{server.base_url}/servers/warm/mcp", TOKEN) as conn:
        assert text_of(await conn.client.call_tool("ok", {})) == "fine"
    assert starts(server, "warm") == 1, "the first call used the instance started ahead"
    # idle_timeout=1, a sweep every 5 s: a warm instance is not stopped for being idle.
    await asyncio.sleep(7)
    assert running(server, "warm") == 1 and starts(server, "warm") == 1
    async with open_client(f"{server.base_url}/servers/cold/mcp", TOKEN) as conn:
        assert text_of(await conn.client.call_tool("ok", {})) == "fine"
    assert starts(server, "cold") == 1, "not warm: started by its first call"


async def test_a_crashed_warm_instance_is_started_again_without_a_call(
    server: ServerProcess,
) -> None:
    await eventually(lambda: running(server, "warm") == 1, 30, "the warm instance")
    before = starts(server, "warm")
    async with open_client(f"{server.base_url}/servers/warm/mcp", TOKEN) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("crash", {})
        assert "exited with code 3" in message_of(failed.value), failed.value
    # (1 s of backoff after a first crash, then started ahead: no call asks for it.)
    await eventually(lambda: starts(server, "warm") == before + 1, 20, "the start ahead")
    await eventually(lambda: running(server, "warm") == 1, 10, "the restarted instance")
    assert len(processes_with(MARK)) >= 1


async def test_a_warm_server_that_cannot_start_is_retried_with_backoff(
    server: ServerProcess,
) -> None:
    await eventually(lambda: starts(server, "broken", "failed") >= 1, 30, "a first try")
    first = starts(server, "broken", "failed")
    await asyncio.sleep(8)
    tries = starts(server, "broken", "failed") - first
    # A sweep every 5 s, each try waiting out a backoff of 1, 2, 4... s: at most two more
    # in 8 s (a loop would have made hundreds).
    assert 1 <= tries <= 3, tries
    assert running(server, "broken") == 0


async def test_a_warm_entry_per_principal_starts_as_its_client_initializes(
    server: ServerProcess,
) -> None:
    assert running(server, "mine") == 0 and not processes_with(MINE_MARK)
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"},
        },
    }
    headers = {
        "Authorization": f"Bearer {TOKEN}",
        "Accept": "application/json, text/event-stream",
    }
    async with httpx2.AsyncClient(timeout=30) as http:  # (the handshake only: no call)
        reply = await http.post(
            f"{server.base_url}/servers/mine/mcp", json=initialize, headers=headers
        )
        assert reply.status_code == 200, reply.text
    await eventually(lambda: running(server, "mine") == 1, 30, "the instance started ahead")
    assert processes_with(MINE_MARK)
    async with open_client(f"{server.base_url}/servers/mine/mcp", TOKEN) as conn:
        assert text_of(await conn.client.call_tool("ok", {})) == "fine"
    assert starts(server, "mine") == 1, "its calls use the instance started at initialize"


async def test_initializes_during_a_start_ahead_leave_one_start_behind_not_one_each(
    server: ServerProcess,
) -> None:
    """Each initialize of a client on a warm entry per principal would otherwise leave a task
    of its own behind (the handshake does not wait): a client sending them while the start
    is in flight would pile up as many as it likes, each a request to the instance later."""
    async with httpx2.AsyncClient(timeout=30) as http:
        url = f"{server.base_url}/servers/burst/mcp"
        replies = await asyncio.gather(
            *(http.post(url, json=INITIALIZE, headers=HEADERS) for _ in range(20))
        )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    await eventually(lambda: running(server, "burst") == 1, 30, "the instance started ahead")
    pings = 'tool="ping"'
    await eventually(lambda: metric(server, "srt_hosted_server_calls_total", "burst", pings), 10,
                     "its ping")  # fmt: skip
    await asyncio.sleep(2)
    assert metric(server, "srt_hosted_server_calls_total", "burst", pings) == 1
    assert starts(server, "burst") == 1


def instance_processes(workdir: Path, mark: str, stop_at_once: bool) -> list[tuple[int, str]]:
    """Start a server with a warm entry marked `mark`, stop it (at once: while the start
    ahead is in flight; else once the instance runs), and return the marked processes
    left afterwards."""
    catalog = {"warm": script_entry("crash.py", mark, scope="shared", warm=1)}
    with catalog_server(workdir, catalog, f"alice:{TOKEN}", SANDBOX_POOL_SIZE="0") as server:
        if not stop_at_once:
            deadline = time.monotonic() + 30
            while not processes_with(mark):
                assert time.monotonic() < deadline, "the warm instance did not start"
                time.sleep(0.1)
        server.stop()
        return processes_with(mark)


@pytest.mark.parametrize("stop_at_once", [False, True])
def test_nothing_of_a_warm_instance_outlives_the_server(tmp_path: Path, stop_at_once: bool) -> None:
    mark = f"--warm-stop-{uuid.uuid4().hex[:12]}"
    assert instance_processes(tmp_path, mark, stop_at_once) == []


def test_nothing_of_a_start_ahead_at_initialize_outlives_the_server(tmp_path: Path) -> None:
    """An instance per principal started as its client initialized, stopped while it starts
    (its program still in `sleep`, before its initialize): nothing of it is left."""
    mark = f"--mine-stop-{uuid.uuid4().hex[:12]}"
    command = ["/bin/sh", "-c", f"sleep 3; exec /usr/bin/python3 {SLOW_SCRIPT} {mark}"]
    catalog = {"mine": {"command": command, "directory": CATALOG_DIR, "warm": 1}}
    with catalog_server(tmp_path, catalog, f"alice:{TOKEN}", SANDBOX_POOL_SIZE="0") as server:
        reply = httpx2.post(f"{server.base_url}/servers/mine/mcp", json=INITIALIZE,
                            headers=HEADERS, timeout=30)  # fmt: skip
        assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 30
        while not processes_with(mark):
            assert time.monotonic() < deadline, "the instance did not start"
            time.sleep(0.05)
        server.stop()
        assert processes_with(mark) == []
