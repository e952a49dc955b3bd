"""Sessions across replicas: one home per session, every replica answers for it.

Real parts: redis-server, three replica processes with a state directory each (as on three
machines), nginx with the shipped config, the official MCP client in both protocol eras.
"""

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

import anyio
import httpx2
import pytest
from mcp_harness import (
    CLUSTER_SECRET,
    Conn,
    Mode,
    error_text,
    eventually,
    open_client,
    processes_with,
    run_server_once,
    running_server,
)
from redis_harness import RedisServer
from topology_harness import TOKEN, Topology, replica_server, running_topology

from sandbox_runtime.sessions.signing import ClusterSigner

pytestmark = pytest.mark.e2e

OTHER_TOKEN = "other-principal-token-1234"


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    with running_topology(
        tmp_path,
        SANDBOX_MAX_CONCURRENT="64",
        SANDBOX_AUTH_TOKENS=f"other:{OTHER_TOKEN}",
    ) as topology:
        yield topology


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


async def all_output(conn: Conn, execution_id: str, session: str) -> str:
    text, cursor = "", "0"
    while True:
        page = await conn.ok(
            "get_execution_output", execution_id=execution_id, last_event_id=cursor, session=session
        )
        text += "".join(e.get("data", "") for e in page["output"] if e["type"] == "stdout")
        cursor = page["next_cursor"]
        if not page["has_more"]:
            return text


def cluster_address(topology: Topology, rid: str) -> str:
    beat = json.loads(topology.redis.cli_raw("get", f"replica:{rid}"))
    return str(beat["cluster_address"])


def incarnation_of(topology: Topology, rid: str) -> str:
    """The process replica `rid` runs as now (its heartbeat's): proofs for it name it."""
    return str(json.loads(topology.redis.cli_raw("get", f"replica:{rid}"))["incarnation"])


