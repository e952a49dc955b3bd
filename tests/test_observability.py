"""Metrics, readiness and structured logs of a real server process."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path

import httpx2
import pytest
from mcp_harness import (
    ServerProcess,
    Servers,
    alive,
    eventually,
    open_client,
    proc_uid,
    sandbox_uid,
    stop_all,
    stop_if_running,
)
from redis_harness import RedisServer

pytestmark = pytest.mark.e2e

TOKEN = "observability-token-0123456789"
METRICS_TOKEN = "metrics-only-token-9876543210"


def scrape(server: ServerProcess, token: str | None = METRICS_TOKEN) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = httpx2.get(f"{server.base_url}/metrics", headers=headers, timeout=5)
    assert resp.status_code == 200, resp.text
    samples: dict[str, float] = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return samples.get(f"{name}{{{inner}}}", 0.0)
    return samples.get(name, 0.0)


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve(
        "observability",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_METRICS_TOKEN=METRICS_TOKEN,
        SANDBOX_LOG_FORMAT="json",
        SANDBOX_MAX_PER_SESSION="2",
    )


def test_metrics_need_the_metrics_token(server: ServerProcess) -> None:
    assert httpx2.get(f"{server.base_url}/metrics", timeout=5).status_code == 401
    wrong = {"Authorization": "Bearer nope-nope-nope"}
    assert httpx2.get(f"{server.base_url}/metrics", headers=wrong, timeout=5).status_code == 401
    client_token = {"Authorization": f"Bearer {TOKEN}"}
    resp = httpx2.get(f"{server.base_url}/metrics", headers=client_token, timeout=5)
    assert resp.status_code == 401, "a separate metrics token replaces the client tokens"


async def test_metrics_follow_executions_that_run_time_out_and_are_cancelled(
    server: ServerProcess,
) -> None:
    before = scrape(server)
    session = f"m-{uuid.uuid4().hex[:6]}"
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("execute_code", command="echo metrics", session=session)
        timed = await conn.ok(
            "execute_code", command="sleep 30", timeout_seconds=0.5, session=session
        )
        assert timed["status"] == "timeout"
        started = await conn.ok("execute_code_async", command="sleep 30", session=session)
        during = scrape(server)
        assert metric(during, "srt_executions_running") >= 1
        await conn.ok("cancel_execution", execution_id=started["execution_id"], session=session)
        await conn.error("get_execution_status", execution_id="nope", session=session)
        # the session allows two at once: the third is refused
        a = await conn.ok("execute_code_async", command="sleep 30", session=session)
        b = await conn.ok("execute_code_async", command="sleep 30", session=session)
        await conn.error("execute_code_async", command="sleep 30", session=session)
        for execution in (a, b):
            await conn.ok(
                "cancel_execution", execution_id=execution["execution_id"], session=session
            )
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("srt_executions_started_total") == 5
    assert delta("srt_executions_finished_total", status="completed") == 1
    assert delta("srt_executions_finished_total", status="timeout") == 1
    assert delta("srt_executions_finished_total", status="cancelled") == 3
    assert delta("srt_limit_kills_total", kind="timeout") == 1
    assert delta("srt_concurrency_rejections_total", scope="session") == 1
    assert delta("srt_tool_calls_total", tool="execute_code") == 2
    assert delta("srt_tool_errors_total", tool="get_execution_status", error="not_found") == 1
    assert delta("srt_output_bytes_total", stream="stdout") >= len("metrics\n")
    assert delta("srt_execution_duration_seconds_count") == 5
    assert delta("srt_sandbox_spawn_seconds_count") == 5
    assert metric(after, "srt_executions_running") == 0


def test_health_is_liveness_and_ready_checks_the_sandbox(server: ServerProcess) -> None:
    assert httpx2.get(f"{server.base_url}/health", timeout=5).json()["status"] == "ok"
    ready = httpx2.get(f"{server.base_url}/ready", timeout=5)
    assert ready.status_code == 200
    assert ready.json()["ready"] is True


def test_json_log_lines_parse_and_carry_context_and_never_a_token(
    server: ServerProcess,
) -> None:
    asyncio.run(_one_call(server))
    lines = [line for line in server.stderr_text().splitlines() if line.strip()]
    records = []
    for line in lines:
        if line.startswith("{"):
            records.append(json.loads(line))
    assert records, "no JSON log lines"
    assert all("time" in r and "level" in r and "message" in r for r in records)
    assert all(
        r.get("replica_id") == server.settings.get("SANDBOX_REPLICA_ID") or r.get("replica_id")
        for r in records
    )
    started = [r for r in records if r["message"].startswith("execution started")]
    assert started and all(re.fullmatch(r"[0-9a-f]{32}", r["execution_id"]) for r in started)
    assert any("session" in r for r in started)
    refused = [r for r in records if "refused" in r["message"]]
    assert refused and all(r.get("tool") and r.get("request_id") for r in refused)
    access = [r for r in records if "POST /mcp" in r["message"]]
    assert access, "the access log goes through the same sink"
    text = server.stderr_text()
    assert TOKEN not in text and METRICS_TOKEN not in text
    assert TOKEN not in json.dumps(scrape(server)) and METRICS_TOKEN not in json.dumps(
        scrape(server)
    )


async def _one_call(server: ServerProcess) -> None:
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("execute_code", command="echo logged", session="logs")
        await conn.error("get_execution_status", execution_id="missing", session="logs")


async def test_ready_flips_when_redis_stops_and_starts(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    srv = ServerProcess(
        tmp_path / "srv",
        {"SANDBOX_AUTH_TOKEN": TOKEN, "REDIS_URL": redis.url, "SANDBOX_HEARTBEAT_TTL": "3"},
    ).start()
    try:

        def ready() -> int:
            return httpx2.get(f"{srv.base_url}/ready", timeout=5).status_code

        await eventually(lambda: ready() == 200, 10, "ready with Redis up")
        redis.stop()
        await eventually(lambda: ready() == 503, 10, "not ready with Redis down")
        body = httpx2.get(f"{srv.base_url}/ready", timeout=5).json()
        assert body["ready"] is False and "redis" in json.dumps(body)
        assert httpx2.get(f"{srv.base_url}/health", timeout=5).status_code == 200
        redis.start()
        await eventually(lambda: ready() == 200, 15, "ready again")
        samples = scrape(srv, TOKEN)
        assert metric(samples, "srt_redis_connected") == 1
    finally:
        stop_all(stop_if_running(srv), redis.stop)


async def test_sandboxes_started_ahead_serve_each_session_and_end_with_the_server(
    tmp_path: Path,
) -> None:
    """A session's calls run in sandboxes started ahead (counted as hits; its first in the one
    started in its blank workspace), each a sandbox of its own, in both protocol eras; every
    one still waiting dies with the server."""
    server = ServerProcess(
        tmp_path, {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_METRICS_TOKEN": METRICS_TOKEN}
    )
    await asyncio.to_thread(server.start)
    try:
        for mode in ("legacy", "auto"):
            async with open_client(server.url, TOKEN, mode) as conn:
                for _ in range(4):
                    result = await conn.ok(
                        "execute_code",
                        command="cat /proc/sys/kernel/random/boot_id >/dev/null; "
                        "ls -A /tmp | wc -l; touch /tmp/mine; echo $$",
                        session=f"pool-{mode}",
                    )
                    out = "".join(e.get("data", "") for e in result["output"])
                    files, _ = out.split()
                    assert files == "0", out  # a fresh /tmp each call: no sandbox used twice
                    await asyncio.sleep(0.3)  # (an agent's pause: the next one is ready)
        samples = scrape(server)
        # (a session's first call too, mostly: its blank workspace came with a sandbox)
        assert metric(samples, "srt_sandbox_pool_hits_total") >= 6, samples
        assert metric(samples, "srt_sandbox_pool_refill_seconds_count") >= 6
        # one per session, and those waiting in blank workspaces for new sessions
        assert metric(samples, "srt_sandbox_pool_ready") >= 2
        tree = server.descendants()
        waiting = [pid for pid, _ in tree if proc_uid(pid) == sandbox_uid()]
        assert len(waiting) >= 2 * 3, tree  # two sandboxes: bwrap, its init, the stub each
        await asyncio.to_thread(server.stop, 15)
    finally:
        server.kill()
    survivors = [pid for pid, start_time in tree if alive(pid, start_time)]
    assert survivors == [], f"processes outlived the server: {survivors}"
    assert "Traceback" not in server.stderr_text()
