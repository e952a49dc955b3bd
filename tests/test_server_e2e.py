"""The single-instance service end to end: the real server process, real HTTP, the official MCP
client in both protocol eras, real bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp.types import TextContent
from mcp_harness import (
    Conn,
    Mode,
    ServerProcess,
    Servers,
    alive,
    client_in_task,
    open_client,
    proc_uid,
    processes_with,
    run_server_once,
    sandbox_uid,
)

pytestmark = pytest.mark.e2e

PYTHON = "/usr/bin/python3"
ALICE = "tok-alice-0123456789"
BOB = "tok-bob-0123456789"
TOKENS = f"alice:{ALICE},bob:{BOB}"
MAX_TIMEOUT = 600
MAX_WAIT = 3.0
CANCEL_GRACE = 1.0
MODES: list[Mode] = ["legacy", "auto"]

Event = dict[str, Any]


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    """The module's server: two principals, default limits, short waits and grace."""
    return serve(
        "srv",
        SANDBOX_AUTH_TOKENS=TOKENS,
        SANDBOX_MAX_TIMEOUT=str(MAX_TIMEOUT),
        SANDBOX_MAX_WAIT=str(MAX_WAIT),
        SANDBOX_CANCEL_GRACE=str(CANCEL_GRACE),
    )


@pytest.fixture(scope="module")
def limited_server(serve: Servers) -> ServerProcess:
    """A server with tiny limits: two executions per session, 1 MiB of output each."""
    return serve(
        "limited",
        SANDBOX_AUTH_TOKEN=ALICE,
        SANDBOX_MAX_PER_SESSION="2",
        SANDBOX_OUTPUT_LIMIT_BYTES=str(1024 * 1024),
        SANDBOX_CANCEL_GRACE="0.5",
    )


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Mode:
    mode: Mode = request.param
    return mode


@pytest.fixture
async def alice(server: ServerProcess, mode: Mode) -> AsyncIterator[Conn]:
    """Alice, connected in the test's protocol era; her running executions are cancelled after."""
    async with client_in_task(server.url, ALICE, mode) as conn:
        yield conn
        listed = await conn.ok("list_executions", status="running")
        for info in listed["result"]:
            await conn.call("cancel_execution", execution_id=info["id"], force=True)
    assert server.health()["status"] == "ok"


# -- helpers ----------------------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def stdout_of(events: list[Event], kind: str = "stdout") -> str:
    return "".join(e.get("data", "") for e in events if e["type"] == kind)


def types_of(events: list[Event]) -> list[str]:
    return [e["type"] for e in events]


def event_id(event: Event) -> int:
    """An event's position: its event_id (a string of digits) as a number."""
    text = event["event_id"]
    assert isinstance(text, str) and text == str(int(text)), event
    return int(text)


