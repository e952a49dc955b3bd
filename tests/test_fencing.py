"""Fencing in the split deployment (issue 40, findings 1 and 2): redis-server, an api replica,
two workers as separate processes with their own state dirs, SANDBOX_HEARTBEAT_TTL=3.

A worker frozen (SIGSTOP) past its heartbeat while it runs an execution, an interpreter call
or an upload comes back (SIGCONT) to find its session re-homed: the old execution stays
`lost`, never `completed`; the old worker stops its process and its interpreter and says so;
the session has one home, whose workspace every later call sees. A second worker started
with a replica id that a live one holds is refused, and the first is unharmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import Conn, ServerProcess, eventually, open_client, processes_with
from split_harness import TOKEN, Split, running_split

pytestmark = pytest.mark.e2e

TTL = 3  # SANDBOX_HEARTBEAT_TTL of the harness's replicas
MiB = 1024 * 1024


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def rid(server: ServerProcess) -> str:
    return server.settings["SANDBOX_REPLICA_ID"]


def home_of(split: Split, session: str) -> str:
    return split.redis.cli_raw("hget", f"session:default:s:{session}:home", "home").strip()


def stored(split: Split, execution_id: str) -> dict[str, Any]:
    raw = split.redis.cli_raw("get", f"execution:{execution_id}").strip()
    return dict(json.loads(raw)) if raw else {}


def stored_events(split: Split, execution_id: str) -> list[dict[str, Any]]:
    raw = split.redis.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def heartbeat(split: Split, replica_id: str) -> dict[str, Any]:
    raw = split.redis.cli_raw("get", f"replica:{replica_id}").strip()
    return dict(json.loads(raw)) if raw else {}


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


@contextlib.contextmanager
def frozen(server: ServerProcess) -> Iterator[None]:
    """SIGSTOP `server`; SIGCONT at the end whatever happens (a stopped process would not
    exit on the harness's SIGTERM)."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.pid, signal.SIGCONT)


async def heartbeat_gone(split: Split, replica_id: str) -> None:
    await eventually(
        lambda: split.redis.cli_raw("exists", f"replica:{replica_id}").strip() == "0",
        TTL + 5,
        f"{replica_id}'s heartbeat to expire",
    )


async def rehome(conn: Conn, session: str, command: str) -> dict[str, Any]:
    """execute_code in `session` until it succeeds (refused, saying to retry, until the
    frozen home's heartbeat has expired)."""

    async def attempt() -> dict[str, Any] | None:
        result = await conn.call("execute_code", command=command, session=session)
        if result.is_error:
            return None
        assert result.structured_content is not None
        return dict(result.structured_content)

    return await eventually(attempt, 30, f"{session} to be re-homed", interval=0.5)


@contextlib.asynccontextmanager
async def frozen_split(tmp_path: Path) -> AsyncIterator[tuple[Split, Conn]]:
    with running_split(tmp_path, apis=1, SANDBOX_SNAPSHOT_STORE=str(tmp_path / "store")) as split:
        async with open_client(split.apis[0].url, TOKEN, "auto") as conn:
            yield split, conn


async def homed_with_snapshot(split: Split, conn: Conn, session: str) -> ServerProcess:
    """A session with a file and a snapshot of it; its home (a worker)."""
    await conn.ok("write_file", path="keep.txt", content="kept", session=session)
    await conn.ok("snapshot_session", session=session)
    home = home_of(split, session)
    return next(w for w in split.workers if rid(w) == home)


async def moved_and_fenced(
    split: Split,
    conn: Conn,
    victim: ServerProcess,
    session: str,
    marker: str,
    execution_id: str,
) -> None:
    """Freeze `victim` past its heartbeat; the execution reads `lost`, the session re-homes
    on the other worker (home_lost, its snapshot restored) and writes a file there; then
    resume `victim` and check what it did: stopped the execution's process, ended it `lost`
    (never `completed`), dropped the session and said so; one home, whose workspace later
    calls see."""
    survivor = next(w for w in split.workers if w is not victim)
    log_at = victim.log_size()
    with frozen(victim):
        await heartbeat_gone(split, rid(victim))
        status = await conn.ok("get_execution_status", execution_id=execution_id, session=session)
        assert status["status"] == "lost", status
        moved = await rehome(conn, session, "cat keep.txt; echo new-home > new.txt")
        assert stdout_of(moved) == "kept", moved
        reset = moved["session_reset"]
        assert reset["reason"] == "home_lost" and reset["previous_replica"] == rid(victim), reset
        assert reset.get("restored_from"), reset
        assert home_of(split, session) == rid(survivor)
    # Back: it stops what ran for the session that moved, and says so.
    await eventually(lambda: not processes_with(marker), 15, "the old execution's process gone")
    try:
        await eventually(
            lambda: (
                f"fenced: session s:{session} moved to replica {rid(survivor)}"
                in victim.log_since(log_at, 2000)
            ),
            15,
            "the old worker's log line saying what it dropped",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{victim.log_since(log_at, 60)}") from None
    await eventually(
        lambda: heartbeat(split, rid(victim)).get("sessions") == 0, 10, "the old home to hold none"
    )
    log = victim.log_since(log_at, 2000)
    assert "heartbeat had lapsed (the store kept its epoch)" in log, log
    assert victim.health()["status"] == "ok"
    # `lost` is final: in the store and read through the api, now and after the old worker's
    # writes have had time to land.
    await asyncio.sleep(1.0)  # (the old worker's mirror flushes within milliseconds)
    info = stored(split, execution_id)
    assert info["status"] == "lost", info
    kinds = [e["type"] for e in stored_events(split, execution_id)]
    assert "exit" not in kinds and kinds[-1] == "error", kinds
    page = await conn.ok(
        "get_execution_output", execution_id=execution_id, last_event_id="0", session=session
    )
    assert page["status"] == "lost", page
    # One home: the new one's workspace, without the old execution's writes.
    for _ in range(3):
        later = await conn.ok("execute_code", command="cat new.txt; ls", session=session)
        assert later.get("session_reset") is None, later
        out = stdout_of(later)
        assert out.startswith("new-home\n") and "ticks" not in out, out
        assert home_of(split, session) == rid(survivor)


async def test_a_worker_frozen_past_its_heartbeat_during_an_execution_stays_fenced(
    tmp_path: Path,
) -> None:
    async with frozen_split(tmp_path) as (split, conn):
        session, marker = unique("frz"), unique("fence-mark")
        victim = await homed_with_snapshot(split, conn, session)
        loop = "while :; do echo tick >> ticks.txt; sleep 0.2; done"
        started = await conn.ok(
            "execute_code_async", command=f"echo started; sh -c '{loop}' {marker}", session=session
        )
        await eventually(lambda: processes_with(marker), 15, "the execution's process")
        await moved_and_fenced(split, conn, victim, session, marker, started["execution_id"])


async def test_a_worker_frozen_past_its_heartbeat_during_run_code_stops_its_interpreter(
    tmp_path: Path,
) -> None:
    async with frozen_split(tmp_path) as (split, conn):
        session, marker = unique("frz-py"), unique("fence-py")
        victim = await homed_with_snapshot(split, conn, session)
        code = (
            "import subprocess, time\n"
            f"child = subprocess.Popen(['sh', '-c', 'while :; do sleep 0.2; done', '{marker}'])\n"
            "for i in range(600):\n"
            "    open('ticks.txt', 'a').write('tick\\n')\n"
            "    time.sleep(0.2)\n"
        )
        started = await conn.ok("run_code_async", code=code, session=session)
        await eventually(lambda: processes_with(marker), 30, "the interpreter call's child")
        await moved_and_fenced(split, conn, victim, session, marker, started["execution_id"])


async def test_an_upload_to_a_worker_frozen_past_its_heartbeat_is_not_acknowledged(
    tmp_path: Path,
) -> None:
    """An upload under way when its worker freezes, finished after the session moved: never
    201; the file is not in the session (the new home's workspace); one home."""
    async with frozen_split(tmp_path) as (split, conn):
        session = unique("frz-up")
        victim = await homed_with_snapshot(split, conn, session)
        survivor = next(w for w in split.workers if w is not victim)
        made = await conn.ok("create_file_url", path="big.bin", method="PUT", session=session)
        sent, resume = asyncio.Event(), asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            for i in range(8):
                yield b"\x5a" * MiB
                if i == 3:
                    sent.set()
                    await resume.wait()

        # (Through the api, which forwards the body to the home as it comes.)
        async with httpx2.AsyncClient(trust_env=False, timeout=120.0) as client:
            upload = asyncio.create_task(client.put(made["url"], content=body()))
            await asyncio.wait_for(sent.wait(), 30)
            await asyncio.sleep(0.3)  # (the first chunks reach the home)
            with frozen(victim):
                await heartbeat_gone(split, rid(victim))
                moved = await rehome(conn, session, "cat keep.txt")
                assert moved["session_reset"]["reason"] == "home_lost", moved
                resume.set()
                await asyncio.sleep(0.5)
            with contextlib.suppress(httpx2.HTTPError):
                resp = await asyncio.wait_for(upload, 60)
                assert resp.status_code != 201, resp.text
        assert home_of(split, session) == rid(survivor)
        listed = await conn.ok("list_files", session=session)
        names = {e["path"].rsplit("/", 1)[-1] for e in listed["entries"]}
        assert "big.bin" not in names and "keep.txt" in names, names
        assert listed.get("session_reset") is None, listed
        await eventually(
            lambda: heartbeat(split, rid(victim)).get("sessions") == 0,
            15,
            "the old home to hold none",
        )


async def test_a_second_worker_with_a_live_replica_id_is_refused_and_the_first_unharmed(
    tmp_path: Path,
) -> None:
    with running_split(tmp_path, apis=1) as split:
        first = split.workers[0]
        address = heartbeat(split, rid(first))["cluster_address"]
        async with open_client(split.apis[0].url, TOKEN, "auto") as conn:
            sessions = [unique("dup") for _ in range(4)]
            for session in sessions:
                await conn.ok("write_file", path="mine.txt", content=session, session=session)
            on_first = [s for s in sessions if home_of(split, s) == rid(first)]
            assert on_first, "no session was placed on the first worker"
            started = time.monotonic()
            with pytest.raises(AssertionError) as refused:
                split.add_worker(unique("dup"), SANDBOX_REPLICA_ID=rid(first))
            second = split.servers.started[-1]  # (add_worker lists only those that started)
            assert rid(second) == rid(first) and second is not first
            assert second.proc is not None and second.proc.poll() not in (None, 0)
            text = str(refused.value)
            assert f"replica id {rid(first)!r} is in use by another live process" in text, text
            assert time.monotonic() - started < TTL + 20
            for _ in range(5):  # the first unharmed: its heartbeat, its sessions' files
                assert heartbeat(split, rid(first))["cluster_address"] == address
                for session in on_first:
                    read = await conn.ok("read_file", path="mine.txt", session=session)
                    assert read["content"] == session and read.get("session_reset") is None
                    assert home_of(split, session) == rid(first)
                await asyncio.sleep(0.5)
            assert first.health()["status"] == "ok"


async def test_a_worker_whose_id_was_taken_while_it_was_frozen_serves_nothing_after(
    tmp_path: Path,
) -> None:
    """A worker frozen past its heartbeat; a new process starts under its id (its heartbeat
    expired: the id is free). When the frozen one resumes its heartbeat is refused: it stops
    what it ran, says it is fenced (/ready 503, /health degraded), takes no work, and when it
    stops it leaves the new process's heartbeat and sessions alone."""
    with running_split(tmp_path, apis=1) as split:
        async with open_client(split.apis[0].url, TOKEN, "auto") as conn:
            session, marker = unique("evict"), unique("evict-mark")
            await conn.ok("write_file", path="a.txt", content="a", session=session)
            old = next(w for w in split.workers if rid(w) == home_of(split, session))
            loop = "while :; do sleep 0.2; done"
            await conn.ok("execute_code_async", command=f"sh -c '{loop}' {marker}", session=session)
            await eventually(lambda: processes_with(marker), 15, "the execution's process")
            log_at = old.log_size()
            with frozen(old):
                await heartbeat_gone(split, rid(old))
                new = split.add_worker(unique("evict-new"), SANDBOX_REPLICA_ID=rid(old))
                new_beat = heartbeat(split, rid(old))
                assert new_beat["cluster_address"] == f"127.0.0.1:{new.port}", new_beat
            await eventually(lambda: not processes_with(marker), 15, "the old process's execution")
            await eventually(
                lambda: httpx2.get(f"{old.base_url}/ready", timeout=5).status_code == 503,
                15,
                "the fenced worker not ready",
            )
            health = old.health()
            assert health["status"] == "degraded", health
            assert "is in use by another live process" in health["redis"], health
            assert "fenced for good" in old.log_since(log_at, 2000)
            for _ in range(5):  # never alternating: the heartbeat stays the new process's
                beat = heartbeat(split, rid(old))
                assert beat["incarnation"] == new_beat["incarnation"], beat
                await asyncio.sleep(0.5)
            old.stop()
            beat = heartbeat(split, rid(old))
            assert beat.get("incarnation") == new_beat["incarnation"], beat
            # The session's record names the id, now the new process's: it is served there
            # (its workspace is not on that machine: the next call says so).
            result = await conn.ok("list_files", session=session)
            assert home_of(split, session) == rid(old)
            assert result.get("session_reset", {}).get("reason") in (None, "workspace_removed")


async def test_a_worker_frozen_while_redis_restarted_empty_drops_a_session_homed_elsewhere(
    tmp_path: Path,
) -> None:
    """Redis emptied (a restart without persistence) while a worker is frozen; the session is
    placed anew on the other worker. The frozen one resumes into a new store epoch: it finds
    the session's record naming the other home and stops what it ran for it (one live home)."""
    with running_split(tmp_path, apis=1) as split:
        async with open_client(split.apis[0].url, TOKEN, "auto") as conn:
            session, marker = unique("epoch"), unique("epoch-mark")
            await conn.ok("write_file", path="a.txt", content="a", session=session)
            victim = next(w for w in split.workers if rid(w) == home_of(split, session))
            survivor = next(w for w in split.workers if w is not victim)
            loop = "while :; do sleep 0.2; done"
            await conn.ok("execute_code_async", command=f"sh -c '{loop}' {marker}", session=session)
            await eventually(lambda: processes_with(marker), 15, "the execution's process")
            log_at = victim.log_size()
            with frozen(victim):
                split.redis.cli("flushall")  # (as Redis restarted empty)
                await eventually(
                    lambda: heartbeat(split, rid(survivor)), 15, "the survivor beating again"
                )
                moved = await rehome(conn, session, "echo here")
                assert stdout_of(moved) == "here\n", moved
                assert home_of(split, session) == rid(survivor)
            await eventually(lambda: not processes_with(marker), 20, "the old execution stopped")
            log = victim.log_since(log_at, 2000)
            assert f"fenced: session s:{session} moved to replica {rid(survivor)}" in log, log
            assert home_of(split, session) == rid(survivor)
