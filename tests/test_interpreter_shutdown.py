"""A server stopped with SIGTERM ends a running interpreter call as it ends a running command:
`cancelled`, reason `shutdown`, recorded in Redis before it exits."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from mcp_harness import ServerProcess, eventually, open_client, stop_all, stop_if_running
from redis_harness import RedisServer

pytestmark = pytest.mark.e2e

TOKEN = "shutdown-test-token-0123456789"


async def test_sigterm_ends_run_code_cancelled_for_shutdown_like_execute_code(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    server = ServerProcess(
        tmp_path / "srv",
        {"SANDBOX_AUTH_TOKEN": TOKEN, "REDIS_URL": redis_server.url, "SANDBOX_SHUTDOWN_GRACE": "1"},
    )
    session = f"sd-{uuid.uuid4().hex[:8]}"
    try:
        server.start()
        async with open_client(server.url, TOKEN, "auto") as conn:
            call = await conn.ok(
                "run_code_async", code="import time\ntime.sleep(60)", session=session
            )
            command = await conn.ok("execute_code_async", command="sleep 60", session=session)

            async def both_running() -> bool:
                for started in (call, command):
                    status = await conn.ok(
                        "get_execution_status",
                        execution_id=started["execution_id"],
                        session=session,
                    )
                    if status["status"] != "running":
                        return False
                return True

            await eventually(both_running, 30, "the call and the command to run")
        server.stop()
    finally:
        stop_all(stop_if_running(server))

    for started in (call, command):
        execution_id = started["execution_id"]
        meta = json.loads(redis_server.cli_raw("get", f"execution:{execution_id}"))
        assert (meta["status"], meta["reason"]) == ("cancelled", "shutdown"), meta
        raw = redis_server.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
        events = [json.loads(line) for line in raw.splitlines() if line.strip()]
        assert events[-1]["type"] in ("cancelled", "exit"), events
        assert "cancelled" in [e["type"] for e in events], events
        assert "Traceback" not in json.dumps(events)