def assert_well_formed(events: list[Event]) -> None:
    """Event ids strictly increase by one, `ready` comes first and `exit` last; events carry
    0.2's fields (`event_id`, `ts`), not the stored ones (`seq`, `timestamp`)."""
    seqs = [event_id(e) for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    assert all("seq" not in e and "timestamp" not in e for e in events), events[:3]
    assert all(isinstance(e["ts"], float) for e in events)
    assert events[0]["type"] == "ready"
    assert events[-1]["type"] == "exit"
    assert types_of(events).count("exit") == 1


async def start(conn: Conn, command: str | list[str], **options: Any) -> str:
    """execute_code_async; returns the execution id."""
    result = await conn.ok("execute_code_async", command=command, **options)
    assert result["status"] == "running", result
    assert result["session"] == options.get("session", "default")
    assert "get_execution_output" in result["message"], result  # what to do next
    execution_id: str = result["execution_id"]
    return execution_id


async def follow(
    conn: Conn,
    execution_id: str,
    until: Callable[[list[Event]], bool] | None = None,
    patience: float = 30.0,
    **options: Any,
) -> list[Event]:
    """Long-poll output from the start until `until(events)` holds (default: the exit event)."""
    until = until or (lambda events: bool(events) and events[-1]["type"] == "exit")
    events: list[Event] = []
    cursor = "0"
    deadline = time.monotonic() + patience
    while not until(events):
        assert time.monotonic() < deadline, f"gave up after {patience:g}s; saw {events[-5:]}"
        page = await conn.ok(
            "get_execution_output",
            execution_id=execution_id,
            last_event_id=cursor,
            wait=True,
            wait_seconds=1.0,
            **options,
        )
        events += page["output"]
        cursor = page["next_cursor"]
    return events


async def read_all(conn: Conn, execution_id: str, limit: int = 1000, **options: Any) -> list[Event]:
    """Every event of an execution, page by page through next_cursor/has_more (no waiting)."""
    events: list[Event] = []
    cursor = "0"
    while True:
        page = await conn.ok(
            "get_execution_output",
            execution_id=execution_id,
            last_event_id=cursor,
            limit=limit,
            **options,
        )
        assert len(page["output"]) <= limit
        events += page["output"]
        cursor = page["next_cursor"]
        if not page["has_more"]:
            return events
        assert page["output"], "has_more with an empty page"


async def wait_for_health_ok(server: ServerProcess) -> None:
    body = await asyncio.to_thread(server.health)
    assert body["status"] == "ok"


# -- execute_code ------------------------------------------------------------------------------


async def test_execute_code_waits_and_returns_exit_code_and_ordered_events(alice: Conn) -> None:
    result = await alice.ok(
        "execute_code",
        command="echo out1; echo err1 >&2; echo out2; echo err2 >&2; exit 3",
    )
    assert result["status"] == "completed"
    assert result["exit_code"] == 3
    assert result["duration_ms"] >= 0
    events = result["output"]
    assert_well_formed(events)
    assert stdout_of(events) == "out1\nout2\n"
    assert stdout_of(events, "stderr") == "err1\nerr2\n"
    assert events[-1]["code"] == 3
    assert result["next_cursor"] == events[-1]["event_id"]
    assert result["has_more"] is False


async def test_execute_code_of_an_argv_list_runs_without_a_shell(alice: Conn) -> None:
    result = await alice.ok("execute_code", command=["/bin/echo", "$HOME", "a  b"])
    assert result["exit_code"] == 0
    assert stdout_of(result["output"]) == "$HOME a  b\n"


async def test_execute_code_reports_output_as_progress_while_it_waits(alice: Conn) -> None:
    arrivals: list[tuple[float, str]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        arrivals.append((time.monotonic(), message or ""))

    result = await alice.call(
        "execute_code",
        progress=on_progress,
        command="echo first-line; sleep 1.5; echo second-line",
    )
    returned = time.monotonic()
    assert not result.is_error
    assert result.structured_content is not None
    assert result.structured_content["exit_code"] == 0
    early = [t for t, message in arrivals if "first-line" in message]
    assert early, f"no progress carried the first line: {arrivals}"
    assert returned - early[0] > 1.0, "the first line's progress came only at the end"
    assert any("second-line" in message for _, message in arrivals)


async def test_timeout_ends_an_execution_with_status_timeout_and_an_exit_code(alice: Conn) -> None:
    started = time.monotonic()
    result = await alice.ok("execute_code", command="echo begun; sleep 30", timeout_seconds=1)
    assert time.monotonic() - started < 10
    assert result["status"] == "timeout"
    assert result["exit_code"] is not None
    assert result["reason"] == "timeout"
    events = result["output"]
    assert_well_formed(events)
    assert "timeout" in types_of(events)
    assert stdout_of(events) == "begun\n"
    status = await alice.ok("get_execution_status", execution_id=result["execution_id"])
    assert status["status"] == "timeout"
    assert status["exit_code"] == result["exit_code"]


# -- execute_code_async and polling -----------------------------------------------------------


async def test_async_execution_is_polled_with_cursors_until_exit(alice: Conn) -> None:
    started = time.monotonic()
    execution_id = await start(alice, "for i in 1 2 3 4; do echo tick$i; sleep 0.3; done")
    assert time.monotonic() - started < 5, "execute_code_async did not return at once"

    events = await follow(alice, execution_id)
    assert_well_formed(events)
    assert stdout_of(events) == "tick1\ntick2\ntick3\ntick4\n"
    assert events[-1]["code"] == 0

    # The cursor is `last_event_id` (an event's id, a string), and reading never consumes.
    middle = events[2]["event_id"]
    by_id = await alice.ok("get_execution_output", execution_id=execution_id, last_event_id=middle)
    assert by_id["output"] == events[int(middle) :]
    assert by_id["next_cursor"] == events[-1]["event_id"]
    assert by_id["first_event_id"] == "1"
    at_end = await alice.ok(
        "get_execution_output", execution_id=execution_id, last_event_id=events[-1]["event_id"]
    )
    assert at_end["output"] == []
    assert at_end["next_cursor"] == events[-1]["event_id"]
    assert at_end["status"] == "completed"
    assert at_end["message"] is None
    again = await alice.ok("get_execution_output", execution_id=execution_id)
    assert again["output"] == events


async def test_output_pages_honour_limit_and_has_more(alice: Conn) -> None:
    execution_id = await start(alice, "for i in $(seq 1 20); do echo n$i; sleep 0.01; done")
    events = await follow(alice, execution_id)
    total = len(events)
    assert total >= 12

    first = await alice.ok("get_execution_output", execution_id=execution_id, limit=5)
    assert [event_id(e) for e in first["output"]] == [1, 2, 3, 4, 5]
    assert first["has_more"] is True
    assert first["next_cursor"] == "5"
    paged = await read_all(alice, execution_id, limit=5)
    assert paged == events
    last = await alice.ok(
        "get_execution_output", execution_id=execution_id, last_event_id=str(total - 2), limit=5
    )
    assert len(last["output"]) == 2
    assert last["has_more"] is False


async def test_long_poll_wait_is_bounded_when_nothing_happens(alice: Conn) -> None:
    execution_id = await start(alice, "sleep 30")
    ready = await follow(alice, execution_id, until=lambda ev: "ready" in types_of(ev))
    cursor = ready[-1]["event_id"]

    started = time.monotonic()
    page = await alice.ok(
        "get_execution_output",
        execution_id=execution_id,
        last_event_id=cursor,
        wait=True,
        wait_seconds=1,
    )
    took = time.monotonic() - started
    assert page["output"] == []
    assert page["status"] == "running"
    assert page["next_cursor"] == cursor
    assert 0.8 <= took < 5, took

    # Asking for longer than the server's maximum waits only the maximum.
    started = time.monotonic()
    page = await alice.ok(
        "get_execution_output",
        execution_id=execution_id,
        last_event_id=cursor,
        wait=True,
        wait_seconds=500,
    )
    took = time.monotonic() - started
    assert page["output"] == []
    assert MAX_WAIT - 0.3 <= took < MAX_WAIT + 3, took


async def test_long_poll_returns_as_soon_as_output_arrives(alice: Conn) -> None:
    """wait_for=\"output\": the long-poll (plain wait=true waits for the end, as 0.2 did)."""
    execution_id = await start(alice, "cat", interactive=True)
    ready = await follow(alice, execution_id, until=lambda ev: "ready" in types_of(ev))
    started = time.monotonic()
    poll = asyncio.create_task(
        alice.ok(
            "get_execution_output",
            execution_id=execution_id,
            last_event_id=ready[-1]["event_id"],
            wait=True,
            wait_for="output",
            wait_seconds=MAX_WAIT,
        )
    )
    await alice.ok("send_stdin", execution_id=execution_id, input_data="late\n")
    page = await poll
    took = time.monotonic() - started
    assert stdout_of(page["output"]) == "late\n"
    assert took < MAX_WAIT - 1, took


# -- stdin ------------------------------------------------------------------------------------


async def test_send_stdin_feeds_an_interactive_cat_and_close_stdin_ends_it(alice: Conn) -> None:
    execution_id = await start(alice, "cat", interactive=True)
    sent = await alice.ok("send_stdin", execution_id=execution_id, input_data="hello\n")
    assert sent == {
        "success": True,
        "execution_id": execution_id,
        "status": "running",
        "bytes_written": 6,
        "stdin_open": True,
    }
    await follow(alice, execution_id, until=lambda ev: stdout_of(ev) == "hello\n")
    sent = await alice.ok(
        "send_stdin", execution_id=execution_id, input_data="wörld\n", close_stdin=True
    )
    assert sent["bytes_written"] == len("wörld\n".encode())
    assert sent["stdin_open"] is False
    events = await follow(alice, execution_id)
    assert_well_formed(events)
    assert stdout_of(events) == "hello\nwörld\n"
    assert events[-1]["code"] == 0
    status = await alice.ok("get_execution_status", execution_id=execution_id)
    assert status["status"] == "completed"
    assert status["stdin_open"] is False


async def test_send_stdin_drives_a_python_read_eval_loop(alice: Conn) -> None:
    program = (
        "import sys\n"
        "print('ready>', flush=True)\n"
        "for line in sys.stdin:\n"
        "    print(repr(eval(line)), flush=True)\n"
    )
    execution_id = await start(alice, [PYTHON, "-c", program], interactive=True)
    await follow(alice, execution_id, until=lambda ev: "ready>" in stdout_of(ev))
    await alice.ok("send_stdin", execution_id=execution_id, input_data="6 * 7\n")
    await follow(alice, execution_id, until=lambda ev: "42\n" in stdout_of(ev))
    await alice.ok("send_stdin", execution_id=execution_id, input_data="'ab' * 3\n")
    await follow(alice, execution_id, until=lambda ev: "'ababab'\n" in stdout_of(ev))
    await alice.ok("send_stdin", execution_id=execution_id, input_data="", close_stdin=True)
    events = await follow(alice, execution_id)
    assert stdout_of(events) == "ready>\n42\n'ababab'\n"
    assert events[-1]["code"] == 0


# -- cancel -----------------------------------------------------------------------------------


async def test_graceful_cancel_sends_sigterm_before_killing(alice: Conn) -> None:
    program = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    print('got SIGTERM', flush=True)\n"
        "    sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('waiting', flush=True)\n"
        "time.sleep(60)\n"
    )
    execution_id = await start(alice, [PYTHON, "-c", program])
    await follow(alice, execution_id, until=lambda ev: "waiting" in stdout_of(ev))
    result = await alice.ok("cancel_execution", execution_id=execution_id)
    assert result["success"] is True
    assert result["status"] == "cancelled"
    assert result["was_running"] is True
    assert result["exit_code"] == 7
    events = await read_all(alice, execution_id)
    assert_well_formed(events)
    assert stdout_of(events) == "waiting\ngot SIGTERM\n"
    assert "cancelled" in types_of(events)
    assert events[-1]["code"] == 7


CHILD = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", sys.argv[1], "grandchild-" + sys.argv[2]],
                 start_new_session=True)
