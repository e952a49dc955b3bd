"""A replica whose clock is 40 s ahead (libfaketime): forwarded calls fail saying the clocks
differ and by how much, not that the secret might be wrong, and /health on both replicas
reports the skew."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import (
    ServerProcess,
    eventually,
    open_client,
    replica_process,
    stop_all,
    stop_if_running,
)
from redis_harness import RedisServer

pytestmark = pytest.mark.e2e

TOKEN = "clock-skew-token-0123456789"
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
AHEAD = 40


@pytest.fixture(scope="module", autouse=True)
def libfaketime_installed() -> None:
    if not LIBFAKETIME.exists():
        pytest.fail(f"{LIBFAKETIME} is missing: apt-get install faketime (scripts/test does)")


def replica(workdir: Path, redis: RedisServer, name: str, **env: str) -> ServerProcess:
    return replica_process(workdir, redis.url, name, TOKEN, SANDBOX_INTERPRETER_WARM="", **env)


async def test_a_replica_with_a_skewed_clock_is_reported_as_such(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    a_id, b_id = f"on-time-{uuid.uuid4().hex[:6]}", f"ahead-{uuid.uuid4().hex[:6]}"
    a = replica(tmp_path, redis_server, a_id)
    b = replica(
        tmp_path,
        redis_server,
        b_id,
        LD_PRELOAD=str(LIBFAKETIME),
        FAKETIME=f"+{AHEAD}s",
        FAKETIME_ONLY_CMDS="python,python3",  # the server, not its mkfs, mount, bwrap, ...
    )
    session = f"skew-{uuid.uuid4().hex[:8]}"
    try:
        a.start()
        b.start()
        async with open_client(b.url, TOKEN, "auto") as on_b:
            homed = await on_b.ok("execute_code", command="echo home", session=session)
            assert homed["status"] == "completed", homed
        home = redis_server.cli_raw("hget", f"session:default:s:{session}:home", "home")
        assert home.strip() == b_id
        async with open_client(a.url, TOKEN, "auto") as on_a:
            message = await on_a.error("execute_code", command="echo via A", session=session)
        assert "clocks differ by 4" in message, message  # (40 s, give or take the call's time)
        assert f"40.0 s behind {b_id}'s" in message or "39.9 s behind" in message, message
        assert "SANDBOX_CLUSTER_SECRET" not in message, message
        assert "clocks differ by 4" in b.stderr_text()

        def skewed(server: ServerProcess, peer: str) -> dict[str, Any] | None:
            health = server.health()
            skew = health["cluster_clock_skew_seconds"].get(peer)
            return health if skew is not None and abs(abs(skew) - AHEAD) < 2 else None

        on_a_health = await eventually(lambda: skewed(a, b_id), 10, "A to see B's clock")
        assert on_a_health["cluster_clock_skew_seconds"][b_id] > 0  # B is ahead of A
        assert on_a_health["status"] == "degraded", on_a_health
        assert "clocks differ by about 4" in on_a_health["cluster"], on_a_health
        on_b_health = await eventually(lambda: skewed(b, a_id), 10, "B to see A's clock")
        assert on_b_health["cluster_clock_skew_seconds"][a_id] < 0  # A is behind B
        assert on_b_health["status"] == "degraded", on_b_health
    finally:
        stop_all(stop_if_running(a), stop_if_running(b))
