"""Split roles (DESIGN §16): api replicas that run nothing, workers that take sessions from
the placement queue, on one real redis-server; each replica its own state dir."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import ServerProcess, Servers, free_port, open_client, replica_process
from redis_harness import RedisServer

pytestmark = pytest.mark.e2e

TOKEN = "roles-test-token-0123456"


def worker(workdir: Path, redis: RedisServer, name: str, **settings: str) -> ServerProcess:
    server = replica_process(workdir, redis.url, name, TOKEN, SANDBOX_ROLE="worker", **settings)
    # (a worker listens only on its cluster port: the harness's port is that one)
    server.settings.update(SANDBOX_CLUSTER_PORT=str(server.port), SANDBOX_PORT=str(free_port()))
    return server


def api(workdir: Path, redis: RedisServer, name: str, **settings: str) -> ServerProcess:
    return replica_process(workdir, redis.url, name, TOKEN, SANDBOX_ROLE="api", **settings)


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


async def test_sessions_are_placed_on_workers_and_reached_from_any_api(
    tmp_path: Path, redis_server: RedisServer, serve: Servers
) -> None:
    w1 = serve.add(worker(tmp_path, redis_server, f"w1-{uuid.uuid4().hex[:4]}"), healthy=False)
    w2 = serve.add(worker(tmp_path, redis_server, f"w2-{uuid.uuid4().hex[:4]}"), healthy=False)
    a1 = serve.add(api(tmp_path, redis_server, f"a1-{uuid.uuid4().hex[:4]}"), healthy=False)
    a2 = serve.add(api(tmp_path, redis_server, f"a2-{uuid.uuid4().hex[:4]}"), healthy=False)
    assert a1.health()["role"] == "api" and w1.health()["role"] == "worker"
    sessions = [f"s{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    async with (
        open_client(a1.url, TOKEN, "auto") as on_a1,
        open_client(a2.url, TOKEN, "legacy") as on_a2,
    ):
        for session in sessions:
            result = await on_a1.ok(
                "execute_code", command="echo $HOSTNAME; echo hi > f", session=session
            )
            assert result["exit_code"] == 0, result
            again = await on_a2.ok("execute_code", command="cat f", session=session)
            assert stdout_of(again) == "hi\n"
            ran = await on_a2.ok("run_code", code="print(6*7)", session=session)
            assert "42" in stdout_of(ran)
    homes = {
        redis_server.cli_raw("hget", f"session:default:s:{s}:home", "home").strip()
        for s in sessions
    }
    assert homes <= {w1.settings["SANDBOX_REPLICA_ID"], w2.settings["SANDBOX_REPLICA_ID"]}, homes
    assert not list((a1.state_dir / "workspaces").glob("ws-*")), "an api replica holds no workspace"


@pytest.mark.parametrize("era", ["auto", "legacy"])
async def test_through_round_robin_nginx_both_eras(tmp_path: Path, era: str) -> None:
    from split_harness import TOKEN as SPLIT_TOKEN
    from split_harness import running_split

    with running_split(tmp_path) as split:
        session = f"n-{uuid.uuid4().hex[:6]}"
        async with open_client(split.nginx.url, SPLIT_TOKEN, era) as conn:  # type: ignore[arg-type]
            for i in range(6):  # (round robin: every call may reach another api replica)
                result = await conn.ok(
                    "execute_code", command=f"echo {i} >> log; cat log | wc -l", session=session
                )
                assert stdout_of(result).strip() == str(i + 1), result
            ran = await conn.ok("run_code", code="x = 41", session=session)
            ran = await conn.ok("run_code", code="print(x + 1)", session=session)
            assert stdout_of(ran) == "42\n"
            listed = await conn.ok("list_files", session=session)
            assert [e["path"] for e in listed["entries"]] == ["log"]