time.sleep(1000)
"""
GRANDCHILD = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("grandchild up", flush=True)
time.sleep(1000)
"""


@pytest.mark.parametrize("force", [False, True], ids=["graceful", "force"])
async def test_cancel_kills_the_whole_tree_including_a_grandchild_ignoring_sigterm(
    alice: Conn, force: bool
) -> None:
    marker = unique("srt-e2e-tree")
    execution_id = await start(alice, [PYTHON, "-c", CHILD, GRANDCHILD, marker])
    await follow(alice, execution_id, until=lambda ev: "grandchild up" in stdout_of(ev))
    grandchildren = [
        pid for pid, cmdline in processes_with(f"grandchild-{marker}") if "-c" in cmdline
    ]
    assert grandchildren, "the grandchild is not visible on the host"
    assert all(proc_uid(pid) == sandbox_uid() for pid in grandchildren)

    started = time.monotonic()
    result = await alice.ok("cancel_execution", execution_id=execution_id, force=force)
    took = time.monotonic() - started
    assert result["status"] == "cancelled"
    assert result["exit_code"] is not None
    assert took < (1.0 if force else CANCEL_GRACE + 3.0), took
    # cancel_execution returns once the execution has ended; the host must agree.
    deadline = time.monotonic() + 2
    while left := processes_with(marker):
        assert time.monotonic() < deadline, f"still running after cancel: {left}"
        await asyncio.sleep(0.02)
    events = await read_all(alice, execution_id)
    assert_well_formed(events)
    assert "cancelled" in types_of(events)


async def test_cancel_after_the_end_and_a_second_cancel_change_nothing(alice: Conn) -> None:
    done = await alice.ok("execute_code", command="exit 4")
    answer = await alice.ok("cancel_execution", execution_id=done["execution_id"])
    assert answer["success"] is True
    assert answer["was_running"] is False
    assert answer["status"] == "completed"
    assert answer["exit_code"] == 4

    execution_id = await start(alice, "sleep 30")
    first = await alice.ok("cancel_execution", execution_id=execution_id, force=True)
    second = await alice.ok("cancel_execution", execution_id=execution_id)
    assert first["was_running"] is True
    assert second["was_running"] is False
    assert first["status"] == second["status"] == "cancelled"
    assert first["exit_code"] == second["exit_code"] is not None
    events = await read_all(alice, execution_id)
    assert types_of(events).count("cancelled") == 1
    assert types_of(events).count("exit") == 1


async def test_a_cancel_racing_the_sandbox_start_reports_cancelled_not_failed(
    alice: Conn,
) -> None:
    for _ in range(5):
        execution_id = await start(alice, "sleep 30")
        result = await alice.ok("cancel_execution", execution_id=execution_id, force=True)
        assert result["status"] == "cancelled"
        assert result["exit_code"] is not None
        status = await alice.ok("get_execution_status", execution_id=execution_id)
        assert status["error_message"] is None
        assert types_of(await read_all(alice, execution_id))[-2:] == ["cancelled", "exit"]


# -- status and listing -----------------------------------------------------------------------


STATUS_FIELDS = {
    "id",
    "status",
    "command",
    "interactive",
    "started_at",
    "completed_at",
    "exit_code",
    "error_message",
    "session",
    "language",
    "working_directory",
    "timeout_seconds",
    "limits",
    "signal",
    "reason",
    "duration_ms",
    "stdout_bytes",
    "stderr_bytes",
    "dropped_bytes",
    "last_event_id",
    "stdin_open",
    "execution_count",
    "replica_id",
}


