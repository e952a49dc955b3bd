"""Several real replicas on one real redis-server: any replica answers for any execution."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import (
    Conn,
    ServerProcess,
    Servers,
    error_text,
    eventually,
    open_client,
    processes_with,
    replica_process,
    stop_all,
    stop_if_running,
)
from redis_harness import RedisServer

pytestmark = pytest.mark.e2e

TOKEN = "replica-test-token-123"


def replica(workdir: Path, redis: RedisServer, name: str, **settings: str) -> ServerProcess:
    return replica_process(workdir, redis.url, name, TOKEN, **settings)


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, serve: Servers
) -> tuple[ServerProcess, ServerProcess]:
    """Two replicas of one cluster, each its own state dir (not asserted healthy: a replica
    may not have reached Redis yet when it first answers)."""
    workdir = tmp_path_factory.mktemp("replicas")
    a = serve.add(replica(workdir, redis_server, f"ra-{uuid.uuid4().hex[:6]}"), healthy=False)
    b = serve.add(replica(workdir, redis_server, f"rb-{uuid.uuid4().hex[:6]}"), healthy=False)
    return a, b


async def all_output(conn: Conn, execution_id: str, session: str) -> tuple[str, dict[str, Any]]:
    text, cursor = "", "0"
    while True:
        page = await conn.ok(
            "get_execution_output", execution_id=execution_id, last_event_id=cursor, session=session
        )
        text += "".join(e.get("data", "") for e in page["output"] if e["type"] == "stdout")
        cursor = page["next_cursor"]
        if not page["has_more"]:
            return text, page


async def test_execution_started_on_one_replica_is_read_and_listed_on_another(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    a, b = pair
    session = f"s-{uuid.uuid4().hex[:8]}"
    async with open_client(a.url, TOKEN, "auto") as on_a, open_client(b.url, TOKEN, "auto") as on_b:
        started = await on_a.ok(
            "execute_code", command="for i in 1 2 3; do echo line$i; done", session=session
        )
        execution_id = started["execution_id"]
        assert started["status"] == "completed"

        async def mirrored() -> dict[str, Any] | None:
            result = await on_b.call(
                "get_execution_status", execution_id=execution_id, session=session
            )
            return None if result.is_error else dict(result.structured_content or {})

        status = await eventually(mirrored, 5, "the execution to be visible on B")
        assert status["status"] == "completed" and status["exit_code"] == 0
        assert status["replica_id"] == a.settings["SANDBOX_REPLICA_ID"]
        text, _ = await all_output(on_b, execution_id, session)
        assert text == "line1\nline2\nline3\n"
        ids = [e["event_id"] for e in started["output"]]
        cursor_page = await on_b.ok(
            "get_execution_output", execution_id=execution_id, last_event_id=ids[1], session=session
        )
        assert [e["event_id"] for e in cursor_page["output"]] == ids[2:], "same cursors on B"
        listed = await on_b.ok("list_executions", session=session)
        assert execution_id in [e["id"] for e in listed["result"]]
        # Another principal's or session's view of the same id is "not found" on B too.
        missing = await on_b.error(
            "get_execution_status", execution_id=execution_id, session="someone-else"
        )
        assert "not found" in missing


async def test_what_a_replica_answered_is_what_another_reads_at_once(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    """Read your writes across replicas: a started execution is found on B the moment A
    answered (an api replica reads what a worker started from the store: it was `not found`
    while the mirror had not written it yet), and one A answered completed reads completed on
    B (it read running), with no waiting in between. A few at once, as under load."""
    a, b = pair
    session = f"ryw-{uuid.uuid4().hex[:8]}"
    async with open_client(a.url, TOKEN, "auto") as on_a, open_client(b.url, TOKEN, "auto") as on_b:
        # (The session homed on A first: B then reads, it runs nothing of its own.)
        await on_a.ok("execute_code", command="true", session=session)

        async def started_then_read() -> None:
            started = await on_a.ok("execute_code_async", command="echo y", session=session)
            status = await on_b.ok(  # (found: whatever its status by now)
                "get_execution_status", execution_id=started["execution_id"], session=session
            )
            assert status["status"] in ("pending", "running", "completed"), status

        async def ended_then_read() -> None:
            ran = await on_a.ok("execute_code", command="echo x", session=session)
            assert ran["status"] == "completed", ran
            status = await on_b.ok(
                "get_execution_status", execution_id=ran["execution_id"], session=session
            )
            assert status["status"] == "completed" and status["exit_code"] == 0, status

        for _ in range(6):  # (within the session's 4 running at once)
            await asyncio.gather(started_then_read(), started_then_read(), ended_then_read())


async def test_stdin_and_cancel_sent_to_another_replica_act_on_the_owner(
    pair: tuple[ServerProcess, ServerProcess], redis_server: RedisServer
) -> None:
    a, b = pair
    session = f"s-{uuid.uuid4().hex[:8]}"
    marker = f"marker-{uuid.uuid4().hex}"
    async with open_client(a.url, TOKEN, "auto") as on_a, open_client(b.url, TOKEN, "auto") as on_b:
        started = await on_a.ok(
            "execute_code_async",
            command=f"cat; sh -c 'sleep 1000; :' {marker}",
            interactive=True,
            session=session,
        )
        execution_id = started["execution_id"]

        async def visible() -> bool:
            r = await on_b.call("get_execution_status", execution_id=execution_id, session=session)
            return not r.is_error

        await eventually(visible, 5, "mirroring to B")
        sent = await on_b.ok(
            "send_stdin", execution_id=execution_id, input_data="hello via B\n", session=session
        )
        assert sent["bytes_written"] == len("hello via B\n")

        async def echoed() -> bool:  # (cat runs on: read until its echo is there, not its end)
            page = await on_a.ok(
                "get_execution_output",
                execution_id=execution_id,
                wait=True,
                wait_for="output",
                wait_seconds=5,
                session=session,
            )
            return "hello via B" in "".join(e.get("data", "") for e in page["output"])

        await eventually(echoed, 10, "A to show the input B sent")
        closed = await on_b.ok(
            "send_stdin",
            execution_id=execution_id,
            input_data="",
            close_stdin=True,
            session=session,
        )
        assert closed["stdin_open"] is False
        await eventually(lambda: processes_with(marker), 5, "sleep to run on A after cat ended")
        cancelled = await on_b.ok("cancel_execution", execution_id=execution_id, session=session)
        assert cancelled["status"] == "cancelled"
        assert cancelled["was_running"] is True
        assert not processes_with(marker), "the whole tree on A is gone"
        again = await on_b.ok("cancel_execution", execution_id=execution_id, session=session)
        assert again["was_running"] is False
        refused = await on_b.error(
            "send_stdin", execution_id=execution_id, input_data="late\n", session=session
        )
        assert "finished" in refused
    # One transport: B reached A's cluster listener with signed calls, nothing went through
    # Redis lists, and a bare call to that listener is refused.
    await eventually(
        lambda: a.stderr_text().count('"POST /cluster/v1/control HTTP/1.1" 200') >= 3,
        10,
        "A's log to show the control calls B made",
    )
    assert not redis_server.cli_raw("keys", "*control*").strip()
    beat = json.loads(redis_server.cli_raw("get", f"replica:{a.settings['SANDBOX_REPLICA_ID']}"))
    body = json.dumps({"op": "cancel", "execution_id": execution_id}).encode()
    async with httpx2.AsyncClient(timeout=5, trust_env=False) as http:
        unsigned = await http.post(
            f"http://{beat['cluster_address']}/cluster/v1/control", content=body
        )
    assert unsigned.status_code == 403


async def test_killed_replica_execution_becomes_lost_with_its_output_readable(
    tmp_path: Path, redis_server: RedisServer, pair: tuple[ServerProcess, ServerProcess]
) -> None:
    _, b = pair
    doomed = replica(tmp_path, redis_server, f"rdoomed-{uuid.uuid4().hex[:6]}").start()
    session = f"s-{uuid.uuid4().hex[:8]}"
    marker = f"marker-{uuid.uuid4().hex}"
    try:
        execution_id = await start_sleeper(doomed, redis_server, session, marker, 50)
        doomed.kill()  # SIGKILL: no goodbye, no final state
        async with open_client(b.url, TOKEN, "auto") as on_b:
            killed_at = time.monotonic()

            async def lost() -> bool:
                info = await on_b.ok(
                    "get_execution_status", execution_id=execution_id, session=session
                )
                return info["status"] == "lost"

            await eventually(lost, 15, "B to report the execution lost", interval=0.5)
            assert time.monotonic() - killed_at < 15
            text, page = await all_output(on_b, execution_id, session)
            assert text == "".join(f"out{i}\n" for i in range(1, 51))
            assert page["status"] == "lost"
            assert any(e["type"] == "error" for e in page["output"]) or "lost" in json.dumps(page)
            refused = await on_b.error(
                "send_stdin", execution_id=execution_id, input_data="x", session=session
            )
            assert "finished" in refused or "lost" in refused
        await eventually(
            lambda: not processes_with(marker), 10, "the dead replica's sandbox to die"
        )
    finally:
        doomed.kill()


async def test_replica_killed_and_restarted_at_once_under_its_id_loses_its_executions(
    tmp_path: Path, redis_server: RedisServer, pair: tuple[ServerProcess, ServerProcess]
) -> None:
    """SIGKILL, then the same replica id starts again before its heartbeat expires: the dead
    process's running execution reads `lost`, with its output, on the restarted replica and on
    another, within the heartbeat window; Redis says so without any read; cancel finds it."""
    _, b = pair
    replica_id = f"rfast-{uuid.uuid4().hex[:6]}"
    fast = replica(tmp_path, redis_server, replica_id).start()
    session = f"s-{uuid.uuid4().hex[:8]}"
    marker = f"marker-{uuid.uuid4().hex}"
    try:
        execution_id = await start_sleeper(fast, redis_server, session, marker, 20)
        fast.kill()
        restarted_at = time.monotonic()
        fast.start()  # same id, same state dir, same port; its heartbeat has not expired
        window = 3 + 2  # SANDBOX_HEARTBEAT_TTL, and a margin for a loaded machine

        def stored_status() -> str:
            return str(
                json.loads(redis_server.cli_raw("get", f"execution:{execution_id}"))["status"]
            )

        await eventually(lambda: stored_status() == "lost", window, "the store to say lost")
        async with (
            open_client(fast.url, TOKEN, "auto") as on_fast,
            open_client(b.url, TOKEN, "auto") as on_b,
        ):
            for conn in (on_fast, on_b):
                text, page = await all_output(conn, execution_id, session)
                assert text == "".join(f"out{i}\n" for i in range(1, 21))
                assert page["status"] == "lost", page
                waited = await conn.ok(
                    "get_execution_output",
                    execution_id=execution_id,
                    last_event_id=page["next_cursor"],
                    wait=True,
                    session=session,
                )
                assert waited["status"] == "lost"
                cancelled = await conn.ok(
                    "cancel_execution", execution_id=execution_id, session=session
                )
                assert cancelled["was_running"] is False, cancelled
            assert time.monotonic() - restarted_at < window + 10
            # The restarted process's own executions are alive, and read so from B.
            now = await on_fast.ok(
                "execute_code_async", command="sleep 30", session=f"{session}-new"
            )
            await asyncio.sleep(0.5)
            info = await on_b.ok(
                "get_execution_status",
                execution_id=now["execution_id"],
                session=f"{session}-new",
            )
            assert info["status"] == "running", info
            await on_fast.ok(
                "cancel_execution", execution_id=now["execution_id"], session=f"{session}-new"
            )
        await eventually(lambda: not processes_with(marker), 10, "the dead process's sandbox gone")
    finally:
        fast.kill()


def session_home(redis: RedisServer, session: str) -> str:
    """The home replica in a session's record in Redis (empty: no record)."""
    return redis.cli_raw("hget", f"session:default:s:{session}:home", "home").strip()


