"""The split deployment (DESIGN §16) end to end, through nginx's round robin
(deploy/nginx/split.conf): redis-server, two api replicas, two workers (each its own state
dir, as separate machines), the official MCP client in both protocol eras.

The whole tool suite across random api replicas; an api replica killed mid-run (nothing
lost, nginx fails over); a worker killed (its sessions re-homed, restored from a shared
snapshot store); a placement request a dead worker held, reclaimed by a live one; no worker
capacity; a worker drained by SIGTERM (new sessions elsewhere, its execution finishes, its
session moves with its snapshot); an api's readiness following the workers'.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import Conn, Mode, ServerProcess, error_text, eventually, open_client
from split_harness import TOKEN, Split, running_split

from sandbox_runtime.sessions.queue import GROUP, RECLAIM_IDLE_SECONDS

pytestmark = pytest.mark.e2e

STREAM = "srt:placements"


# -- helpers ------------------------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


def stderr_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stderr")


def rid(server: ServerProcess) -> str:
    return server.settings["SANDBOX_REPLICA_ID"]


def home_of(split: Split, session: str) -> str | None:
    home = split.redis.cli_raw("hget", f"session:default:s:{session}:home", "home").strip()
    return home or None


def worker_with_id(split: Split, replica_id: str) -> ServerProcess:
    return next(w for w in split.workers if rid(w) == replica_id)


def signal_to(server: ServerProcess, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(server.pid, sig)


@contextlib.contextmanager
def frozen(*servers: ServerProcess) -> Iterator[None]:
    """SIGSTOP `servers`; SIGCONT those still alive at the end, whatever happens (a stopped
    process would not exit on the harness's SIGTERM)."""
    for server in servers:
        signal_to(server, signal.SIGSTOP)
    try:
        yield
    finally:
        for server in servers:
            if server.proc is not None and server.proc.poll() is None:
                signal_to(server, signal.SIGCONT)


def ready(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    resp = httpx2.get(f"{server.base_url}/ready", timeout=5)
    return resp.status_code, resp.json()


async def read_to_end(conn: Conn, execution_id: str, session: str) -> tuple[str, dict[str, Any]]:
    """Every stdout byte of an execution, read page by page (waiting) until it has ended and
    nothing is left: (text, the last page)."""
    text, cursor = "", "0"
    deadline = time.monotonic() + 60
    while True:
        page = await conn.ok(
            "get_execution_output",
            execution_id=execution_id,
            last_event_id=cursor,
            wait=True,
            wait_seconds=10,
            session=session,
        )
        text += stdout_of(page)
        cursor = page["next_cursor"]
        if page["status"] not in ("pending", "running") and not page["has_more"]:
            return text, page
        assert time.monotonic() < deadline, f"{execution_id} did not end: {page['status']}"


async def rehomed_call(conn: Conn, session: str, command: str, within: float = 30) -> dict:
    """execute_code in `session` until it succeeds: while the home's heartbeat lives the
    call is refused, saying to retry."""

    async def attempt() -> dict[str, Any] | None:
        result = await conn.call("execute_code", command=command, session=session)
        if result.is_error:
            text = error_text(result)
            assert "retry" in text or "does not answer" in text, text
            return None
        assert result.structured_content is not None
        return dict(result.structured_content)

    return await eventually(attempt, within, f"{session} to be re-homed", interval=0.5)


# -- 1. the tool suite ----------------------------------------------------------------------------


async def tool_suite(split: Split, mode: Mode, session: str) -> str | None:
    """Every session-bound tool once, each call possibly on another api replica; returns the
    session's home (a worker)."""
    files_base = f"http://127.0.0.1:{split.nginx.port}/files/"
    async with open_client(split.nginx.url, TOKEN, mode) as conn:
        # execute_code, waiting: exit code, stdout and stderr apart
        ran = await conn.ok(
            "execute_code", command=f"echo out-{session}; echo err >&2; exit 3", session=session
        )
        assert ran["status"] == "completed" and ran["exit_code"] == 3, ran
        assert stdout_of(ran) == f"out-{session}\n" and stderr_of(ran) == "err\n", ran
        assert ran.get("session_reset") is None

        # execute_code_async, then a waiting read, then its status
        started = await conn.ok(
            "execute_code_async",
            command="for i in 1 2 3; do echo a$i; sleep 0.2; done",
            session=session,
        )
        async_id = started["execution_id"]
        assert started["status"] in ("pending", "running"), started
        text, last = await read_to_end(conn, async_id, session)
        assert text == "a1\na2\na3\n" and last["status"] == "completed", last
        status = await conn.ok("get_execution_status", execution_id=async_id, session=session)
        assert status["status"] == "completed" and status["exit_code"] == 0, status

        # an interactive execution fed through send_stdin
        talk = await conn.ok(
            "execute_code_async",
            command="read line; echo got:$line",
            interactive=True,
            session=session,
        )
        fed = await conn.ok(
            "send_stdin", execution_id=talk["execution_id"], input_data="ping", session=session
        )
        assert fed["bytes_written"] == 5, fed
        text, last = await read_to_end(conn, talk["execution_id"], session)
        assert text == "got:ping\n" and last["exit_code"] == 0, last

        # cancel_execution of a long one
        long = await conn.ok("execute_code_async", command="sleep 300", session=session)
        cancelled = await conn.ok(
            "cancel_execution", execution_id=long["execution_id"], session=session
        )
        assert cancelled["was_running"] is True and cancelled["status"] == "cancelled", cancelled

        listed = await conn.ok("list_executions", session=session)
        statuses = {e["id"]: e["status"] for e in listed["result"]}
        assert statuses == {
            ran["execution_id"]: "completed",
            async_id: "completed",
            talk["execution_id"]: "completed",
            long["execution_id"]: "cancelled",
        }, statuses

        # run_code: the interpreter's state lives on the worker, whichever api is asked
        await conn.ok("run_code", code=f"x = 40\nname = {session!r}", session=session)
        again = await conn.ok("run_code", code="print(x + 2, name)", session=session)
        assert stdout_of(again) == f"42 {session}\n", again

        # files
        wrote = await conn.ok("write_file", path="dir/a.txt", content="alpha\n", session=session)
        assert wrote["size"] == 6, wrote
        read = await conn.ok("read_file", path="dir/a.txt", session=session)
        assert read["content"] == "alpha\n" and read["encoding"] == "utf-8", read
        listed_files = await conn.ok("list_files", depth=2, session=session)
        assert "dir/a.txt" in {e["path"] for e in listed_files["entries"]}, listed_files
        deleted = await conn.ok("delete_file", path="dir/a.txt", session=session)
        assert deleted["deleted"] == "file", deleted
        listed_files = await conn.ok("list_files", depth=2, session=session)
        assert "dir/a.txt" not in {e["path"] for e in listed_files["entries"]}

        # signed file URLs through nginx: download, then upload
        blob = os.urandom(200_000)
        await conn.ok(
            "write_file",
            path="dl.bin",
            content=base64.b64encode(blob).decode(),
            encoding="base64",
            session=session,
        )
        get_url = await conn.ok("create_file_url", path="dl.bin", session=session)
        put_url = await conn.ok("create_file_url", path="up.txt", method="PUT", session=session)
        for made in (get_url, put_url):
            assert made["url"].startswith(files_base), (made["url"], files_base)
        async with httpx2.AsyncClient(timeout=30) as http:
            got = await http.get(get_url["url"])
            assert got.status_code == 200, got.text
            assert got.content == blob
            put = await http.put(put_url["url"], content=f"uploaded {session}\n".encode())
            assert put.status_code in (200, 201, 204), put.text
        uploaded = await conn.ok("read_file", path="up.txt", session=session)
        assert uploaded["content"] == f"uploaded {session}\n", uploaded

        # snapshots
        taken = await conn.ok("snapshot_session", session=session)
        assert taken["session"] == session and taken["trigger"] == "on_demand", taken
        assert taken["files"] >= 2, taken
        snaps = await conn.ok("list_snapshots", session=session)
        assert [s["snapshot_id"] for s in snaps["snapshots"]] == [taken["snapshot_id"]], snaps
    return home_of(split, session)


@pytest.mark.parametrize("era", ["auto", "legacy"])
async def test_the_tool_suite_across_api_replicas(tmp_path: Path, era: Mode) -> None:
    store = str(tmp_path / "store")
    with running_split(tmp_path, SANDBOX_SNAPSHOT_STORE=store) as split:
        sessions = [unique(f"suite{i}") for i in range(3)]
        homes = await asyncio.gather(*(tool_suite(split, era, s) for s in sessions))
        assert set(homes) <= {rid(w) for w in split.workers}, homes
        # Round robin: both api replicas served calls (each forwarded to the workers).
        for api in split.apis:
            assert api.metric(TOKEN, "srt_forwarded_calls_total", 'result="ok"') > 0
        assert not list((split.apis[0].state_dir / "workspaces").glob("ws-*"))


# -- 2. an api replica killed mid-run -------------------------------------------------------------


async def test_a_killed_api_replica_loses_no_output_and_calls_fail_over(tmp_path: Path) -> None:
    with running_split(tmp_path) as split:
        sessions = [unique(f"apikill{i}") for i in range(3)]
        command = "for i in $(seq 1 30); do echo row$i; sleep 0.1; done"
        async with open_client(split.nginx.url, TOKEN, "auto") as conn:
            started = await asyncio.gather(
                *(conn.ok("execute_code_async", command=command, session=s) for s in sessions)
            )
            ids = [s["execution_id"] for s in started]

            async def running_with_rows() -> bool:
                pages = [
                    await conn.ok("get_execution_output", execution_id=i, session=s)
                    for i, s in zip(ids, sessions, strict=True)
                ]
                return all(p["status"] == "running" and "row2\n" in stdout_of(p) for p in pages)

            await eventually(running_with_rows, 10, "the executions to be under way")
            split.apis[0].kill()
            assert split.apis[0].proc is not None and split.apis[0].proc.poll() is not None

        async with open_client(split.nginx.url, TOKEN, "legacy") as after:
            read = await asyncio.gather(
                *(read_to_end(after, i, s) for i, s in zip(ids, sessions, strict=True))
            )
            for text, last in read:
                assert text == "".join(f"row{i}\n" for i in range(1, 31)), text
                assert last["status"] == "completed" and last["exit_code"] == 0, last
            # New calls keep working: nginx sends them all to the api replica left.
            for s in sessions:
                again = await after.ok("execute_code", command="echo still", session=s)
                assert stdout_of(again) == "still\n" and again.get("session_reset") is None
            fresh = [unique("fresh") for _ in range(4)]
            results = await asyncio.gather(
                *(after.ok("execute_code", command=f"echo {f}", session=f) for f in fresh)
            )
            assert [stdout_of(r) for r in results] == [f"{f}\n" for f in fresh]


# -- 3. a worker killed ---------------------------------------------------------------------------


async def test_a_killed_workers_sessions_come_back_on_the_other_from_their_snapshots(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "store")
    with running_split(tmp_path, SANDBOX_SNAPSHOT_STORE=store) as split:
        sessions = [unique(f"wkill{i}") for i in range(4)]
        async with open_client(split.nginx.url, TOKEN, "auto") as conn:

            async def prepare(session: str) -> str:
                await conn.ok("write_file", path="keep.txt", content=session, session=session)
                taken = await conn.ok("snapshot_session", session=session)
                await conn.ok("write_file", path="after.txt", content="late", session=session)
                return str(taken["snapshot_id"])

            snapshots = dict(
                zip(sessions, await asyncio.gather(*(prepare(s) for s in sessions)), strict=True)
            )
            homes = {s: home_of(split, s) for s in sessions}
            victim_id = str(homes[sessions[0]])
            victim = worker_with_id(split, victim_id)
            survivor_id = next(rid(w) for w in split.workers if w is not victim)
            victim.kill()

            check = "cat keep.txt; echo; cat after.txt 2>&1 || true"
            results = await asyncio.gather(*(rehomed_call(conn, s, check) for s in sessions))
            for session, result in zip(sessions, results, strict=True):
                out = stdout_of(result)
                assert out.startswith(f"{session}\n"), out
                if homes[session] == victim_id:
                    reset = result["session_reset"]
                    assert reset["reason"] == "home_lost", reset
                    assert reset["previous_replica"] == victim_id, reset
                    assert reset["restored_from"]["snapshot_id"] == snapshots[session], reset
                    assert "No such file" in out, out  # (written after the snapshot)
                else:
                    assert result.get("session_reset") is None, result
                    assert out.endswith("late"), out
                assert home_of(split, session) == survivor_id
                again = await conn.ok("execute_code", command="cat keep.txt", session=session)
                assert again.get("session_reset") is None and stdout_of(again) == session


# -- 4. placement: a request a dead worker held; no capacity; readiness ----------------------------


def pending_consumers(split: Split) -> str:
    """XPENDING's entries (id, consumer, idle, deliveries), as redis-cli prints them."""
    return split.redis.cli_raw("xpending", STREAM, GROUP, "-", "+", "10")


def unread(split: Split) -> int:
    """Requests no worker has read (answered ones are deleted from the stream)."""
    length = int(split.redis.cli_raw("xlen", STREAM).strip() or 0)
    pending = int(split.redis.cli_raw("xpending", STREAM, GROUP).split()[0])
    return length - pending


async def test_a_request_a_dead_worker_held_is_reclaimed_by_a_live_one(tmp_path: Path) -> None:
    with running_split(tmp_path, SANDBOX_PLACEMENT_WAIT_SECONDS="30") as split:
        taker, keeper = split.workers
        async with open_client(split.nginx.url, TOKEN, "auto") as conn:
            await conn.ok("execute_code", command="true", session=unique("warm"))
            with frozen(keeper):
                # The keeper's blocked read (READ_BLOCK_MS) runs out while it is stopped: from
                # then on only the taker's consumer is blocked on the stream.
                await asyncio.sleep(2.5)
                for _attempt in range(5):
                    session = unique("reclaim")
                    with frozen(taker):
                        # The taker is stopped inside its blocked XREADGROUP (most of the time:
                        # else the request stays unread, and the attempt is made again). Redis
                        # hands it the request all the same: pending on a consumer that never
                        # answers, as a worker that read it and died.
                        call = asyncio.create_task(
                            conn.call("execute_code", command="echo reclaimed", session=session)
                        )
                        held = await eventually(
                            lambda: rid(taker) in pending_consumers(split) or unread(split),
                            10,
                            "the placement request to be queued",
                            interval=0.02,
                        )
                        queued = time.monotonic()
                        if held is True:
                            taker.kill()
                            break
                    # (The taker answers it once continued: try again.)
                    result = await call
                    assert not result.is_error, error_text(result)
                    await asyncio.sleep(0.3)
                else:
                    pytest.fail("the request was never handed to the stopped worker")
            # The keeper runs again: it claims the request once idle RECLAIM_IDLE_SECONDS.
            result = await asyncio.wait_for(call, 40)
            waited = time.monotonic() - queued
        assert not result.is_error, error_text(result)
        assert result.structured_content is not None
        assert stdout_of(dict(result.structured_content)) == "reclaimed\n"
        assert waited >= RECLAIM_IDLE_SECONDS - 1, waited
        assert home_of(split, session) == rid(keeper)
        assert "took over a request another worker left unanswered" in keeper.stderr_text()
        assert pending_consumers(split).strip() == ""


async def test_no_worker_capacity_and_readiness_follow_the_workers(tmp_path: Path) -> None:
    with running_split(tmp_path, SANDBOX_PLACEMENT_WAIT_SECONDS="3") as split:
        for api in split.apis:
            code, body = ready(api)
            assert code == 200 and body["ready"] is True, body
        session = unique("nocap")
        async with open_client(split.nginx.url, TOKEN, "legacy") as conn:
            with frozen(*split.workers):

                def not_ready() -> bool:
                    return all(ready(api)[0] == 503 for api in split.apis)

                # (The workers' heartbeats expire: SANDBOX_HEARTBEAT_TTL=3.)
                await eventually(not_ready, 10, "the api replicas to be not ready")
                for api in split.apis:
                    code, body = ready(api)
                    assert code == 503 and body["ready"] is False, body
                    assert any("no live worker" in r for r in body["reasons"]), body
                began = time.monotonic()
                errors = await asyncio.gather(
                    conn.error("execute_code", command="true", session=session),
                    conn.error("write_file", path="x", content="x", session=unique("nocap2")),
                )
                took = time.monotonic() - began
                for text in errors:
                    assert "no worker capacity" in text, text
                assert 2.5 <= took < 8, took
            await eventually(
                lambda: all(ready(api)[0] == 200 for api in split.apis),
                15,
                "the api replicas to be ready again",
            )
            # The requests nobody answered in time are dropped, not placed late; the session's
            # next call places it now.
            await eventually(
                lambda: split.redis.cli_raw("xlen", STREAM).strip() == "0",
                10,
                "the expired requests to be dropped",
            )
            assert home_of(split, session) is None
            result = await conn.ok("execute_code", command="echo placed", session=session)
            assert stdout_of(result) == "placed\n" and result.get("session_reset") is None
        assert home_of(split, session) in {rid(w) for w in split.workers}


# -- 5. a worker drained by SIGTERM ---------------------------------------------------------------


async def test_a_worker_drained_by_sigterm_finishes_its_execution_then_its_session_moves(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "store")
    with running_split(
        tmp_path, SANDBOX_SNAPSHOT_STORE=store, SANDBOX_WORKER_DRAIN_SECONDS="15"
    ) as split:
        session = unique("drain")
        async with open_client(split.nginx.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="keep.txt", content="kept\n", session=session)
            started = await conn.ok(
                "execute_code_async", command="sleep 3; echo done", session=session
            )
            victim_id = str(home_of(split, session))
            victim = worker_with_id(split, victim_id)
            survivor_id = next(rid(w) for w in split.workers if w is not victim)
            proc = victim.proc
            assert proc is not None
            proc.send_signal(signal.SIGTERM)

            async def newcomers() -> None:
                """Draining: new sessions go to the other worker only."""
                names = [unique("newcomer") for _ in range(3)]
                placed = await asyncio.gather(
                    *(conn.ok("execute_code", command="echo new", session=n) for n in names)
                )
                assert [stdout_of(p) for p in placed] == ["new\n"] * 3
                assert [p.get("session_reset") for p in placed] == [None] * 3
                assert {home_of(split, n) for n in names} == {survivor_id}

            async def finished() -> None:
                text, last = await read_to_end(conn, started["execution_id"], session)
                assert last["status"] == "completed" and last["exit_code"] == 0, last
                assert text == "done\n"

            await asyncio.gather(newcomers(), finished())

            await eventually(lambda: proc.poll() is not None, 30, "the worker to exit")
            assert proc.returncode in (0, -signal.SIGTERM), victim.stderr_text()[-3000:]
            assert "draining: 1 executions may finish first" in victim.stderr_text()
            code, body = ready(split.apis[0])
            assert code == 200, body  # (one worker left)

            result = await conn.ok("execute_code", command="cat keep.txt", session=session)
            reset = result["session_reset"]
            assert reset["reason"] == "home_stopped", reset
            assert reset["previous_replica"] == victim_id, reset
            assert reset["restored_from"]["trigger"] == "drain", reset
            assert stdout_of(result) == "kept\n"
            assert home_of(split, session) == survivor_id
            status = await conn.ok(
                "get_execution_status", execution_id=started["execution_id"], session=session
            )
            assert status["status"] == "completed", status


async def test_a_draining_workers_executions_take_stdin_and_cancel(tmp_path: Path) -> None:
    with running_split(tmp_path, SANDBOX_WORKER_DRAIN_SECONDS="10") as split:
        session = unique("feed")
        async with open_client(split.nginx.url, TOKEN, "legacy") as conn:
            talk = await conn.ok(
                "execute_code_async",
                command="read line; echo got:$line",
                interactive=True,
                session=session,
            )
            long = await conn.ok("execute_code_async", command="sleep 300", session=session)
            victim = worker_with_id(split, str(home_of(split, session)))
            proc = victim.proc
            assert proc is not None
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)  # (past the signal's handling)
            try:
                fed, cancelled = await asyncio.gather(
                    conn.call(
                        "send_stdin",
                        execution_id=talk["execution_id"],
                        input_data="hi",
                        session=session,
                    ),
                    conn.call(
                        "cancel_execution", execution_id=long["execution_id"], session=session
                    ),
                )
                assert not fed.is_error, error_text(fed)
                assert not cancelled.is_error, error_text(cancelled)
                text, last = await read_to_end(conn, talk["execution_id"], session)
                assert text == "got:hi\n" and last["status"] == "completed", last
            finally:
                await eventually(lambda: proc.poll() is not None, 30, "the worker to exit")