async def test_get_execution_status_reports_the_execution_record(alice: Conn) -> None:
    result = await alice.ok(
        "execute_code",
        command="printf abc; printf de >&2",
        timeout_seconds=30,
        environment={"GREETING": "hi"},
        sandbox_config={"memory_mb": 128},
    )
    status = await alice.ok("get_execution_status", execution_id=result["execution_id"])
    assert status["id"] == result["execution_id"]
    assert status["status"] == "completed"
    assert status["exit_code"] == 0
    assert status["session"] == "default"
    assert status["command"] == "printf abc; printf de >&2"
    assert status["timeout_seconds"] == 30
    assert status["limits"]["memory_mb"] == 128
    assert status["stdout_bytes"] == 3
    assert status["stderr_bytes"] == 2
    assert status["last_event_id"] == result["output"][-1]["event_id"]
    assert status["started_at"] <= status["completed_at"]
    assert status["duration_ms"] == result["duration_ms"]
    assert set(status) == STATUS_FIELDS


async def test_list_executions_filters_by_status(alice: Conn) -> None:
    session = unique("listing")
    finished = await alice.ok("execute_code", command="true", session=session)
    running = await start(alice, "sleep 30", session=session)
    try:
        everything = await alice.ok("list_executions", session=session)
        assert [i["id"] for i in everything["result"]] == [
            running,
            finished["execution_id"],
        ]
        assert len(everything["result"]) == 2
        assert all(set(i) == STATUS_FIELDS for i in everything["result"])
        assert all(i["session"] == session for i in everything["result"])
        only_running = await alice.ok("list_executions", status="running", session=session)
        assert [i["id"] for i in only_running["result"]] == [running]
        only_done = await alice.ok("list_executions", status="completed", session=session)
        assert [i["id"] for i in only_done["result"]] == [finished["execution_id"]]
        none = await alice.ok("list_executions", status="timeout", session=session)
        assert none == {"result": [], "truncated": False, "next_cursor": None}
        one = await alice.ok("list_executions", limit=1, session=session)
        assert len(one["result"]) == 1
        assert one["next_cursor"] is not None
        assert everything["next_cursor"] is None
        # The text a model reads: a line per execution (its id, how it ended, its command).
        lines = await alice.call("list_executions", session=session)
        shown = [b.text for b in lines.content if isinstance(b, TextContent)]
        assert len(shown) == 1 and len(shown[0].splitlines()) == 2, shown
        assert all(i["id"] in shown[0] for i in everything["result"])
        # As json (0.2's text): in the legacy era one JSON block per execution (none for an
        # empty list), as 0.2 sent lists; in the 2026 era one block with the JSON list.
        raw = await alice.call("list_executions", session=session, response_format="json")
        texts = [json.loads(b.text) for b in raw.content if isinstance(b, TextContent)]
        empty = await alice.call(
            "list_executions", status="timeout", session=session, response_format="json"
        )
        empty_texts = [json.loads(b.text) for b in empty.content if isinstance(b, TextContent)]
        if alice.mode == "legacy":
            assert texts == everything["result"]
            assert empty_texts == []
        else:
            assert texts == [everything["result"]]
            assert empty_texts == [[]]
    finally:
        await alice.ok("cancel_execution", execution_id=running, force=True, session=session)
    cancelled = await alice.ok("list_executions", status="cancelled", session=session)
    assert [i["id"] for i in cancelled["result"]] == [running]


async def test_list_executions_pages_through_a_long_history(alice: Conn) -> None:
    """Without `limit` a page of 10, newest first; `next_cursor` walks every older one once,
    also past executions that ended meanwhile; a cursor not ours is refused."""
    session = unique("paging")
    ids = []
    for i in range(23):
        done = await alice.ok("execute_code", command=f"echo {i}", session=session)
        ids.append(done["execution_id"])
    first = await alice.ok("list_executions", session=session)
    assert [i["id"] for i in first["result"]] == ids[::-1][:10]
    assert first["truncated"] is False and first["next_cursor"]
    rest = await alice.ok("list_executions", session=session, cursor=first["next_cursor"], limit=20)
    assert [i["id"] for i in rest["result"]] == ids[::-1][10:]
    assert rest["next_cursor"] is None
    seen, cursor = [], None
    while True:
        page = await alice.ok("list_executions", session=session, limit=4, cursor=cursor)
        seen += [i["id"] for i in page["result"]]
        assert len(page["result"]) <= 4
        if (cursor := page["next_cursor"]) is None:
            break
    assert seen == ids[::-1]
    for bad in ("nonsense", "1.5/not-an-id", "nan/" + ids[0], "/"):
        refused = await alice.call("list_executions", session=session, cursor=bad)
        assert refused.is_error
        assert "cursor is not one this server gave" in refused.content[0].text


# -- bad input --------------------------------------------------------------------------------

