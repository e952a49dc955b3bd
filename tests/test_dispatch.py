"""tools/call for our fixed tools (server/dispatch.py) answers exactly as the library's path:
two real servers, one with SANDBOX_FAST_DISPATCH=false, the same calls in both protocol eras
through the official client; tools/list, every tool's results (content, structured content,
isError), bad arguments, an unknown tool and progress notifications compared whole, ids,
times and ports aside."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from mcp.types import CallToolResult
from mcp_harness import Conn, ServerProcess, open_client

pytestmark = pytest.mark.e2e

TOKEN = "dispatch-token-0123456789"
ERAS = ("legacy", "auto")


@pytest.fixture(scope="module")
def servers(serve: Any) -> dict[str, ServerProcess]:
    common = {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_REPLICA_ID": "dispatch-cmp"}
    return {
        "fast": serve("fast", **common),
        "library": serve("library", SANDBOX_FAST_DISPATCH="false", **common),
    }


_ID = re.compile(r"[0-9a-f]{16,}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_PORT = re.compile(r"127\.0\.0\.1:\d+")
_SIG = re.compile(r"(sig|signature|token|expires)=[^&\s'\"]+")
_SIGNED = re.compile(r"/files/[A-Za-z0-9_.-]+/")  # (a signed file URL's token)
_EPOCH = re.compile(r"\d{9,}\.\d+")  # (in list cursors)
_DIGITS = re.compile(r"\d+")
VOLATILE = {"ts", "started_at", "completed_at", "created_at", "finished_at", "duration_ms",
            "expires_at", "url", "modified", "mtime", "elapsed_ms"}  # fmt: skip


def normal(value: Any, text: bool = False) -> Any:
    """`value` with what differs between two servers and two runs (ids, times, ports)
    replaced by placeholders; in a `text` block, every number (times and durations are
    spelled inside it)."""
    if isinstance(value, dict):
        return {k: "<v>" if k in VOLATILE else normal(v, text) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [normal(v, text) for v in value]
    if isinstance(value, float):
        return "<float>"
    if isinstance(value, str):
        for pattern, shown in (
            (_ID, "<id>"),
            (_PORT, "<host>"),
            (_SIG, r"\1=<x>"),
            (_EPOCH, "<t>"),
            (_SIGNED, "/files/<token>/"),
        ):
            value = pattern.sub(shown, value)
        if text:
            value = _DIGITS.sub("#", value)
    return value


def whole(result: CallToolResult) -> dict[str, Any]:
    dumped = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    blocks = dumped.pop("content")
    return {**normal(dumped), "content": normal(blocks, text=True)}


async def scenario(conn: Conn, era: str) -> dict[str, Any]:
    """Every fixed tool called once or more (in one order, so both servers see the same
    history), bad arguments, an unknown tool, progress: what each call answered."""
    s = f"cmp-{era}"
    out: dict[str, Any] = {}

    async def record(key: str, tool: str, **args: Any) -> CallToolResult:
        result = await conn.call(tool, **args)
        out[key] = whole(result)
        return result

    await record("echo", "execute_code", command="echo hi", session=s)
    await record("echo detailed", "execute_code", command="echo hi", session=s,
                 response_format="detailed")  # fmt: skip
    await record("echo json", "execute_code", command="echo hi; exit 3", session=s,
                 response_format="json")  # fmt: skip
    notes: list[Any] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        notes.append((value, total, message))

    result = await conn.call(
        "execute_code", progress, command="echo a; sleep 0.5; echo b", session=s
    )
    out["progress call"] = whole(result)
    out["progress notes"] = normal(notes, text=True)
    started = await conn.call("execute_code_async", command="cat", interactive=True, session=s)
    out["async"] = whole(started)
    assert started.structured_content is not None
    eid = started.structured_content["execution_id"]
    await record("stdin", "send_stdin", execution_id=eid, input_data="x", close_stdin=True,
                 session=s)  # fmt: skip
    await record("output", "get_execution_output", execution_id=eid, wait=True, session=s)
    await record("output after", "get_execution_output", execution_id=eid, last_event_id="1",
                 session=s)  # fmt: skip
    await record("status", "get_execution_status", execution_id=eid, session=s)
    await record("cancel", "cancel_execution", execution_id=eid, session=s)
    await record("list", "list_executions", limit=2, session=s)
    await record("run_code", "run_code", code="print(1 + 1)", session=s)
    code = await conn.call("run_code_async", code="print(3)", session=s)
    out["run_code_async"] = whole(code)
    assert code.structured_content is not None, code
    code_id = code.structured_content["execution_id"]
    await record("run_code output", "get_execution_output", execution_id=code_id, wait=True,
                 session=s)  # fmt: skip
    await record("languages", "list_languages", session=s)
    await record("restart", "restart_interpreter", session=s)
    await record("write", "write_file", path="a/b.txt", content="hello\n", session=s)
    await record("read", "read_file", path="a/b.txt", session=s)
    await record("files", "list_files", path="a", session=s)
    await record("url", "create_file_url", path="a/b.txt", session=s)
    await record("delete", "delete_file", path="a", recursive=True, session=s)
    await record("servers", "list_servers")
    await record("search", "search_tools", query="time")
    await record("snapshot", "snapshot_session", session=s)
    await record("snapshots", "list_snapshots", session=s)
    await record("restore", "restore_session", snapshot_id="nope", session=s)
    await record("fork", "fork_session", to_session=f"{s}-fork", from_session=s)
    await record("environments", "list_environments")
    # Refused calls: a missing, a mistyped, an unknown argument; an unknown execution; a tool
    # this server does not have; a session the argument names badly.
    await record("missing", "execute_code", session=s)
    await record("mistyped", "execute_code", command=5, timeout_seconds="soon", session=s)
    await record("unknown argument", "get_execution_status", execution_id=eid, bogus=1)
    await record("unknown execution", "get_execution_status", execution_id="nope", session=s)
    await record("bad session", "list_executions", session="no spaces allowed")
    await record("unknown tool", "no_such_tool")
    return out


@pytest.mark.parametrize("era", ERAS)
async def test_the_fast_path_answers_as_the_library_does(
    servers: dict[str, ServerProcess], era: str
) -> None:
    answers: dict[str, dict[str, Any]] = {}
    listed: dict[str, list[dict[str, Any]]] = {}
    for label, server in servers.items():
        async with open_client(server.url, TOKEN, era) as conn:  # type: ignore[arg-type]
            tools = await conn.client.list_tools()
            listed[label] = [t.model_dump(mode="json", by_alias=True) for t in tools.tools]
            answers[label] = await scenario(conn, era)
    assert listed["fast"] == listed["library"]
    names = {t["name"] for t in listed["fast"]}
    called = {"execute_code", "execute_code_async", "send_stdin", "get_execution_output",
              "get_execution_status", "cancel_execution", "list_executions", "run_code",
              "run_code_async", "list_languages", "restart_interpreter", "write_file",
              "read_file", "list_files", "create_file_url", "delete_file", "list_servers",
              "search_tools", "snapshot_session", "list_snapshots", "restore_session",
              "fork_session", "list_environments"}  # fmt: skip
    assert names == called, f"a tool the scenario does not call: {names - called}"
    fast, library = answers["fast"], answers["library"]
    assert list(fast) == list(library)
    for key in fast:
        assert fast[key] == library[key], key
    # (the comparison compares something: the scenario's calls answered as they should)
    assert fast["echo"]["structuredContent"]["exit_code"] == 0
    assert fast["progress notes"], "no progress notification came"
    assert fast["missing"]["isError"] and fast["unknown tool"]["isError"]
    assert "command is required" in json.dumps(fast["missing"])


async def test_the_fast_path_serves_every_fixed_tool_and_logs_refusals_as_the_library(
    servers: dict[str, ServerProcess],
) -> None:
    async with open_client(servers["fast"].url, TOKEN, "auto") as conn:
        count = len((await conn.client.list_tools()).tools)
    line = f"tools/call: {count} fixed tools on the direct path"
    assert line in servers["fast"].stderr_text()
    assert "on the direct path" not in servers["library"].stderr_text()
    for label, server in servers.items():
        offset = server.log_size()
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.error("get_execution_status", execution_id=5)
            await conn.ok("execute_code", command="true", session="logged")
        log = server.log_since(offset)
        assert "Invalid arguments for tool 'get_execution_status'" in log, (label, log)
        # The token's principal reached the tool (get_access_token() inside it), not anonymous.
        assert "execution started principal=default " in log, (label, log)


@pytest.mark.parametrize("era", ERAS)
async def test_a_session_path_binds_the_session_on_the_fast_path_as_on_the_library_s(
    servers: dict[str, ServerProcess], era: str
) -> None:
    answers: dict[str, list[dict[str, Any]]] = {}
    for label, server in servers.items():
        url = f"{server.base_url}/s/bound-{era}/mcp"
        async with open_client(url, TOKEN, era) as conn:  # type: ignore[arg-type]
            answers[label] = [
                whole(await conn.call("execute_code", command="echo bound")),
                whole(await conn.call("list_executions", limit=1)),
                whole(await conn.call("list_executions", session="elsewhere")),
            ]
    assert answers["fast"] == answers["library"]
    ran, listed, refused = answers["fast"]
    assert ran["structuredContent"]["session"] == f"bound-{era}"
    assert listed["structuredContent"]["result"][0]["session"] == f"bound-{era}"
    assert refused["isError"] and "bound to session" in refused["structuredContent"]["error"]
