"""Code mode in run_code: a cell's bridge is that cell's. A thread, an asyncio task or a
process a cell left running cannot call servers once its cell has ended: not while a later
cell runs without servers, and not through a later cell's own bridge (whose events and
budget are its own calls only). What a cell starts and waits for still calls as the cell."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hosted_harness import catalog_server, script_entry
from mcp_harness import ServerProcess, open_client

pytestmark = pytest.mark.e2e

ALICE = "cells-alice-token-0123456789"
CATALOG = {"echoenv": script_entry("echoenv.py")}
ENDED = "ended: the run_code call that allowed these servers has ended"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with catalog_server(tmp_path_factory.mktemp("cells"), CATALOG, f"alice:{ALICE}") as server:
        yield server


def stdout(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


def tool_calls(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in result["output"] if e["type"] == "tool_call"]


# What each left-over caller appends to `seen` per call: "ok", or "KIND: MESSAGE". The cell
# that starts it waits (within its timeout) until one of its calls went through.
THREAD = """
import asyncio, threading, mcp_servers
from mcp_servers import echoenv
seen, stop = [], threading.Event()
def calls():
    while not stop.is_set():
        try:
            echoenv.echo(text="left-over")
            seen.append("ok")
        except mcp_servers.BridgeError as exc:
            seen.append(f"{exc.kind}: {exc}")
        stop.wait(0.1)
threading.Thread(target=calls, daemon=True).start()
while "ok" not in seen:
    await asyncio.sleep(0.05)
"""
TASK = """
import asyncio, mcp_servers
from mcp_servers import echoenv
seen = []
async def calls():
    while True:
        try:
            await echoenv.echo.aio(text="left-over")
            seen.append("ok")
        except mcp_servers.BridgeError as exc:
            seen.append(f"{exc.kind}: {exc}")
        await asyncio.sleep(0.1)
task = asyncio.create_task(calls())
while "ok" not in seen:
    await asyncio.sleep(0.05)
"""
PROCESS = '''
import asyncio, subprocess, sys
LOOP = """
import time, mcp_servers
from mcp_servers import echoenv
while True:
    try:
        echoenv.echo(text="left-over")
        line = "ok"
    except mcp_servers.BridgeError as exc:
        line = f"{exc.kind}: {exc}"
    with open("/tmp/left-over.log", "a") as log:
        log.write(line + "\\\\n")
    time.sleep(0.1)
"""
process = subprocess.Popen([sys.executable, "-c", LOOP])
class Seen:  # the log's lines, as `seen`
    def __len__(self): return len(self[:])
    def __getitem__(self, part):
        try:
            return open("/tmp/left-over.log").read().splitlines()[part]
        except FileNotFoundError:
            return [][part]
    def __contains__(self, line): return line in self[:]
seen = Seen()
while "ok" not in seen:
    await asyncio.sleep(0.05)
'''
# A later cell without servers: what the left-over's next calls got (the first may have been
# under way when the first cell ended).
WITHOUT = """
import asyncio, json
n = len(seen)
while len(seen) < n + 3:
    await asyncio.sleep(0.05)
print(json.dumps(seen[n + 1 : n + 3]))
"""
# A later cell with servers: its own three calls while the left-over keeps calling.
WITH = """
import asyncio, json
from mcp_servers import echoenv
n = len(seen)
mine = [echoenv.echo(text=f"mine{i}")["text"] for i in range(3)]
while len(seen) < n + 3:
    await asyncio.sleep(0.05)