BAD_INPUT: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "one-megabyte-command",
        "execute_code",
        {"command": "echo " + "x" * 1024 * 1024},
        "the maximum is 122880 bytes",
    ),
    ("empty-command", "execute_code", {"command": "   "}, "command must not be empty"),
    (
        "command-of-wrong-type",
        "execute_code",
        {"command": 42},
        "command must be a string or a list, got 42",
    ),
    (
        "timeout-not-a-number",
        "execute_code",
        {"command": "true", "timeout_seconds": "soon"},
        'timeout_seconds must be a number, got "soon"',
    ),
    (
        "timeout-above-maximum",
        "execute_code_async",
        {"command": "true", "timeout_seconds": MAX_TIMEOUT + 1},
        f"exceeds the server's maximum of {MAX_TIMEOUT} seconds",
    ),
    (
        "negative-timeout",
        "execute_code",
        {"command": "true", "timeout_seconds": -1},
        "timeout_seconds must be positive",
    ),
    (
        "sandbox-config-loosening",
        "execute_code",
        {"command": "true", "sandbox_config": {"memory_mb": 10**6}},
        "a caller may only tighten the sandbox",
    ),
    (
        "sandbox-config-network",
        "execute_code",
        {"command": "true", "sandbox_config": {"network": True}},
        "this server allows no network egress",
    ),
    (
        "sandbox-config-pseudo-terminals",
        "execute_code",
        {"command": "true", "sandbox_config": {"pseudo_terminals": True}},
        "sandbox_config.pseudo_terminals: this server does not allow them",
    ),
    (
        "sandbox-config-unknown-key",
        "execute_code",
        {"command": "true", "sandbox_config": {"privileged": 1}},
        "unknown sandbox_config key 'privileged'",
    ),
    (
        "working-directory-outside",
        "execute_code",
        {"command": "true", "working_directory": "/etc"},
        "is outside the sandbox's /workspace and /tmp",
    ),
    (
        "working-directory-escaping",
        "execute_code_async",
        {"command": "true", "working_directory": "../../root"},
        "is outside the sandbox's /workspace and /tmp",
    ),
    (
        "environment-name-with-equals",
        "execute_code",
        {"command": "true", "environment": {"A=B": "x"}},
        "environment variable name 'A=B' is not valid",
    ),
    (
        "environment-name-starting-with-digit",
        "execute_code",
        {"command": "true", "environment": {"1X": "x"}},
        "environment variable name '1X' is not valid",
    ),
    (
        "environment-value-of-wrong-type",
        "execute_code",
        {"command": "true", "environment": {"X": 1}},
        "environment.X must be a string, got 1",
    ),
    (
        "bad-session-name",
        "execute_code",
        {"command": "true", "session": "no spaces/slashes"},
        "session must be 1-128 characters",
    ),
    (
        "unknown-status-filter",
        "list_executions",
        {"status": "sleeping"},
        "unknown status 'sleeping'",
    ),
    (
        "limit-of-wrong-type",
        "list_executions",
        {"limit": "many"},
        'limit must be an integer, got "many"',
    ),
    ("zero-limit", "list_executions", {"limit": 0}, "limit must be a positive integer"),
    (
        "missing-argument",
        "send_stdin",
        {"execution_id": "x"},
        "input_data is required",
    ),
    (
        "execution-id-of-wrong-type",
        "get_execution_output",
        {"execution_id": ["x"]},
        'execution_id must be a string, got ["x"]',
    ),
]


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [case[1:] for case in BAD_INPUT],
    ids=[case[0] for case in BAD_INPUT],
)
async def test_bad_input_gets_a_clear_tool_error_and_the_server_stays_healthy(
    server: ServerProcess, tool: str, arguments: dict[str, Any], message: str
) -> None:
    session = unique("refused")  # (a session of its own: "default" is every test's)
    async with open_client(server.url, ALICE, "legacy") as conn:
        text = await conn.error(tool, **{"session": session, **arguments})
        assert message in text
        assert "Traceback" not in text
        listed = await conn.ok("list_executions", session=session)
        assert len(listed["result"]) == 0, "a refused request left an execution behind"
    await wait_for_health_ok(server)


async def test_bad_cursors_get_clear_tool_errors(alice: Conn) -> None:
    done = await alice.ok("execute_code", command="true")
    execution_id = done["execution_id"]
    last = int((await alice.ok("get_execution_status", execution_id=execution_id))["last_event_id"])
    for bad in ("-1", "latest", str(last + 1), "99999999999999999999"):
        text = await alice.error(
            "get_execution_output", execution_id=execution_id, last_event_id=bad
        )
        assert text == f"Event ID {bad!r} not found (may have been evicted)"
    text = await alice.error("get_execution_output", execution_id=execution_id, after=3)
    assert "unknown argument 'after'" in text
    text = await alice.error("get_execution_output", execution_id=execution_id, limit=0)
    assert "limit must be a positive integer" in text
    text = await alice.error(
        "get_execution_output", execution_id=execution_id, wait=True, wait_seconds=-1
    )
    assert "wait_seconds must be a number >= 0" in text


async def test_unknown_and_foreign_execution_ids_are_refused_alike(
    server: ServerProcess, mode: Mode
) -> None:
    """Another owner's id answers exactly like an id that never existed."""
    unknown = uuid.uuid4().hex
    async with (
        open_client(server.url, ALICE, mode) as alice,
        open_client(server.url, BOB, mode) as bob,
    ):
        bobs = await start(bob, "sleep 30", interactive=True)
        session = unique("other")
        other_session = await start(alice, "sleep 30", interactive=True, session=session)
        calls: list[tuple[str, dict[str, Any]]] = [
            ("get_execution_output", {}),
            ("get_execution_output", {"wait": True, "wait_seconds": 0.2}),
            ("get_execution_status", {}),
            ("send_stdin", {"input_data": "x"}),
            ("cancel_execution", {}),
            ("cancel_execution", {"force": True}),
        ]
        for tool, extra in calls:
            expected = await alice.error(tool, execution_id=unknown, **extra)
            assert expected == f"execution {unknown!r} not found"
            for foreign in (bobs, other_session):
                text = await alice.error(tool, execution_id=foreign, **extra)
                assert text.replace(foreign, unknown) == expected, (tool, text)
        # Nothing happened to them: both still run and bob still sees his.
        status = await bob.ok("get_execution_status", execution_id=bobs)
        assert status["status"] == "running"
        assert status["stdin_open"] is True
        await bob.ok("cancel_execution", execution_id=bobs, force=True)
        await alice.ok("cancel_execution", execution_id=other_session, force=True, session=session)
    await wait_for_health_ok(server)


async def test_stdin_to_a_finished_or_non_interactive_execution_is_refused(alice: Conn) -> None:
    done = await alice.ok("execute_code", command="true", interactive=True)
    text = await alice.error("send_stdin", execution_id=done["execution_id"], input_data="x\n")
    assert text == f"execution {done['execution_id']} has already finished"

    execution_id = await start(alice, "sleep 30")
    text = await alice.error("send_stdin", execution_id=execution_id, input_data="x\n")
    assert "was not started with interactive=true; it has no stdin" in text

    execution_id = await start(alice, "sleep 30", interactive=True)
    text = await alice.error(
        "send_stdin",
        execution_id=execution_id,
        input_data="x" * (1024 * 1024 + 1),
        append_newline=False,
    )
    assert text == "input_data is 1048577 bytes; at most 1048576 per call"
    await alice.ok("send_stdin", execution_id=execution_id, input_data="", close_stdin=True)
    text = await alice.error("send_stdin", execution_id=execution_id, input_data="x\n")
    assert text == f"stdin of execution {execution_id} is closed"