async def start_sleeper(
    server: ServerProcess, redis: RedisServer, session: str, marker: str, lines: int
) -> str:
    """An execution on `server` that prints `lines` lines, then sleeps (its sleeper marked);
    its id, once Redis has all its output."""
    command = f"for i in $(seq 1 {lines}); do echo out$i; done; sh -c 'sleep 1000;:' {marker}"
    async with open_client(server.url, TOKEN, "auto") as conn:
        started = await conn.ok("execute_code_async", command=command, session=session)
    execution_id: str = started["execution_id"]
    await eventually(lambda: _count_stdout(redis, execution_id, lines), 10, "output mirrored")
    return execution_id


async def _count_stdout(redis_server: RedisServer, execution_id: str, want: int) -> bool:
    raw = redis_server.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
    events = [json.loads(line) for line in raw.splitlines() if line.strip()]
    text = "".join(e.get("data", "") for e in events if e["type"] == "stdout")
    return text.count("\n") >= want


async def test_redis_outage_mid_run_loses_nothing(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    replica_id = f"rout-{uuid.uuid4().hex[:6]}"
    server = replica(tmp_path, redis, replica_id).start()
    session = f"s-{uuid.uuid4().hex[:8]}"
    try:
        async with open_client(server.url, TOKEN, "auto") as conn:
            started = await conn.ok(
                "execute_code_async",
                command="for i in $(seq 1 40); do echo tick$i; sleep 0.1; done",
                session=session,
            )
            execution_id = started["execution_id"]
            await asyncio.sleep(0.5)
            redis.stop()
            health = server.health()
            # Tools keep answering from local state while Redis is down.
            listed = await conn.ok("list_executions", session=session)
            assert execution_id in [e["id"] for e in listed["result"]]
            await eventually(lambda: server.health()["status"] == "degraded", 10, "degraded health")
            health = server.health()
            assert health["redis"].startswith("unavailable")
            final = await conn.ok("execute_code", command="echo still works", session=session)
            assert final["exit_code"] == 0
            page = await conn.ok(
                "get_execution_output", execution_id=execution_id, wait=True, session=session
            )
            while page["status"] == "running":
                page = await conn.ok(
                    "get_execution_output",
                    execution_id=execution_id,
                    last_event_id=page["next_cursor"],
                    wait=True,
                    session=session,
                )
            assert page["status"] == "completed"
            redis.start()  # same port, empty: everything must be written back
            await eventually(lambda: server.health()["status"] == "ok", 15, "reconnect")
            await eventually(
                lambda: _count_stdout(redis, execution_id, 40), 10, "every event back in Redis"
            )
            raw = redis.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
            events = [json.loads(line) for line in raw.splitlines() if line.strip()]
            assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
            assert events[-1]["type"] == "exit"
            meta = json.loads(redis.cli_raw("get", f"execution:{execution_id}"))
            assert meta["status"] == "completed"
            # The session's record, lost with Redis's data, is published again by its home.
            await eventually(
                lambda: session_home(redis, session) == replica_id,
                10,
                "the session's record back",
            )
    finally:
        stop_all(stop_if_running(server), redis.stop)


async def test_redis_restarted_empty_in_an_instant_gets_everything_back(tmp_path: Path) -> None:
    """Redis restarted without persistence between two calls: nothing fails on either replica
    (no connection error shows), the owner notices its heartbeat gone and writes back its
    executions, finished ones too, and the other replica never takes a running one for lost;
    the session's record comes back too, so its next call from the other replica still
    reaches its home and its files."""
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    a_id = f"rqa-{uuid.uuid4().hex[:6]}"
    a = replica(tmp_path, redis, a_id).start()
    b = replica(tmp_path, redis, f"rqb-{uuid.uuid4().hex[:6]}").start()
    session = f"s-{uuid.uuid4().hex[:8]}"
    try:
        async with (
            open_client(a.url, TOKEN, "auto") as on_a,
            open_client(b.url, TOKEN, "auto") as on_b,
        ):
            done = await on_a.ok(
                "execute_code", command="echo finished-before | tee kept.txt", session=session
            )
            started = await on_a.ok(
                "execute_code_async",
                command="for i in $(seq 1 30); do echo tick$i; sleep 0.1; done",
                session=session,
            )
            running_id = started["execution_id"]
            await eventually(lambda: _count_stdout(redis, running_id, 3), 10, "output mirrored")
            redis.stop()
            redis.start()
            seen: list[str] = []
            deadline = time.monotonic() + 20
            while (
                not seen or seen[-1] in ("running", "not found")
            ) and time.monotonic() < deadline:
                result = await on_b.call(
                    "get_execution_status", execution_id=running_id, session=session
                )
                if result.is_error:  # not written back yet: says so, and nothing else
                    assert "not found" in error_text(result), error_text(result)
                    seen.append("not found")
                else:
                    seen.append(str(result.structured_content["status"]))  # type: ignore[index]
                await asyncio.sleep(0.01)
            assert seen[-1] == "completed" and "lost" not in seen, seen
            assert "running" in seen, "B never read the running execution back"
            await eventually(
                lambda: _count_stdout(redis, running_id, 30), 10, "every event back in Redis"
            )
            raw = redis.cli_raw("lrange", f"execution:{running_id}:output", "0", "-1")
            events = [json.loads(line) for line in raw.splitlines() if line.strip()]
            assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
            assert [e["type"] for e in events][-1] == "exit"

            async def finished_back() -> bool:
                got = await on_b.call(
                    "get_execution_status", execution_id=done["execution_id"], session=session
                )
                return not got.is_error

            await eventually(finished_back, 10, "the finished execution back", interval=0.2)
            text, page = await all_output(on_b, done["execution_id"], session)
            assert text == "finished-before\n" and page["status"] == "completed"
            await eventually(
                lambda: session_home(redis, session) == a_id,
                10,
                "the session's record back, homed on A",
            )
            kept = await on_b.ok("execute_code", command="cat kept.txt", session=session)
            stdout = "".join(e.get("data", "") for e in kept["output"] if e["type"] == "stdout")
            assert stdout == "finished-before\n", kept
            assert kept.get("session_reset") is None, kept
            ran = await on_b.ok(
                "get_execution_status", execution_id=kept["execution_id"], session=session
            )
            assert ran["replica_id"] == a_id
    finally:
        stop_all(stop_if_running(a), stop_if_running(b), redis.stop)


async def test_ttls_are_set_and_refreshed_by_reads(
    pair: tuple[ServerProcess, ServerProcess], redis_server: RedisServer
) -> None:
    a, b = pair
    session = f"s-{uuid.uuid4().hex[:8]}"
    async with open_client(a.url, TOKEN, "auto") as on_a, open_client(b.url, TOKEN, "auto") as on_b:
        started = await on_a.ok("execute_code", command="echo ttl", session=session)
        execution_id = started["execution_id"]
        key = f"execution:{execution_id}"
        await eventually(lambda: redis_server.cli_raw("exists", key).strip() == "1", 5, "key")
        for k in (key, f"{key}:output", f"session:default:s:{session}:executions"):
            ttl = int(redis_server.cli_raw("ttl", k))
            assert 3500 < ttl <= 3600, (k, ttl)
        redis_server.cli("expire", key, "100")
        redis_server.cli("expire", f"{key}:output", "100")
        await on_b.ok("get_execution_status", execution_id=execution_id, session=session)
        assert int(redis_server.cli_raw("ttl", key)) > 3500
        assert int(redis_server.cli_raw("ttl", f"{key}:output")) > 3500
        heartbeat = json.loads(
            redis_server.cli_raw("get", f"replica:{a.settings['SANDBOX_REPLICA_ID']}")
        )
        assert heartbeat["replica_id"] == a.settings["SANDBOX_REPLICA_ID"]
        assert 0 < int(redis_server.cli_raw("ttl", f"replica:{heartbeat['replica_id']}")) <= 3


class Ledger:
    """The writes acknowledged for one session (a session_reset forgets the earlier ones)."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.files: dict[str, str] = {}
        self.resets: list[dict[str, Any]] = []

    async def write(self, conn: Conn, name: str) -> bool:
        """Write `name`; whether it was acknowledged. A refusal must say to retry."""
        content = f"{name} {uuid.uuid4().hex}\n"
        result = await conn.call("write_file", path=name, content=content, session=self.session)
        if result.is_error:
            assert "retry" in error_text(result), error_text(result)
            return False
        body = result.structured_content or {}
        if body.get("session_reset"):
            self.resets.append(body["session_reset"])
            self.files.clear()
        self.files[name] = content
        return True

    async def write_until_acknowledged(self, conn: Conn, name: str, within: float) -> None:
        await eventually(lambda: self.write(conn, name), within, f"{name} written", 0.2)

    async def check(self, *conns: Conn) -> None:
        """Every acknowledged write reads back, identical, through every replica."""
        for conn in conns:
            listed = await conn.ok("list_files", session=self.session)
            names = {e["path"].rsplit("/", 1)[-1] for e in listed["entries"]}
            assert set(self.files) <= names, (sorted(self.files), sorted(names))
            for name, content in self.files.items():
                got = await conn.ok("read_file", path=name, session=self.session)
                assert got["content"] == content, name
                assert got.get("session_reset") is None, got


@pytest.fixture
def restart_pair(tmp_path: Path) -> Iterator[tuple[RedisServer, ServerProcess, ServerProcess]]:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    a = replica(tmp_path, redis, f"rea-{uuid.uuid4().hex[:6]}").start()
    b = replica(tmp_path, redis, f"reb-{uuid.uuid4().hex[:6]}").start()
    try:
        yield redis, a, b
    finally:
        stop_all(stop_if_running(a), stop_if_running(b), redis.stop)


async def test_redis_restarted_empty_never_starts_a_session_afresh_on_another_replica(
    restart_pair: tuple[RedisServer, ServerProcess, ServerProcess],
) -> None:
    """A homes a session with a file; Redis restarts empty; a write through B at once waits
    for A to publish the session's record again and lands on A: no second home, nothing
    lost, no reset. A new session through B right after the restart starts once the
    replicas have published what they hold."""
    redis, a, b = restart_pair
    a_id = a.settings["SANDBOX_REPLICA_ID"]
    ledger = Ledger(f"h-{uuid.uuid4().hex[:8]}")
    async with (
        open_client(a.url, TOKEN, "auto") as on_a,
        open_client(b.url, TOKEN, "auto") as on_b,
    ):
        assert await ledger.write(on_a, "f.txt")
        await asyncio.to_thread(redis.stop)
        await asyncio.to_thread(redis.start)
        await ledger.write_until_acknowledged(on_b, "g.txt", 3 + 5)
        fresh = await on_b.ok("write_file", path="n.txt", content="new", session="brand-new")
        assert fresh.get("session_reset") is None
        await ledger.check(on_a, on_b)
        assert ledger.resets == []
        assert session_home(redis, ledger.session) == a_id


async def test_redis_restarted_empty_twice_in_quick_succession_never_makes_two_homes(
    restart_pair: tuple[RedisServer, ServerProcess, ServerProcess],
) -> None:
    """The second outage comes ~0.1 s after the first restart, while a write through B is on
    its way: during it only the home (A) takes writes, B refuses with a retry; when Redis is
    back (empty again) every acknowledged write reads back through both replicas, with no
    reset, and the session is still A's."""
    redis, a, b = restart_pair
    a_id = a.settings["SANDBOX_REPLICA_ID"]
    ledger = Ledger(f"h-{uuid.uuid4().hex[:8]}")
    async with (
        open_client(a.url, TOKEN, "auto") as on_a,
        open_client(b.url, TOKEN, "auto") as on_b,
    ):
        assert await ledger.write(on_a, "f.txt")
        await asyncio.to_thread(redis.stop)
        await asyncio.to_thread(redis.start)
        in_the_gap = asyncio.create_task(ledger.write(on_b, "gap.txt"))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(redis.stop)
        await in_the_gap  # acknowledged (through A) or refused: either way the truth
        assert await ledger.write(on_a, "a-during.txt"), "the home keeps its session"
        assert not await ledger.write(on_b, "b-during.txt"), "B is no home for it"
        await asyncio.to_thread(redis.start)
        await ledger.write_until_acknowledged(on_b, "b-after.txt", 3 + 5)
        assert await ledger.write(on_a, "a-after.txt")
        await ledger.check(on_a, on_b)
        assert ledger.resets == []
        assert session_home(redis, ledger.session) == a_id


async def test_a_home_that_could_not_publish_in_time_makes_its_sessions_next_call_say_so(
    restart_pair: tuple[RedisServer, ServerProcess, ServerProcess],
) -> None:
    """A is frozen (SIGSTOP) across a Redis restart: after a heartbeat TTL B starts the session
    afresh (nobody could tell it existed). When A comes back it finds the session homed on B
    and does not take it back; the session's next call says session_reset store_lost, naming
    A, and A forwards to B from then on: one home."""
    redis, a, b = restart_pair
    a_id, b_id = a.settings["SANDBOX_REPLICA_ID"], b.settings["SANDBOX_REPLICA_ID"]
    ledger = Ledger(f"h-{uuid.uuid4().hex[:8]}")
    async with open_client(b.url, TOKEN, "auto") as on_b:
        async with open_client(a.url, TOKEN, "auto") as on_a:
            assert await ledger.write(on_a, "f.txt")
        os.kill(a.pid, signal.SIGSTOP)
        try:
            await asyncio.to_thread(redis.stop)
            await asyncio.to_thread(redis.start)
            await ledger.write_until_acknowledged(on_b, "g.txt", 3 + 5)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        assert session_home(redis, ledger.session) == b_id

        async def told() -> dict[str, Any] | None:
            listed = await on_b.ok("list_files", session=ledger.session)
            return listed.get("session_reset")

        reset = await eventually(told, 15, "the session's next call to say it started afresh")
        assert reset == {"reason": "store_lost", "previous_replica": a_id}
        async with open_client(a.url, TOKEN, "auto") as on_a:
            listed = await on_a.ok("list_files", session=ledger.session)
            names = {e["path"].rsplit("/", 1)[-1] for e in listed["entries"]}
            assert "g.txt" in names and "f.txt" not in names, names
            assert listed.get("session_reset") is None
        assert session_home(redis, ledger.session) == b_id


async def test_a_home_back_after_its_session_moved_never_publishes_it_again(
    restart_pair: tuple[RedisServer, ServerProcess, ServerProcess],
) -> None:
    """A is frozen past its heartbeat: B re-homes the session (home_lost). A comes back and
    learns the session moved; when Redis then restarts empty, only B publishes the session
    again, and calls through either replica reach B's files: A's stale workspace never comes
    back as a second home, and during an outage A takes no write for it."""
    redis, a, b = restart_pair
    a_id, b_id = a.settings["SANDBOX_REPLICA_ID"], b.settings["SANDBOX_REPLICA_ID"]
    ledger = Ledger(f"h-{uuid.uuid4().hex[:8]}")
    async with open_client(b.url, TOKEN, "auto") as on_b:
        async with open_client(a.url, TOKEN, "auto") as on_a:
            assert await ledger.write(on_a, "f.txt")
        os.kill(a.pid, signal.SIGSTOP)
        try:
            await eventually(
                lambda: redis.cli_raw("exists", f"replica:{a_id}").strip() == "0",
                3 + 5,
                "A's heartbeat to expire",
            )
            await ledger.write_until_acknowledged(on_b, "g.txt", 5)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        assert [r["reason"] for r in ledger.resets] == ["home_lost"]
        assert session_home(redis, ledger.session) == b_id
        await eventually(lambda: a.health()["status"] == "ok", 10, "A back")
        await asyncio.sleep(2)  # (A's heartbeat loop and its resync run meanwhile)
        await asyncio.to_thread(redis.stop)
        await asyncio.to_thread(redis.start)
        async with open_client(a.url, TOKEN, "auto") as on_a:
            await ledger.write_until_acknowledged(on_a, "h.txt", 3 + 5)
            assert session_home(redis, ledger.session) == b_id
            await asyncio.to_thread(redis.stop)
            assert not await ledger.write(on_a, "a-during.txt"), "A is no home for it"
            await asyncio.to_thread(redis.start)
            await ledger.write_until_acknowledged(on_b, "b-after.txt", 3 + 5)
            await ledger.check(on_a, on_b)
        assert [r["reason"] for r in ledger.resets] == ["home_lost"]
        assert session_home(redis, ledger.session) == b_id
