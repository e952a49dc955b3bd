"""The deployed topology with real parts: nginx (shipped config) + 3 replicas + redis-server."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp.shared.exceptions import MCPError
from mcp_harness import eventually, open_client, processes_with
from nginx_harness import COMPOSE_REPLICAS, SHIPPED, check_config, generate, main_config
from topology_harness import TOKEN, Topology, running_topology

pytestmark = pytest.mark.e2e


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    with running_topology(tmp_path) as topology:
        yield topology


def test_shipped_nginx_config_is_the_generated_one_and_passes_nginx_t(tmp_path: Path) -> None:
    regenerated = generate("8080", COMPOSE_REPLICAS, tmp_path / "regenerated.conf")
    assert regenerated == SHIPPED.read_text(), "deploy/nginx/sandbox-runtime.conf is stale"
    # The shipped file names compose services; outside compose they resolve nowhere, so point
    # them at loopback and change nothing else.
    local = tmp_path / "local.conf"
    local.write_text(re.sub(r"replica\d:8080", "127.0.0.1:8080", SHIPPED.read_text()))
    result = check_config(main_config(tmp_path / "nginx", local))
    assert result.returncode == 0, result.stderr
    assert "syntax is ok" in result.stderr


async def test_legacy_session_sticks_to_one_replica_and_sessionless_calls_reach_all(
    topology: Topology,
) -> None:
    async with open_client(topology.nginx.url, TOKEN, "legacy") as legacy:
        tag = (legacy.session_id or "").split(".")[0]
        assert tag in topology.replicas, f"session id {legacy.session_id!r} carries no tag"
        seen = set()
        for _ in range(6):
            out = await legacy.ok("execute_code", command="echo sticky")
            seen.add(topology.replica_of(out["execution_id"]))
        assert seen == {tag}
    async with open_client(topology.nginx.url, TOKEN, "auto") as modern:
        # Sessionless calls are spread over the replicas; the default session's executions
        # all run on its one home, the others forwarding to it.
        seen = set()
        for _ in range(12):
            out = await modern.ok("execute_code", command="echo spread")
            seen.add(topology.replica_of(out["execution_id"]))
        assert len(seen) == 1, seen
        home = seen.pop()
        recorded = topology.redis.cli_raw("hget", "session:default:default:home", "home")
        assert recorded.strip() == home
        forwarders = [
            rid
            for rid in topology.replicas
            if rid != home and topology.metric(rid, "srt_forwarded_calls_total") > 0
        ]
        assert forwarders, "no replica forwarded a call: nginx did not spread them"


async def test_execution_is_polled_fed_and_cancelled_through_nginx_from_a_new_session(
    topology: Topology,
) -> None:
    session = f"work-{uuid.uuid4().hex[:8]}"
    marker = f"marker-{uuid.uuid4().hex}"
    async with open_client(topology.nginx.url, TOKEN, "legacy") as first:
        started = await first.ok(
            "execute_code_async",
            command=f"cat; sh -c 'sleep 1000; :' {marker}",
            interactive=True,
            session=session,
        )
    execution_id = started["execution_id"]
    owner = topology.replica_of(execution_id)
    for mode in ("legacy", "auto"):
        async with open_client(topology.nginx.url, TOKEN, mode) as again:
            status = await again.ok(
                "get_execution_status", execution_id=execution_id, session=session
            )
            assert status["status"] == "running" and status["replica_id"] == owner
            await again.ok(
                "send_stdin", execution_id=execution_id, input_data=f"via {mode}\n", session=session
            )
    async with open_client(topology.nginx.url, TOKEN, "auto") as last:
        text = ""
        cursor = "0"
        deadline = time.monotonic() + 10
        while "via auto" not in text and time.monotonic() < deadline:
            page = await last.ok(
                "get_execution_output",
                execution_id=execution_id,
                last_event_id=cursor,
                wait=True,
                wait_seconds=2,
                session=session,
            )
            text += "".join(e.get("data", "") for e in page["output"])
            cursor = page["next_cursor"]
        assert "via legacy\nvia auto\n" in text
        cancelled = await last.ok("cancel_execution", execution_id=execution_id, session=session)
        assert cancelled["status"] == "cancelled"
    assert not processes_with(marker)


async def test_killed_replica_client_reinitializes_sees_lost_and_reads_mirrored_output(
    topology: Topology,
) -> None:
    session = f"doomed-{uuid.uuid4().hex[:8]}"
    async with open_client(topology.nginx.url, TOKEN, "legacy") as legacy:
        started = await legacy.ok(
            "execute_code_async",
            command="for i in $(seq 1 30); do echo row$i; done; sleep 1000",
            session=session,
        )
        execution_id = started["execution_id"]
        owner = topology.replica_of(execution_id)
        assert (legacy.session_id or "").startswith(owner + ".")

        async def mirrored() -> bool:
            raw = topology.redis.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
            return raw.count("row") >= 30

        await eventually(mirrored, 10, "output mirrored")
        topology.replicas[owner].kill()
        # The session's replica is gone: nginx hands the request to a backup, which answers
        # 404 "Session not found"; the client learns its session is over.
        with pytest.raises(MCPError):
            await legacy.call("list_executions", session=session)
    async with open_client(topology.nginx.url, TOKEN, "legacy") as fresh:
        assert not (fresh.session_id or "").startswith(owner + ".")

        async def lost() -> bool:
            info = await fresh.ok(
                "get_execution_status", execution_id=execution_id, session=session
            )
            return info["status"] == "lost"

        await eventually(lost, 15, "lost status")
        text, cursor = "", "0"
        while True:
            page = await fresh.ok(
                "get_execution_output",
                execution_id=execution_id,
                last_event_id=cursor,
                session=session,
            )
            text += "".join(e.get("data", "") for e in page["output"] if e["type"] == "stdout")
            cursor = page["next_cursor"]
            if not page["has_more"]:
                break
        assert text == "".join(f"row{i}\n" for i in range(1, 31))


async def test_sigterm_replica_records_final_states_and_nginx_stops_sending_to_it(
    topology: Topology,
) -> None:
    session = f"term-{uuid.uuid4().hex[:8]}"
    victim_id = next(iter(topology.replicas))
    victim = topology.replicas[victim_id]
    async with open_client(victim.url, TOKEN, "auto") as direct:
        started = await direct.ok("execute_code_async", command="sleep 1000", session=session)
    execution_id = started["execution_id"]
    victim.stop()
    meta = json.loads(topology.redis.cli_raw("get", f"execution:{execution_id}"))
    assert meta["status"] == "cancelled", meta
    assert meta["exit_code"] is not None
    raw = topology.redis.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
    assert [json.loads(line)["type"] for line in raw.splitlines()][-2:] == ["cancelled", "exit"]
    assert topology.redis.cli_raw("exists", f"replica:{victim_id}").strip() == "0"
    async with open_client(topology.nginx.url, TOKEN, "auto") as modern:
        seen = set()
        for _ in range(8):
            out = await modern.ok("execute_code", command="echo after")
            seen.add(topology.replica_of(out["execution_id"]))
        assert victim_id not in seen and seen


async def test_redis_restart_through_nginx_loses_nothing_already_produced(
    topology: Topology,
) -> None:
    session = f"rr-{uuid.uuid4().hex[:8]}"
    async with open_client(topology.nginx.url, TOKEN, "auto") as conn:
        started = await conn.ok(
            "execute_code_async",
            command="for i in $(seq 1 30); do echo beat$i; sleep 0.05; done",
            session=session,
        )
        execution_id = started["execution_id"]
        owner = topology.replica_of(execution_id)
        topology.redis.stop()
        topology.redis.start()

        async def complete() -> bool:
            raw = topology.redis.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
            events = [json.loads(line) for line in raw.splitlines() if line.strip()]
            return bool(events) and events[-1]["type"] == "exit"

        await eventually(complete, 20, "every event back in Redis")
        raw = topology.redis.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
        events = [json.loads(line) for line in raw.splitlines()]
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        text = "".join(e.get("data", "") for e in events if e["type"] == "stdout")
        assert text == "".join(f"beat{i}\n" for i in range(1, 31))
        status = await conn.ok("get_execution_status", execution_id=execution_id, session=session)
        assert status["status"] == "completed" and status["replica_id"] == owner
    # Every replica answers at once, those that kept connections from before the restart too.
    for replica in topology.replicas.values():
        async with open_client(replica.url, TOKEN, "auto") as direct:
            status = await direct.ok(
                "get_execution_status", execution_id=execution_id, session=session
            )
            assert status["status"] == "completed" and status["replica_id"] == owner