# -- output fidelity --------------------------------------------------------------------------


async def test_a_one_megabyte_line_arrives_whole_and_in_order(alice: Conn) -> None:
    program = (
        "import sys\n"
        "sys.stdout.write(''.join('%07d,' % i for i in range(131072)))\n"
        "sys.stdout.write('\\n')\n"
    )
    expected = "".join(f"{i:07d}," for i in range(131072)) + "\n"
    assert len(expected) == 1024 * 1024 + 1
    result = await alice.ok("execute_code", command=[PYTHON, "-c", program])
    assert result["exit_code"] == 0
    events = await read_all(alice, result["execution_id"], limit=3)
    assert_well_formed(events)
    chunks = [e for e in events if e["type"] == "stdout"]
    assert len(chunks) > 1, "a 1 MiB line should be split into several events"
    assert stdout_of(events) == expected
    assert "truncated" not in types_of(events)


async def test_multibyte_characters_split_across_chunks_survive(alice: Conn) -> None:
    program = "import sys; sys.stdout.write('\u00e9\u20ac\U0001f600' * 40000)"
    result = await alice.ok("execute_code", command=[PYTHON, "-c", program])
    events = await read_all(alice, result["execution_id"])
    assert stdout_of(events) == "\u00e9\u20ac\U0001f600" * 40000
    status = await alice.ok("get_execution_status", execution_id=result["execution_id"])
    assert status["stdout_bytes"] == (2 + 3 + 4) * 40000


async def test_invalid_utf8_and_binary_output_are_decoded_with_replacement(
    alice: Conn, server: ServerProcess
) -> None:
    command = (
        r"printf 'ok\377\376ok\n'; printf 'bad\300\n' >&2; "
        "head -c 262144 /dev/urandom; printf '\\nafter-binary\\n'"
    )
    result = await alice.ok("execute_code", command=command)
    assert result["status"] == "completed"
    assert result["exit_code"] == 0
    events = await read_all(alice, result["execution_id"])
    assert_well_formed(events)
    stdout = stdout_of(events)
    assert stdout.startswith("ok\ufffd\ufffdok\n")
    assert stdout.endswith("\nafter-binary\n")
    assert "\ufffd" in stdout[10:-14], "random bytes should contain invalid UTF-8"
    assert stdout_of(events, "stderr") == "bad\ufffd\n"
    status = await alice.ok("get_execution_status", execution_id=result["execution_id"])
    assert status["stdout_bytes"] == 7 + 262144 + 14
    await wait_for_health_ok(server)


async def test_two_concurrent_long_poll_readers_both_see_every_event(
    server: ServerProcess, mode: Mode
) -> None:
    session = unique("readers")
    async with (
        open_client(server.url, ALICE, mode) as first,
        open_client(server.url, ALICE, mode) as second,
    ):
        execution_id = await start(
            first,
            "for i in $(seq 1 15); do echo line$i; echo err$i >&2; sleep 0.05; done",
            session=session,
        )
        seen_first, seen_second = await asyncio.gather(
            follow(first, execution_id, session=session),
            follow(second, execution_id, session=session),
        )
        everything = await read_all(first, execution_id, session=session)
    assert seen_first == seen_second == everything
    assert_well_formed(everything)
    assert stdout_of(everything) == "".join(f"line{i}\n" for i in range(1, 16))
    assert stdout_of(everything, "stderr") == "".join(f"err{i}\n" for i in range(1, 16))


async def test_an_output_flood_is_capped_with_a_truncated_event_while_health_stays_fast(
    limited_server: ServerProcess,
) -> None:
    total = 200 * 1000 * 1000
    limit = 1024 * 1024
    latencies: list[float] = []
    stop = asyncio.Event()

    async def probe_health() -> None:
        async with httpx2.AsyncClient(timeout=5.0) as http:
            while not stop.is_set():
                started = time.monotonic()
                resp = await http.get(f"{limited_server.base_url}/health")
                latencies.append(time.monotonic() - started)
                assert resp.status_code == 200
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.1)  # pace the probes

    async with open_client(limited_server.url, ALICE, "legacy") as conn:
        prober = asyncio.create_task(probe_health())
        try:
            execution_id = await start(conn, f"head -c {total} /dev/zero; echo done >&2")
            events = await follow(conn, execution_id, patience=90)
        finally:
            stop.set()
            await prober
        status = await conn.ok("get_execution_status", execution_id=execution_id)
        everything = await read_all(conn, execution_id)

    assert everything == events
    assert_well_formed(events)
    assert status["status"] == "completed"
    assert status["exit_code"] == 0
    assert status["stdout_bytes"] == total
    kept = sum(len(e.get("data", "")) for e in events if e["type"] in ("stdout", "stderr"))
    assert kept == limit
    assert status["dropped_bytes"] == total + len("done\n") - limit
    truncated = [e for e in events if e["type"] == "truncated"]
    assert truncated, "no truncated event"
    assert truncated[-1]["dropped_bytes"] == status["dropped_bytes"]
    assert len(latencies) >= 3
    assert max(latencies) < 1.0, latencies


