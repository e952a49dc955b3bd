"""Hostile identifiers at the tool edge, against a real server mirroring into a real Redis:
execution ids shaped like other keys, session names and variable names with control
characters. Each must be refused before it reaches the store, a key or a log line."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx2
import pytest
from mcp_harness import (
    CLUSTER_SECRET,
    Conn,
    ServerProcess,
    Servers,
    open_client,
    run_server_once,
)
from redis_harness import RedisServer

from sandbox_runtime.domain.models import shown_id

pytestmark = pytest.mark.e2e

TOKEN = "edge-test-token-0123456789"
ID_TOOLS = ("get_execution_status", "get_execution_output", "send_stdin", "cancel_execution")


@pytest.fixture(scope="module")
def server(redis_server: RedisServer, serve: Servers) -> ServerProcess:
    return serve(
        "edge",
        SANDBOX_AUTH_TOKEN=TOKEN,
        REDIS_URL=redis_server.url,
        SANDBOX_CLUSTER_SECRET=CLUSTER_SECRET,
    )


async def id_error(conn: Conn, tool: str, execution_id: str, session: str) -> str:
    extra = {"input_data": "x"} if tool == "send_stdin" else {}
    return await conn.error(tool, execution_id=execution_id, session=session, **extra)


async def test_execution_ids_shaped_like_other_keys_answer_as_unknown_ids_do(
    server: ServerProcess, redis_server: RedisServer
) -> None:
    session = f"s-{uuid.uuid4().hex[:8]}"
    async with open_client(server.url, TOKEN, "auto") as conn:
        done = await conn.ok("execute_code", command="echo hi", session=session)
        real = done["execution_id"]
        # The real id's output list is in Redis: "<id>:output" names a key that exists.
        assert redis_server.cli("type", f"execution:{real}:output").strip() == "list"
        unknown = uuid.uuid4().hex
        probes = [
            f"{real}:output",
            f"{real}\n",
            f"{real}*",
            f"{real[:20]}*",
            "*",
            f"{real} ",
            f"{real}\x00",
            real.upper(),
            real[:-1],
            f"{real}:output" * 4000,  # long
            "x" * 100_000,
        ]
        for tool in ID_TOOLS:
            assert await id_error(conn, tool, unknown, session) == (
                f"execution {shown_id(unknown)} not found"
            )
            for probe in probes:
                text = await id_error(conn, tool, probe, session)
                assert text == f"execution {shown_id(probe)} not found", (tool, probe[:80], text)
                assert len(text) < 200
        # Nothing broke: the real execution and the other tools still answer.
        status = await conn.ok("get_execution_status", execution_id=real, session=session)
        assert status["status"] == "completed"
        page = await conn.ok("get_execution_output", execution_id=real, session=session)
        assert "".join(e.get("data", "") for e in page["output"]) == "hi\n"
        listed = await conn.ok("list_executions", session=session)
        assert [e["id"] for e in listed["result"]] == [real]
        again = await conn.ok("execute_code", command="echo again", session=session)
        assert again["status"] == "completed"
    assert server.health()["status"] == "ok"


BAD_SESSIONS = [
    "evil\n",
    "a\r",
    "a\x00b",
    "a\tb",
    "\nevil",
    "a\x1b[31m",
    "a\u0085",  # NEL
    "a\u2028",  # line separator
    "a\u202eb",  # right-to-left override
    "caf\u00e9",
    "",
    ".",
    "..",
    "x" * 129,
]


async def test_session_names_with_control_characters_are_refused(server: ServerProcess) -> None:
    async with open_client(server.url, TOKEN, "auto") as conn:
        for session in BAD_SESSIONS:
            for tool, args in (
                ("execute_code", {"command": "echo no"}),
                ("list_executions", {}),
                ("get_execution_status", {"execution_id": uuid.uuid4().hex}),
            ):
                text = await conn.error(tool, session=session, **args)
                assert text.startswith("session must be 1-128 characters"), (session, tool, text)
        for session in ("ok-1", "a.b:c@d_e", "x" * 128, "..a"):
            done = await conn.ok("execute_code", command="echo yes", session=session)
            assert done["status"] == "completed", session
            listed = await conn.ok("list_executions", session=session)
            assert done["execution_id"] in [e["id"] for e in listed["result"]]


async def test_a_session_path_ending_in_a_newline_is_no_endpoint(server: ServerProcess) -> None:
    headers = {
        "authorization": f"Bearer {TOKEN}",
        "accept": "application/json, text/event-stream",
        "content-type": "application/json",
        "mcp-protocol-version": "2025-06-18",
    }
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "edge", "version": "1"},
        },
    }
    async with httpx2.AsyncClient(base_url=server.base_url, timeout=10) as http:
        good = await http.post("/s/fine/mcp", headers=headers, json=body)
        assert good.status_code == 200, good.text
        for path in ("/s/evil/mcp%0A", "/s/evil%0A/mcp", "/s/evil/mcp/%0A", "/s/ev%00il/mcp"):
            resp = await http.post(path, headers=headers, json=body)
            assert resp.status_code == 404, (path, resp.status_code, resp.text)


async def test_environment_names_ending_in_a_newline_are_refused(server: ServerProcess) -> None:
    async with open_client(server.url, TOKEN, "auto") as conn:
        for name in ("FOO\n", "FOO\r", "F\x00O", "\u0130"):
            text = await conn.error(
                "execute_code", command="true", environment={name: "1"}, session="env"
            )
            assert "is not valid" in text, (name, text)
        done = await conn.ok(
            "execute_code", command="echo $FOO_1", environment={"FOO_1": "ok"}, session="env"
        )
        assert "".join(e.get("data", "") for e in done["output"]) == "ok\n"


@pytest.mark.parametrize("replica_id", ["r1\n", "r\u0661", "caf\u00e9", "r 1"])
def test_replica_ids_outside_ascii_letters_digits_dash_underscore_are_refused(
    tmp_path: Path, replica_id: str
) -> None:
    code, stderr = run_server_once(tmp_path, SANDBOX_REPLICA_ID=replica_id)
    assert code != 0
    assert "replica_id: letters, digits" in stderr, stderr[-2000:]