print(json.dumps({"mine": mine, "left_over": seen[n:]}))
"""
STOP = {"thread": "stop.set()", "task": "task.cancel()", "process": "process.kill()"}
# While no bridge is open, a process (which cannot know the interpreter's cell) says both.
NO_BRIDGE = "(the run_code call that started this process named no servers, or has ended)"


@pytest.mark.parametrize(
    ("kind", "start"), [("thread", THREAD), ("task", TASK), ("process", PROCESS)]
)
async def test_what_a_cell_left_running_cannot_call_after_it(
    server: ServerProcess, kind: str, start: str
) -> None:
    async with open_client(server.url, ALICE) as conn:
        session = f"cells-{kind}"
        first = await conn.ok("run_code", code=start, servers=["echoenv"], session=session)
        assert first["status"] == "completed", first
        assert tool_calls(first), first  # (its own calls, while it ran)
        assert all("left-over" in c["message"] for c in tool_calls(first)), first
        try:
            without = await conn.ok("run_code", code=WITHOUT, session=session)
            assert without["status"] == "completed", without
            got = json.loads(stdout(without))
            if kind == "process":
                assert all(g.startswith("unavailable") and g.endswith(NO_BRIDGE) for g in got)
            else:
                assert all(g.startswith(ENDED) for g in got), got
            assert len(got) == 2, got
            assert not tool_calls(without), without

            later = await conn.ok("run_code", code=WITH, servers=["echoenv"], session=session)
            assert later["status"] == "completed", later
            got = json.loads(stdout(later))
            assert got["mine"] == ["mine0", "mine1", "mine2"], got
            assert len(got["left_over"]) >= 3, got
            assert all(g.startswith(ENDED) for g in got["left_over"]), got
            # Its events are its own three calls: none of the left-over's (nor refusals).
            calls = tool_calls(later)
            assert [c["name"] for c in calls] == ["echoenv.echo"] * 3, later
            assert all("mine" in c["message"] and c["reason"] == "ok" for c in calls), later
        finally:
            await conn.ok("run_code", code=STOP[kind], session=session)


CELL_STARTS = """
import asyncio, json, threading
from mcp_servers import echoenv
got = list(pool.map(lambda i: echoenv.echo(text=f"pool{i}")["text"], range(2)))
got.append((await asyncio.to_thread(lambda: echoenv.echo(text="to_thread")))["text"])
got.append((await echoenv.echo.aio(text="aio"))["text"])
box = []
thread = threading.Thread(target=lambda: box.append(echoenv.echo(text="thread")["text"]))
thread.start()
thread.join()
print(json.dumps(got + box))
"""


async def test_what_a_cell_starts_calls_as_that_cell(server: ServerProcess) -> None:
    """A thread the cell starts, work it hands to a pool made by an earlier cell (whose
    threads that cell started) and asyncio.to_thread all call through the cell's bridge."""
    async with open_client(server.url, ALICE) as conn:
        session = "cells-starts"
        await conn.ok(
            "run_code",
            code="from concurrent.futures import ThreadPoolExecutor\n"
            "pool = ThreadPoolExecutor(2)\nlist(pool.map(abs, range(4)))",
            session=session,
        )
        result = await conn.ok("run_code", code=CELL_STARTS, servers=["echoenv"], session=session)
    assert json.loads(stdout(result)) == ["pool0", "pool1", "to_thread", "aio", "thread"], result
    assert [c["reason"] for c in tool_calls(result)] == ["ok"] * 5, result


BACKGROUND = """
import time, mcp_servers
from mcp_servers import echoenv
while True:
    try:
        echoenv.echo(text="background")
        line = "ok"
    except mcp_servers.BridgeError as exc:
        line = exc.kind
    with open("/workspace/background.log", "a") as log:
        log.write(line + "\\n")
    time.sleep(0.1)
"""
# Counts the log's lines across 0.5 s: a negative (nothing more is written) needs a window.
STILL = """
import time
def lines():
    try:
        return len(open("/workspace/background.log").read().splitlines())
    except FileNotFoundError:
        return 0
before = lines()
time.sleep(0.5)
print(before, lines())
"""


async def test_an_executions_background_process_ends_with_its_bridge(
    server: ServerProcess,
) -> None:
    """execute_code: the bridge closes when the execution ends, and a process its command
    left in the background goes with the sandbox: it calls nothing after the end."""
    async with open_client(server.url, ALICE) as conn:
        session = "cells-background"
        wait = "until grep -q ok /workspace/background.log 2>/dev/null; do sleep 0.05; done"
        result = await conn.ok(
            "execute_code",
            command=["sh", "-c", f'python3 -c "$LOOP" & {wait}; echo started'],
            environment={"LOOP": BACKGROUND},
            servers=["echoenv"],
            session=session,
            timeout_seconds=30,
        )
        assert result["exit_code"] == 0 and "started" in stdout(result), result
        assert tool_calls(result) and all(c["reason"] == "ok" for c in tool_calls(result))
        after = await conn.ok("execute_code", command=["python3", "-c", STILL], session=session)
    before, later = map(int, stdout(after).split())
    assert before == later > 0, (before, later)