async def test_status_and_list_replies_stay_readable_for_huge_commands(
    server: ServerProcess,
) -> None:
    """The official client refuses SSE events over 1 MiB: replies show command previews and
    a list is cut short (and says so) rather than grow past that."""
    session = unique("huge")
    command = ["/bin/true", "\x01" * 100_000, "\\" * 100_000]
    async with open_client(server.url, ALICE, "legacy") as conn:
        ids = []
        for _ in range(25):
            done = await conn.ok("execute_code", command=command, session=session)
            assert done["exit_code"] == 0
            ids.append(done["execution_id"])
        status = await conn.ok("get_execution_status", execution_id=ids[0], session=session)
        assert status["command"][0] == "/bin/true"
        assert status["command"][1].endswith("more characters]")
        assert len("".join(status["command"])) < 5000
        listed = await conn.ok("list_executions", session=session, limit=25)
        assert listed["truncated"] is True
        count = len(listed["result"])
        assert 1 <= count < 25
        assert [i["id"] for i in listed["result"]] == ids[::-1][:count]
        cursor = listed["next_cursor"]  # (the next page starts where this one was cut)
        rest = await conn.ok("list_executions", session=session, limit=25, cursor=cursor)
        assert [i["id"] for i in rest["result"]][:1] == ids[::-1][count : count + 1]
        few = await conn.ok("list_executions", session=session, limit=3)
        assert few["truncated"] is False
        assert [i["id"] for i in few["result"]] == ids[::-1][:3]


# -- owners -----------------------------------------------------------------------------------


async def test_two_legacy_connections_share_default_and_named_sessions_keep_apart(
    server: ServerProcess,
) -> None:
    """Unnamed, two transport sessions of a token are both in "default" (as in 0.2: a client
    that opens a transport session per call keeps its state); named sessions keep apart."""
    async with (
        open_client(server.url, ALICE, "legacy") as one,
        open_client(server.url, ALICE, "legacy") as two,
    ):
        assert one.session_id and two.session_id and one.session_id != two.session_id
        shared = await start(one, "sleep 30")
        seen = await two.ok("get_execution_status", execution_id=shared)
        assert seen["status"] == "running"
        assert seen["session"] == "default"
        listed = await two.ok("list_executions", status="running")
        assert shared in [i["id"] for i in listed["result"]]
        await two.ok("cancel_execution", execution_id=shared, force=True)

        a, b = unique("a"), unique("b")
        mine = await start(one, "sleep 30", session=a)
        theirs = await start(two, "sleep 30", session=b)
        assert [i["id"] for i in (await one.ok("list_executions", session=a))["result"]] == [mine]
        assert [i["id"] for i in (await two.ok("list_executions", session=b))["result"]] == [theirs]
        text = await two.error("cancel_execution", execution_id=mine, session=b)
        assert text == f"execution {mine!r} not found"
        text = await two.error("cancel_execution", execution_id=mine)
        assert text == f"execution {mine!r} not found"
        status = await one.ok("get_execution_status", execution_id=mine, session=a)
        assert status["status"] == "running"
        await one.ok("cancel_execution", execution_id=mine, force=True, session=a)
        await two.ok("cancel_execution", execution_id=theirs, force=True, session=b)


async def test_an_explicit_session_is_shared_by_connections_of_the_same_token(
    server: ServerProcess, mode: Mode
) -> None:
    session = unique("shared")
    async with open_client(server.url, ALICE, mode) as first:
        execution_id = await start(first, "cat", interactive=True, session=session)
        unnamed = await first.ok("list_executions")  # "default": not the named session
        assert execution_id not in [i["id"] for i in unnamed["result"]]
    async with open_client(server.url, ALICE, mode) as again:
        listed = await again.ok("list_executions", session=session)
        assert [i["id"] for i in listed["result"]] == [execution_id]
        await again.ok(
            "send_stdin",
            execution_id=execution_id,
            input_data="kept\n",
            close_stdin=True,
            session=session,
        )
        events = await follow(again, execution_id, session=session)
        assert stdout_of(events) == "kept\n"
        text = await again.error("get_execution_status", execution_id=execution_id)
        assert text == f"execution {execution_id!r} not found"


async def test_tokens_do_not_see_each_others_executions_in_the_same_named_session(
    server: ServerProcess, mode: Mode
) -> None:
    session = unique("same-name")
    async with (
        open_client(server.url, ALICE, mode) as alice,
        open_client(server.url, BOB, mode) as bob,
    ):
        alices = await start(alice, "sleep 30", session=session)
        bobs = await start(bob, "sleep 30", session=session)
        listed = await bob.ok("list_executions", session=session)
        assert [i["id"] for i in listed["result"]] == [bobs]
        for tool in ("get_execution_status", "get_execution_output", "cancel_execution"):
            text = await bob.error(tool, execution_id=alices, session=session)
            assert text == f"execution {alices!r} not found"
        status = await alice.ok("get_execution_status", execution_id=alices, session=session)
        assert status["status"] == "running"
        await alice.ok("cancel_execution", execution_id=alices, force=True, session=session)
        await bob.ok("cancel_execution", execution_id=bobs, force=True, session=session)


async def test_a_legacy_session_id_borrowed_by_a_modern_request_names_no_session(
    server: ServerProcess,
) -> None:
    """Executions belong to (token, session name): a transport session id is no owner, so a
    modern request carrying a legacy one reaches what any request of the token reaches (the
    session it names, else "default") and nothing more."""
    session = unique("named")
    async with open_client(server.url, ALICE, "legacy") as legacy:
        unnamed = await start(legacy, "sleep 30")
        named = await start(legacy, "sleep 30", session=session)
        assert legacy.session_id
        async with open_client(
            server.url, ALICE, "auto", headers={"Mcp-Session-Id": legacy.session_id}
        ) as modern:
            status = await modern.ok("get_execution_status", execution_id=unnamed)
            assert status["session"] == "default"
            text = await modern.error("get_execution_status", execution_id=named)
            assert text == f"execution {named!r} not found"
            listed = await modern.ok("list_executions", status="running")
            ids = [i["id"] for i in listed["result"]]
            assert unnamed in ids and named not in ids
        await legacy.ok("cancel_execution", execution_id=unnamed, force=True)
        await legacy.ok("cancel_execution", execution_id=named, force=True, session=session)


# -- concurrency limits -----------------------------------------------------------------------