async def test_fifty_sessions_at_once_each_read_back_their_file_through_nginx(
    topology: Topology,
) -> None:
    """Both eras, both ways of naming the session; each call on a connection of its own, so
    nginx sends the two calls of a session wherever it likes."""

    async def one(i: int) -> tuple[str, str, str, str]:
        session = unique(f"fifty{i}")
        mode: Mode = "auto" if i % 2 else "legacy"
        by_path = (i // 2) % 2 == 1
        url = topology.session_url(session) if by_path else topology.nginx.url
        named: dict[str, str] = {} if by_path else {"session": session}
        token = uuid.uuid4().hex
        async with open_client(url, TOKEN, mode) as conn:
            wrote = await conn.ok(
                "execute_code", command=f"echo {token} > /workspace/f.txt", **named
            )
        async with open_client(url, TOKEN, mode) as conn:
            read = await conn.ok("execute_code", command="cat /workspace/f.txt", **named)
        assert wrote["exit_code"] == 0 and read["exit_code"] == 0, (wrote, read)
        assert wrote.get("session_reset") is None and read.get("session_reset") is None
        assert stdout_of(read) == f"{token}\n", (session, read)
        return (
            session,
            topology.replica_of(wrote["execution_id"]),
            topology.replica_of(read["execution_id"]),
            str(topology.home_of("default", session)),
        )

    results = await asyncio.gather(*(one(i) for i in range(50)))
    for session, first, second, home in results:
        assert first == second == home, (session, first, second, home)
    homes = {home for _, _, _, home in results}
    assert len(homes) > 1, "every session got the same home: nothing was spread"
    forwarded = sum(topology.metric(r, "srt_forwarded_calls_total") for r in topology.replicas)
    assert forwarded > 0, "no call was forwarded: the test did not cross replicas"


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_forwarded_execute_code_streams_progress_while_it_waits(
    topology: Topology, mode: Mode
) -> None:
    home, other = list(topology.replicas)[:2]
    session = unique("progress")
    async with open_client(topology.replicas[home].url, TOKEN, mode) as on_home:
        await on_home.ok("execute_code", command="true", session=session)
    assert topology.home_of("default", session) == home
    arrivals: list[tuple[float, str]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        arrivals.append((time.monotonic(), message or ""))

    async with open_client(topology.replicas[other].url, TOKEN, mode) as on_other:
        result = await on_other.call(
            "execute_code",
            progress=on_progress,
            command="for i in 1 2 3 4 5; do echo tick$i; sleep 0.4; done",
            session=session,
        )
        returned = time.monotonic()
    assert not result.is_error, error_text(result)
    assert result.structured_content is not None
    assert topology.replica_of(result.structured_content["execution_id"]) == home
    streamed = "".join(message for _, message in arrivals)
    assert "tick1" in streamed and "tick4" in streamed, arrivals
    first = next(at for at, message in arrivals if "tick1" in message)
    assert returned - first > 1.0, "the output reached the caller only at the end"
    assert topology.metric(other, "srt_forwarded_calls_total") >= 1


async def test_caller_that_gives_up_ends_the_forwarded_wait_not_the_execution(
    topology: Topology,
) -> None:
    home, other = list(topology.replicas)[:2]
    session = unique("giveup")
    marker = unique("marker")
    async with open_client(topology.replicas[home].url, TOKEN, "auto") as on_home:
        await on_home.ok("execute_code", command="true", session=session)
    async with open_client(topology.replicas[other].url, TOKEN, "auto") as on_other:
        with anyio.move_on_after(2):
            await on_other.call(
                "execute_code", command=f"sh -c 'sleep 60; :' {marker}", session=session
            )

    async def serving_nothing() -> bool:
        return topology.metric(home, "srt_forwarded_calls_serving") == 0

    await eventually(serving_nothing, 10, "the home to stop serving the abandoned call")
    assert processes_with(marker), "the execution itself should run on"
    async with open_client(topology.replicas[home].url, TOKEN, "auto") as on_home:
        running = await on_home.ok("list_executions", status="running", session=session)
        assert len(running["result"]) == 1
        await on_home.ok(
            "cancel_execution",
            execution_id=running["result"][0]["id"],
            session=session,
        )
    assert not processes_with(marker)


async def test_killed_home_rehomes_the_session_with_session_reset_and_old_runs_read_lost(
    topology: Topology,
) -> None:
    session = unique("doomed")
    home = next(iter(topology.replicas))
    async with open_client(topology.replicas[home].url, TOKEN, "auto") as on_home:
        await on_home.ok(
            "execute_code", command="echo precious > /workspace/keep.txt", session=session
        )
        started = await on_home.ok(
            "execute_code_async",
            command="for i in $(seq 1 30); do echo row$i; done; sleep 1000",
            session=session,
        )
    execution_id = started["execution_id"]

    def mirrored() -> bool:
        raw = topology.redis.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
        return raw.count("row") >= 30

    await eventually(mirrored, 10, "output mirrored")
    topology.replicas[home].kill()

    async with open_client(topology.nginx.url, TOKEN, "auto") as conn:

        async def rehomed() -> dict[str, Any] | None:
            result = await conn.call(
                "execute_code", command="cat /workspace/keep.txt; echo fresh", session=session
            )
            if result.is_error:  # the home is gone but its heartbeat has not expired yet
                assert "does not answer" in error_text(result), error_text(result)
                return None
            assert result.structured_content is not None
            return dict(result.structured_content)

        result = await eventually(rehomed, 20, "the session to be re-homed", interval=0.5)
        assert result["session_reset"] == {"reason": "home_lost", "previous_replica": home}
        assert stdout_of(result) == "fresh\n", "a re-homed session starts with a fresh workspace"
        new_home = topology.home_of("default", session)
        assert new_home not in (None, home)
        assert topology.replica_of(result["execution_id"]) == new_home
        again = await conn.ok("execute_code", command="echo once more", session=session)
        assert again.get("session_reset") is None
        listed = await conn.ok("list_executions", session=session)
        statuses = {e["id"]: e["status"] for e in listed["result"]}
        assert statuses[execution_id] == "lost"
        assert len(statuses) == 4
        assert await all_output(conn, execution_id, session) == "".join(
            f"row{i}\n" for i in range(1, 31)
        )


async def test_sigterm_of_the_home_rehomes_its_sessions_at_once(tmp_path: Path) -> None:
    # Heartbeats outlive the whole test: only the release on SIGTERM can move the session.
    with running_topology(tmp_path, SANDBOX_HEARTBEAT_TTL="120") as topology:
        session = unique("term")
        home = next(iter(topology.replicas))
        url = topology.session_url(session)
        async with open_client(
            topology.replicas[home].url.replace("/mcp", f"/s/{session}/mcp"), TOKEN, "legacy"
        ) as on_home:
            await on_home.ok("execute_code", command="echo x > /workspace/x")
        assert topology.home_of("default", session) == home
        topology.replicas[home].stop()
        assert (
            topology.redis.cli_raw("hget", f"session:default:s:{session}:home", "state").strip()
            == "released"
        )
        async with open_client(url, TOKEN, "auto") as conn:
            result = await conn.ok("execute_code", command="ls /workspace")
        assert result["session_reset"] == {"reason": "home_stopped", "previous_replica": home}
        assert stdout_of(result) == ""
        assert topology.home_of("default", session) not in (None, home)


async def test_forged_or_replayed_control_calls_to_the_cluster_port_do_nothing(
    topology: Topology,
) -> None:
    home = next(iter(topology.replicas))
    session = unique("forge")
    address = cluster_address(topology, home)
    inc = incarnation_of(topology, home)
    url = f"http://{address}/cluster/v1/control"
    async with open_client(topology.replicas[home].url, TOKEN, "auto") as conn:
        started = await conn.ok(
            "execute_code_async", command="cat", interactive=True, session=session
        )
        execution_id = started["execution_id"]
        base = {
            "execution_id": execution_id,
            "principal": "default",
            "session_id": f"s:{session}",
        }
        cancel = json.dumps({**base, "op": "cancel", "force": True}).encode()
        intruder = ClusterSigner(CLUSTER_SECRET, "intruder")
        real_time = time.time
        time.time = lambda: real_time() - 600  # type: ignore[assignment]  # signed long ago
        try:
            stale = intruder.sign_call(home, inc, "POST", "/cluster/v1/control", cancel)
        finally:
            time.time = real_time  # type: ignore[method-assign]
        refused = {
            "unsigned": None,
            "forged": ClusterSigner("a-different-secret-0123456789", "intruder").sign_call(
                home, inc, "POST", "/cluster/v1/control", cancel
            ),
            "for another replica": intruder.sign_call(
                "another-replica", inc, "POST", "/cluster/v1/control", cancel
            ),
            "a forwarded call's proof": intruder.sign_call(
                home, inc, "POST", "/cluster/v1/call", cancel
            ),
            "stale": stale,
        }
        stdin = json.dumps({**base, "op": "stdin", "data": "once\n", "close": False}).encode()
        genuine = intruder.sign_call(home, inc, "POST", "/cluster/v1/control", stdin)
        async with httpx2.AsyncClient(timeout=10, trust_env=False) as http:
            for what, header in refused.items():
                headers = {"x-srt-cluster-signature": header} if header else {}
                response = await http.post(url, content=cancel, headers=headers)
                assert response.status_code == 403, (what, response.status_code, response.text)
            first = await http.post(
                url, content=stdin, headers={"x-srt-cluster-signature": genuine}
            )
            assert first.status_code == 200
            answer = json.loads(json.loads(first.text.strip().splitlines()[-1])["answer"])
            assert answer["result"]["bytes_written"] == len("once\n"), answer
            replayed = await http.post(
                url, content=stdin, headers={"x-srt-cluster-signature": genuine}
            )
            assert replayed.status_code == 403
        assert topology.metric(home, "srt_control_refused_total") >= len(refused) + 1
        status = await conn.ok("get_execution_status", execution_id=execution_id, session=session)
        assert status["status"] == "running", "a forged cancel was acted on"
        await conn.ok(
            "send_stdin",
            execution_id=execution_id,
            input_data="end\n",
            close_stdin=True,
            session=session,
        )

        async def ended() -> bool:  # cat ends at the end of its input: all it echoed is in
            info = await conn.ok("get_execution_status", execution_id=execution_id, session=session)
            return bool(info["status"] == "completed")

        await eventually(ended, 10, "cat ended after its stdin closed")
        text = await all_output(conn, execution_id, session)
        assert text == "once\nend\n", f"the replayed stdin was acted on twice: {text!r}"


async def test_per_principal_limits_hold_across_sessions_and_replicas(tmp_path: Path) -> None:
    with running_topology(
        tmp_path,
        SANDBOX_MAX_SESSIONS_PER_PRINCIPAL="3",
        SANDBOX_MAX_RUNNING_PER_PRINCIPAL="2",
        SANDBOX_AUTH_TOKENS=f"other:{OTHER_TOKEN}",
    ) as topology:
        a, b, c = (topology.replicas[r].url for r in topology.replicas)
        tag = uuid.uuid4().hex[:6]
        async with (
            open_client(a, TOKEN, "auto") as on_a,
            open_client(b, TOKEN, "legacy") as on_b,
            open_client(c, TOKEN, "auto") as on_c,
            open_client(c, OTHER_TOKEN, "auto") as other_on_c,
        ):
            first = await on_a.ok("execute_code_async", command="sleep 1000", session=f"l1{tag}")
            await on_b.ok("execute_code_async", command="sleep 1000", session=f"l2{tag}")
            refused = await on_c.error("execute_code", command="true", session=f"l3{tag}")
            assert "maximum of 2 executions across all its sessions" in refused
            assert (await other_on_c.ok("execute_code", command="true", session="x"))[
                "exit_code"
            ] == 0
            await on_c.ok(
                "cancel_execution", execution_id=first["execution_id"], session=f"l1{tag}"
            )
            assert (await on_c.ok("execute_code", command="true", session=f"l3{tag}"))[
                "exit_code"
            ] == 0
            too_many = await on_b.error("execute_code", command="true", session=f"l4{tag}")
            assert "maximum of 3 live sessions" in too_many
            # Existing sessions still work, on any replica.
            assert (await on_a.ok("execute_code", command="true", session=f"l3{tag}"))[
                "exit_code"
            ] == 0


async def test_cluster_listener_is_unreachable_through_nginx_and_refuses_unsigned_calls(
    topology: Topology,
) -> None:
    rid = next(iter(topology.replicas))
    address = cluster_address(topology, rid)
    inc = incarnation_of(topology, rid)
    nginx = f"http://127.0.0.1:{topology.nginx.port}"
    public = topology.replicas[rid].base_url
    async with httpx2.AsyncClient(timeout=5) as http:
        for base in (nginx, public):
            for path in ("/cluster/v1/call", "/s/x/../../cluster/v1/call", "/CLUSTER/v1/call"):
                response = await http.post(f"{base}{path}", content=b"{}")
                assert response.status_code == 404, (base, path, response.status_code)
        body = json.dumps(
            {
                "op": "execute",
                "principal": "default",
                "session_id": "s:x",
                "args": {"request": {"command": "id"}, "wait": True},
            }
        ).encode()
        unsigned = await http.post(f"http://{address}/cluster/v1/call", content=body)
        assert unsigned.status_code == 403
        wrong = ClusterSigner("a-different-secret-0123456789", "x").sign_call(
            rid, inc, "POST", "/cluster/v1/call", body
        )
        forged = await http.post(
            f"http://{address}/cluster/v1/call",
            content=body,
            headers={"x-srt-cluster-signature": wrong},
        )
        assert forged.status_code == 403
        good = ClusterSigner(CLUSTER_SECRET, "x").sign_call(
            rid, inc, "POST", "/cluster/v1/call", body
        )
        first = await http.post(
            f"http://{address}/cluster/v1/call",
            content=body,
            headers={"x-srt-cluster-signature": good},
        )
        assert first.status_code == 200
        replayed = await http.post(
            f"http://{address}/cluster/v1/call",
            content=body,
            headers={"x-srt-cluster-signature": good},
        )
        assert replayed.status_code == 403
        mcp_on_cluster_port = await http.post(f"http://{address}/mcp", content=b"{}")
        assert mcp_on_cluster_port.status_code == 404


async def test_session_in_the_url_binds_the_endpoint_and_a_disagreeing_argument_is_an_error(
    topology: Topology,
) -> None:
    session = unique("bound")
    async with open_client(topology.session_url(session), TOKEN, "auto") as conn:
        await conn.ok("execute_code", command="echo hi > /workspace/hi")
        same = await conn.ok("execute_code", command="cat /workspace/hi", session=session)
        assert stdout_of(same) == "hi\n"
        message = await conn.error("execute_code", command="true", session="another")
        assert "bound to session" in message
        listed = await conn.ok("list_executions")
        assert len(listed["result"]) == 2
        assert all(e["session"] == session for e in listed["result"])
    async with httpx2.AsyncClient(timeout=5) as http:
        bad = await http.post(
            f"{topology.replicas[next(iter(topology.replicas))].base_url}/s/bad%20name/mcp",
            content=b"{}",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert bad.status_code == 404


async def test_a_replica_without_the_secret_refuses_to_join_one_with_another_is_degraded(
    topology: Topology, tmp_path: Path
) -> None:
    redis_url = topology.redis.url
    (tmp_path / "nosecret").mkdir()
    (tmp_path / "othersecret").mkdir()
    code, stderr = run_server_once(
        tmp_path / "nosecret", REDIS_URL=redis_url, SANDBOX_AUTH_TOKEN=TOKEN
    )
    assert code != 0 and "SANDBOX_CLUSTER_SECRET is not set" in stderr, stderr
    assert CLUSTER_SECRET not in stderr
    # Another secret: it runs (one stray heartbeat must not stop every start) but says what is
    # wrong, and so do the others about it.
    odd = replica_server(tmp_path, topology.redis, "odd", SANDBOX_CLUSTER_SECRET="b" * 20).start()
    try:
        health = odd.health()
        assert health["status"] == "degraded"
        assert "different SANDBOX_CLUSTER_SECRET" in health["cluster"]
        some = topology.replicas[next(iter(topology.replicas))]
        await eventually(
            lambda: "odd" in some.health()["cluster"], 15, "the others to notice", interval=0.5
        )
    finally:
        odd.stop()
    for server in [*topology.replicas.values(), odd]:
        assert CLUSTER_SECRET not in server.stderr_text()
        assert "b" * 20 not in server.stderr_text()


async def test_one_replica_without_redis_reports_a_removed_workspace_and_limits_principals(
    tmp_path: Path,
) -> None:
    with running_server(
        tmp_path,
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_MAX_RUNNING_PER_PRINCIPAL="1",
        SANDBOX_RETENTION_SECONDS="4",  # the retention sweep runs every second
        SANDBOX_WORKSPACE_RETENTION_SECONDS="60",
    ) as server:
        replica_id = server.health()["replica_id"]
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("execute_code", command="echo a > /workspace/a", session="ws")
            url = (await conn.ok("create_file_url", path="a", session="ws"))["url"]
            (workspace,) = [
                p for p in (server.state_dir / "workspaces").iterdir() if (p / "a").exists()
            ]
            # Unused for two minutes, as far as the sweep can tell: it removes the workspace.
            image = workspace.with_name(workspace.name + ".img")
            os.utime(image, (time.time() - 120, time.time() - 120))
            await eventually(lambda: not image.exists(), 10, "the sweep to remove it")
            # A file URL finds nothing there; the next tool call, a file tool, is told why.
            async with httpx2.AsyncClient() as http:
                assert (await http.get(url)).status_code == 404
            again = await conn.ok("list_files", session="ws")
            assert again["session_reset"] == {
                "reason": "workspace_removed",
                "previous_replica": replica_id,
            }
            assert again["entries"] == []
            listed = await conn.ok("execute_code", command="ls -A /workspace", session="ws")
            assert listed.get("session_reset") is None and stdout_of(listed) == ""
            third = await conn.ok("execute_code", command="true", session="ws")
            assert third.get("session_reset") is None
            started = await conn.ok("execute_code_async", command="sleep 100", session="s1")
            refused = await conn.error("execute_code", command="true", session="s2")
            assert "maximum of 1 executions across all its sessions" in refused
            await conn.ok("cancel_execution", execution_id=started["execution_id"], session="s1")
            assert (await conn.ok("execute_code", command="true", session="s2"))["exit_code"] == 0


async def test_a_reset_is_told_even_when_the_first_call_after_it_fails(topology: Topology) -> None:
    session = unique("owed")
    first, second = list(topology.replicas)[:2]
    async with open_client(topology.replicas[first].url, TOKEN, "auto") as on_first:
        await on_first.ok("execute_code", command="echo x > /workspace/x", session=session)
    topology.replicas[first].stop()
    async with open_client(topology.replicas[second].url, TOKEN, "auto") as conn:
        refused = await conn.error("execute_code", command="", session=session)
        assert "must not be empty" in refused
        told = await conn.ok("execute_code", command="ls -A /workspace", session=session)
        assert told["session_reset"] == {"reason": "home_stopped", "previous_replica": first}
        assert stdout_of(told) == ""
        again = await conn.ok("execute_code", command="true", session=session)
        assert again.get("session_reset") is None


async def test_a_forwarded_call_reports_a_workspace_the_home_lost(
    topology: Topology, tmp_path: Path
) -> None:
    session = unique("lostws")
    other = next(iter(topology.replicas))
    # A home that sweeps every second (its retention is short), joining the deployment.
    home = replica_server(
        tmp_path,
        topology.redis,
        unique("sweeper"),
        SANDBOX_RETENTION_SECONDS="4",
        SANDBOX_WORKSPACE_RETENTION_SECONDS="60",
    ).start()
    try:
        async with open_client(home.url, TOKEN, "auto") as on_home:
            await on_home.ok("execute_code", command="echo keep > /workspace/keep", session=session)
        workspaces = home.state_dir / "workspaces"
        (workspace,) = [p for p in workspaces.iterdir() if (p / "keep").exists()]
        image = workspace.with_name(workspace.name + ".img")
        os.utime(image, (time.time() - 120, time.time() - 120))  # unused for two minutes
        await eventually(lambda: not image.exists(), 10, "the sweep to remove the workspace")
        async with open_client(topology.replicas[other].url, TOKEN, "auto") as on_other:
            result = await on_other.ok("execute_code", command="ls -A /workspace", session=session)
        home_id = home.health()["replica_id"]
        assert result["session_reset"] == {
            "reason": "workspace_removed",
            "previous_replica": home_id,
        }
        assert stdout_of(result) == ""
        assert topology.replica_of(result["execution_id"]) == home_id
    finally:
        home.stop()


async def test_a_frozen_home_gives_a_clear_error_not_a_hang(topology: Topology) -> None:
    session = unique("frozen")
    home, other = list(topology.replicas)[:2]
    async with open_client(topology.replicas[home].url, TOKEN, "auto") as on_home:
        await on_home.ok("execute_code", command="true", session=session)
    frozen = topology.replicas[home]
    assert frozen.proc is not None
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        async with open_client(topology.replicas[other].url, TOKEN, "auto") as conn:
            started = time.monotonic()
            with anyio.fail_after(40):
                result = await conn.call("execute_code_async", command="true", session=session)
            assert result.is_error
            assert "replica" in error_text(result), error_text(result)
            assert time.monotonic() - started < 35
    finally:
        frozen.proc.send_signal(signal.SIGCONT)


async def test_the_cluster_listener_reads_no_body_without_a_valid_signature_header(
    topology: Topology,
) -> None:
    rid = next(iter(topology.replicas))
    host, port = cluster_address(topology, rid).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        # 100 MB announced, nothing sent: refused at once, without waiting for the body.
        writer.write(
            b"POST /cluster/v1/call HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n"
        )
        await writer.drain()
        with anyio.fail_after(5):
            status = await reader.readline()
        assert b" 403 " in status, status
    finally:
        writer.close()
    for raw_path in (b"/cluster/v1/../v1/call", b"//cluster/v1/call"):
        reader, writer = await asyncio.open_connection("127.0.0.1", topology.nginx.port)
        try:
            writer.write(
                b"POST " + raw_path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
            )
            await writer.drain()
            with anyio.fail_after(5):
                status = await reader.readline()
            assert b" 404 " in status, (raw_path, status)
        finally:
            writer.close()


async def test_session_endpoints_through_nginx_reach_their_home_without_forwarding(
    topology: Topology,
) -> None:
    before = sum(topology.metric(r, "srt_forwarded_calls_total") for r in topology.replicas)
    sessions = [unique("hashed") for _ in range(10)]
    for session in sessions:
        async with open_client(topology.session_url(session), TOKEN, "auto") as conn:
            for _ in range(3):
                await conn.ok("execute_code", command="true")
    after = sum(topology.metric(r, "srt_forwarded_calls_total") for r in topology.replicas)
    assert after == before, "nginx's hash sent a session's calls to several replicas"
    homes = {topology.home_of("default", s) for s in sessions}
    assert len(homes) > 1, "every session hashed to one replica"


async def test_redis_down_a_replica_runs_its_sessions_and_makes_no_home_it_cannot_record(
    tmp_path: Path,
) -> None:
    """Without Redis a replica serves the sessions homed on it while its last heartbeat lives
    (nobody can take them before; after that it refuses them too, with a retry) and refuses a
    session it cannot record as its own: another replica, unseen, could make itself that
    session's home too."""
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    server = replica_server(tmp_path, redis, "alone").start()
    try:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("execute_code", command="true", session="known")
            redis.stop()
            refused = await conn.error("execute_code", command="echo up", session="brand-new")
            assert "shared store is unavailable" in refused and "retry" in refused, refused
            known = await conn.ok("execute_code", command="true", session="known")
            assert known["exit_code"] == 0

            async def unsure() -> str:
                result = await conn.call("execute_code", command="true", session="known")
                return error_text(result) if result.is_error else ""

            # Past its last heartbeat's life (SANDBOX_HEARTBEAT_TTL=3) another replica could
            # have taken the session: it is refused, with a retry, until Redis is back.
            refused = await eventually(unsure, 3 + 3, "the known session refused", 0.5)
            assert "no longer be sure" in refused and "retry" in refused, refused
            redis.start()

            async def started() -> bool:
                result = await conn.call("execute_code", command="echo up", session="brand-new")
                return not result.is_error and stdout_of(result.structured_content) == "up\n"

            await eventually(started, 15, "the new session to start once Redis is back", 0.5)
    finally:
        server.stop()
        redis.stop()