async def test_a_third_concurrent_execution_in_a_session_is_refused_until_one_is_cancelled(
    limited_server: ServerProcess,
) -> None:
    session = unique("busy")
    async with open_client(limited_server.url, ALICE, "legacy") as conn:
        first = await start(conn, "sleep 30", session=session)
        second = await start(conn, "sleep 30", session=session)
        text = await conn.error("execute_code_async", command="sleep 30", session=session)
        assert text == (
            "this session is running its maximum of 2 executions; "
            "wait for one to finish or cancel one"
        )
        text = await conn.error("execute_code", command="true", session=session)
        assert "maximum of 2 executions" in text
        # Another session is not affected.
        other = await conn.ok("execute_code", command="echo free", session=unique("other"))
        assert stdout_of(other["output"]) == "free\n"

        await conn.ok("cancel_execution", execution_id=first, session=session)
        third = await start(conn, "sleep 30", session=session)
        listed = await conn.ok("list_executions", status="running", session=session)
        assert {i["id"] for i in listed["result"]} == {second, third}
        for execution_id in (second, third):
            await conn.ok(
                "cancel_execution", execution_id=execution_id, force=True, session=session
            )
    assert limited_server.health()["running_executions"] == 0


# -- authentication ---------------------------------------------------------------------------

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "e2e", "version": "0"},
    },
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream"}


async def test_the_mcp_endpoint_without_a_token_is_401_with_www_authenticate(
    server: ServerProcess,
) -> None:
    async with httpx2.AsyncClient(timeout=10) as http:
        resp = await http.post(server.url, json=INITIALIZE, headers=MCP_HEADERS)
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"].startswith("Bearer")
    body = resp.json()
    assert body["error"]["message"].startswith("missing token: ")


@pytest.mark.parametrize("token", ["tok-nobody-0123456789", ALICE + "x", ALICE[:-1]])
async def test_the_mcp_endpoint_with_a_wrong_token_is_401(
    server: ServerProcess, token: str
) -> None:
    async with httpx2.AsyncClient(timeout=10) as http:
        resp = await http.post(
            server.url,
            json=INITIALIZE,
            headers={**MCP_HEADERS, "Authorization": f"Bearer {token}"},
        )
    assert resp.status_code == 401
    assert 'error="invalid_token"' in resp.headers["www-authenticate"]
    body = resp.json()
    assert body["error"]["message"].startswith("invalid token: ")
    assert "invalid token" in resp.reason_phrase
    assert ALICE not in resp.text


async def test_health_needs_no_token(server: ServerProcess) -> None:
    async with httpx2.AsyncClient(timeout=10) as http:
        resp = await http.get(f"{server.base_url}/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "ok"
    assert body["sandbox"] == "ok"
    assert isinstance(body["running_executions"], int)


def test_listening_on_all_interfaces_without_a_token_exits_with_a_message(
    tmp_path: Path,
) -> None:
    code, stderr = run_server_once(tmp_path, SANDBOX_HOST="0.0.0.0")
    assert code != 0
    assert "refusing to listen on 0.0.0.0 without a token" in stderr
    assert "SANDBOX_AUTH_TOKEN" in stderr


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"SANDBOX_MAX_CONCURRENT": "abc"}, "invalid setting SANDBOX_MAX_CONCURRENT"),
        ({"SANDBOX_PORT": "70000"}, "invalid setting SANDBOX_PORT"),
        (
            {"SANDBOX_TIMEOUT": "5000", "SANDBOX_MAX_TIMEOUT": "60"},
            "invalid settings: SANDBOX_TIMEOUT (5000.0) exceeds SANDBOX_MAX_TIMEOUT (60.0)",
        ),
        (
            {"SANDBOX_AUTH_TOKENS": "alice:secret1"},
            "invalid settings: the token of principal 'alice' is under 8 characters",
        ),
    ],
    ids=["not-a-number", "port-out-of-range", "timeout-above-maximum", "short-token"],
)
def test_an_invalid_setting_exits_naming_the_setting(
    tmp_path: Path, settings: dict[str, str], message: str
) -> None:
    code, stderr = run_server_once(tmp_path, **settings)
    assert code != 0
    assert message in stderr
    assert "Traceback" not in stderr
    assert "secret1" not in stderr


# -- shutdown ---------------------------------------------------------------------------------


async def test_sigterm_with_running_executions_leaves_no_process_behind(tmp_path: Path) -> None:
    """Sandboxes (srt-sandbox on the host) die with the server; a waiting call gets its answer."""
    marker = unique("srt-e2e-sigterm")
    server = ServerProcess(tmp_path, {"SANDBOX_AUTH_TOKEN": ALICE, "SANDBOX_SHUTDOWN_GRACE": "1"})
    await asyncio.to_thread(server.start)
    try:
        async with open_client(server.url, ALICE, "legacy") as conn:
            for i in range(3):
                ignore = "trap '' TERM; " if i == 0 else ""  # this one outlasts the grace
                await start(conn, f"{ignore}sh -c 'sleep 1000; :' {marker}-{i}", session=f"s{i}")
            waiting = asyncio.create_task(
                conn.call("execute_code", command=f"sh -c 'sleep 1000; :' {marker}-waiting")
            )
            deadline = time.monotonic() + 10
            while (await asyncio.to_thread(server.health))["running_executions"] < 4:
                assert time.monotonic() < deadline, "the waiting execution never started"
                await asyncio.sleep(0.05)
            tree = server.descendants()
            sandboxed = [pid for pid, _ in tree if proc_uid(pid) == sandbox_uid()]
            assert len(sandboxed) >= 4, "the sandboxed sleepers are not visible on the host"
            while len(processes_with(marker)) < 4:
                assert time.monotonic() < deadline, "the marked sleepers never appeared"
                await asyncio.sleep(0.05)

            started = time.monotonic()
            await asyncio.to_thread(server.stop, 15)
            took = time.monotonic() - started
            answer = await asyncio.wait_for(waiting, 10)
    finally:
        server.kill()
    assert took < 8, f"shutdown took {took:.1f}s"
    survivors = [pid for pid, start_time in tree if alive(pid, start_time)]
    assert survivors == [], f"processes outlived the server: {survivors}"
    assert processes_with(marker) == []
    assert not answer.is_error
    assert answer.structured_content is not None
    assert answer.structured_content["status"] == "cancelled"
    assert answer.structured_content["exit_code"] is not None
    assert types_of(answer.structured_content["output"])[-2:] == ["cancelled", "exit"]
    log = server.stderr_text()
    assert "stopping executions" in log
    assert "Traceback" not in log
