"""The execution tools keep srt-mcp-server 0.2's contract for its clients.

What 0.2's own client tests assert (initialize and the tools listed; execute_code completes
with exit 0 and output whose every event has a non-empty string event_id; a started
execution's output polled; resuming after the 2nd event's id gives only newer events; resuming
at the last gives []; a made-up event id gives an error saying "not found" or "evicted"),
checked the way those tests read results: json.loads on every text block. And what 0.2's
clients rely on besides: send_stdin's {"success": true}, cancel_execution's success and
was_running, get_execution_status's fields, list_executions' list, an unknown execution id as
an error saying "not found" (with output [] from get_execution_output), and bad arguments
answered with one clear line each.

One scenario (tests/clients/compat_02_client.py) is run per client, each under a token
principal of its own (so each starts with no executions) against one server:

- "mcp1": the mcp 1.x client in its own venv (SRT_CLIENTS_PY, set up by scripts/_setup.sh's
  ensure_clients), running the scenario file as a script: the 2025 era as 0.2's users speak it;
- "mcp2-legacy" and "mcp2-auto": our mcp 2.x client in-process, in the 2025 and 2026 eras.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from mcp.types import CallToolResult
from mcp_harness import ROOT, Mode, ServerProcess, Servers, open_client

pytestmark = pytest.mark.e2e

CLIENTS = ["mcp1", "mcp2-legacy", "mcp2-auto"]
PRINCIPALS = {"mcp1": "mcpone", "mcp2-legacy": "legacy", "mcp2-auto": "modern"}
TOKENS = {client: f"tok-{PRINCIPALS[client]}-0123456789" for client in CLIENTS}
DRIVER = ROOT / "tests" / "clients" / "compat_02_client.py"
EXECUTION_TOOLS = {
    "execute_code",
    "execute_code_async",
    "get_execution_output",
    "get_execution_status",
    "send_stdin",
    "cancel_execution",
    "list_executions",
}
STATUS_FIELDS = {
    "id",
    "status",
    "command",
    "interactive",
    "started_at",
    "completed_at",
    "exit_code",
    "error_message",
}

Outcome = dict[str, Any]


# -- running the scenario -----------------------------------------------------------------------


def driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compat_02_client", DRIVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mcp1_python() -> str:
    """The mcp 1.x client's python: SRT_CLIENTS_PY (required under CI), or locally the venv
    ensure_clients makes (.clients/py), else the test is skipped."""
    python = os.environ.get("SRT_CLIENTS_PY")
    if python:
        assert Path(python).exists(), f"SRT_CLIENTS_PY={python} does not exist"
        return python
    if os.environ.get("CI") == "true":
        pytest.fail(
            "SRT_CLIENTS_PY is not set: scripts/test's ensure_clients makes the mcp 1.x venv"
        )
    local = ROOT / ".clients" / "py" / "bin" / "python"
    if local.exists():
        return str(local)
    pytest.skip("no mcp 1.x client: set SRT_CLIENTS_PY or run scripts/test once (ensure_clients)")


def run_mcp1(url: str, token: str) -> Outcome:
    proc = subprocess.run(
        [mcp1_python(), str(DRIVER), url, token],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"the mcp 1.x driver failed:\n{proc.stderr[-5000:]}"
    outcome: Outcome = json.loads(proc.stdout)
    return outcome


def record_of(result: CallToolResult) -> dict[str, Any]:
    return {
        "texts": [b.text for b in result.content if b.type == "text"],
        "other_blocks": [b.type for b in result.content if b.type != "text"],
        "is_error": bool(result.is_error),
        "structured": result.structured_content,
        "client_error": None,
    }


async def run_mcp2(url: str, token: str, mode: Mode) -> Outcome:
    scenario = driver().scenario
    async with open_client(url, token, mode) as conn:
        listed = await conn.client.list_tools()

        async def call(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
            try:
                result = await conn.client.call_tool(tool, arguments)
            except Exception as exc:  # the client's own checks
                return {"client_error": f"{type(exc).__name__}: {exc}"[:2000]}
            return record_of(result)

        outcome: Outcome = await scenario(call, [tool.name for tool in listed.tools])
        return outcome


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    tokens = ",".join(f"{PRINCIPALS[c]}:{TOKENS[c]}" for c in CLIENTS)
    # 0.2's programs parse the legacy era's text blocks as JSON: the setting that keeps them
    # as they were (the default text is a concise screen for models; docs/tools.md).
    return serve("compat02", SANDBOX_AUTH_TOKENS=tokens, SANDBOX_RESULT_TEXT="json")


@pytest.fixture(scope="module", params=CLIENTS)
def outcome(request: pytest.FixtureRequest, server: ServerProcess) -> Outcome:
    """The scenario's result for one client (run once per client per module)."""
    client: str = request.param
    if client == "mcp1":
        result = run_mcp1(server.url, TOKENS[client])
    else:
        mode: Mode = "legacy" if client == "mcp2-legacy" else "auto"
        result = asyncio.run(run_mcp2(server.url, TOKENS[client], mode))
    assert server.health()["status"] == "ok"
    result["client"] = client
    return result


# -- reading results as 0.2's clients do ----------------------------------------------------------


def step(outcome: Outcome, name: str, *parts: str) -> dict[str, Any]:
    """A step's record, after checking the scenario's parts that lead to it went through."""
    for part in parts:
        assert part not in outcome["problems"], f"{part}: {outcome['problems'][part]}"
    assert name in outcome["steps"], f"step {name} was not reached: {outcome['problems']}"
    record: dict[str, Any] = outcome["steps"][name]
    assert not record.get("client_error"), f"{name}: the client raised {record['client_error']}"
    return record


def every_block(record: dict[str, Any]) -> list[Any]:
    """json.loads of every text block, as 0.2's clients read a result."""
    decoded = []
    for text in record["texts"]:
        try:
            decoded.append(json.loads(text))
        except ValueError:
            pytest.fail(f"a text block is not JSON: {text[:500]!r}")
    return decoded


def objects(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every text block, each of which must be a JSON object; at least one."""
    decoded = every_block(record)
    assert decoded, f"no text block: {record}"
    for data in decoded:
        assert isinstance(data, dict), f"a text block is not a JSON object: {data!r}"
    return decoded


def output_of(data: dict[str, Any]) -> list[Any]:
    assert isinstance(data.get("output"), list), f"no output list in {data}"
    output: list[Any] = data["output"]
    return output


def assert_events_have_ids(output: list[Any]) -> None:
    for event in output:
        assert isinstance(event, dict), event
        assert isinstance(event.get("event_id"), str), event
        assert len(event["event_id"]) > 0, event


def succeeded(record: dict[str, Any]) -> list[dict[str, Any]]:
    assert not record["is_error"], f"the call failed: {record['texts']}"
    assert record["texts"], f"no content: {record}"
    return objects(record)


def assert_one_clear_line(record: dict[str, Any], name: str) -> dict[str, Any]:
    """A refused call: isError, every text block a JSON object whose "error" is one short line
    (no pydantic URL, no multi-line dump); returns the body."""
    assert record["is_error"], f"{name} was not refused: {record['texts']}"
    bodies = objects(record)
    for data in bodies:
        error = data.get("error")
        assert isinstance(error, str), f"{name}: no error text in {data}"
        assert error.strip(), f"{name}: an empty error"
        assert "\n" not in error.strip(), f"{name}: a multi-line error: {error!r}"
        assert "errors.pydantic.dev" not in error, f"{name}: pydantic's URL: {error!r}"
        assert len(error) < 600, f"{name}: an error of {len(error)} characters"
        assert "error_type" in data, f"{name}: no error_type in {data}"
    return bodies[-1]


def listed_executions(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The executions a list_executions result lists: 0.2 sends each as a text block of its own
    (none when there is none) with structuredContent {"result": [...]}; one text block holding
    the JSON list also reads as a list."""
    assert not record["is_error"], record["texts"]
    decoded = every_block(record)
    if len(decoded) == 1 and isinstance(decoded[0], list):
        items = decoded[0]
    else:
        assert all(isinstance(d, dict) and "id" in d for d in decoded), (
            f"list_executions' text blocks are neither one list nor one execution each: {decoded}"
        )
        items = decoded
    if record["structured"] is not None:
        assert isinstance(record["structured"], dict), record["structured"]
        assert record["structured"].get("result") == items, record["structured"]
    for item in items:
        assert isinstance(item, dict), item
        for key in ("id", "status", "command", "interactive", "started_at"):
            assert key in item, f"{key} missing from a listed execution: {item}"
    return items


# -- 0.2's client tests ---------------------------------------------------------------------------


def test_initialize_and_tools_listed(outcome: Outcome) -> None:
    assert EXECUTION_TOOLS <= set(outcome["tools"]), sorted(outcome["tools"])


def test_execute_code_completes_with_event_ids(outcome: Outcome) -> None:
    record = step(outcome, "execute_wait", "execute_wait")
    for data in succeeded(record):
        assert data.get("status") == "completed", data
        assert data.get("exit_code") == 0, data
        assert len(output_of(data)) > 0, data
        assert_events_have_ids(output_of(data))
        printed = "".join(e.get("data", "") for e in output_of(data) if e.get("type") == "stdout")
        assert "hello through the 0.2 contract" in printed, data["output"]


def test_started_execution_polls_events_with_ids(outcome: Outcome) -> None:
    for data in succeeded(step(outcome, "stream_start", "stream")):
        assert isinstance(data.get("execution_id"), str) and data["execution_id"], data
    for data in succeeded(step(outcome, "stream_poll", "stream")):
        assert len(output_of(data)) > 0, data
        assert_events_have_ids(output_of(data))


def test_resume_after_second_event_gives_only_newer_events(outcome: Outcome) -> None:
    started = succeeded(step(outcome, "resume_start", "resume"))
    assert all(data.get("status") == "running" for data in started), started
    first = output_of(succeeded(step(outcome, "resume_first", "resume"))[-1])
    assert len(first) >= 2, first
    assert_events_have_ids(first)
    for data in succeeded(step(outcome, "resume_after_second", "resume")):
        resumed = output_of(data)
        assert len(resumed) > 0, data
        assert_events_have_ids(resumed)
        seen = {event["event_id"] for event in first[:2]}
        assert not seen & {event["event_id"] for event in resumed}, (first[:2], resumed)


def test_resume_at_last_event_gives_nothing(outcome: Outcome) -> None:
    ran = succeeded(step(outcome, "last_run", "resume_at_last"))
    assert all(len(output_of(data)) > 0 for data in ran), ran
    for data in succeeded(step(outcome, "last_resume", "resume_at_last")):
        assert output_of(data) == [], data


def test_made_up_event_id_is_not_found(outcome: Outcome) -> None:
    record = step(outcome, "made_up_resume", "made_up_event")
    for data in objects(record):
        assert "error" in data, data
        error = data["error"].lower()
        assert "not found" in error or "evicted" in error, data
        assert data.get("output") == [], data


# -- what 0.2's clients rely on besides -----------------------------------------------------------


def test_wait_without_a_cursor_returns_the_finished_execution(outcome: Outcome) -> None:
    """0.2: "If wait=True and the execution is still running, blocks until completion" (and
    returns all of its output): one call gives the final result."""
    for data in succeeded(step(outcome, "wait_to_end", "wait_to_end")):
        assert data.get("status") == "completed", data
        assert data.get("exit_code") == 0, data
        output = output_of(data)
        assert output and output[-1].get("type") == "exit", output
        printed = "".join(e.get("data", "") for e in output if e.get("type") == "stdout")
        assert printed == "done\n", output


def test_send_stdin_succeeds_and_reaches_the_program(outcome: Outcome) -> None:
    for data in succeeded(step(outcome, "stdin_send", "stdin")):
        assert data.get("success") is True, data
    final = succeeded(step(outcome, "stdin_output", "stdin"))[-1]
    assert final["status"] == "completed", final
    printed = "".join(e.get("data", "") for e in output_of(final) if e.get("type") == "stdout")
    # 0.2 ends input_data with a newline when it has none: `read` returns.
    assert "got abc" in printed, final["output"]


def test_cancel_execution_reports_was_running(outcome: Outcome) -> None:
    for data in succeeded(step(outcome, "cancel_running", "cancel")):
        assert data.get("success") is True, data
        assert data.get("was_running") is True, data
    for data in succeeded(step(outcome, "cancel_again", "cancel")):
        assert data.get("success") is True, data
        assert data.get("was_running") is False, data
    after = succeeded(step(outcome, "cancel_status_after", "cancel"))[-1]
    assert after["status"] == "cancelled", after


def test_get_execution_status_fields(outcome: Outcome) -> None:
    execution_id = outcome["ids"].get("execute_wait")
    for data in succeeded(step(outcome, "status_completed", "execute_wait")):
        assert STATUS_FIELDS <= set(data), sorted(STATUS_FIELDS - set(data))
        assert data["id"] == execution_id, data
        assert data["status"] == "completed", data
        assert data["command"] == driver().HELLO, data
        assert data["interactive"] is False, data
        assert isinstance(data["started_at"], int | float), data
        assert isinstance(data["completed_at"], int | float), data
        assert data["completed_at"] >= data["started_at"], data
        assert data["exit_code"] == 0, data
        assert data["error_message"] is None, data
    for data in succeeded(step(outcome, "cancel_status_running", "cancel")):
        assert STATUS_FIELDS <= set(data), sorted(STATUS_FIELDS - set(data))
        assert data["status"] == "running", data
        assert data["completed_at"] is None, data
        assert data["exit_code"] is None, data


def test_list_executions_is_a_list(outcome: Outcome) -> None:
    assert listed_executions(step(outcome, "list_none")) == []
    one = listed_executions(step(outcome, "list_one", "list_one"))
    assert [item["id"] for item in one] == [outcome["ids"]["execute_wait"]], one
    record = step(outcome, "list_several", "listing")
    several = listed_executions(record)
    started = {outcome["ids"][k] for k in ("execute_wait", "stream", "resume", "stdin", "cancel")}
    assert started <= {item["id"] for item in several}, several
    # The 2025 era, 0.2's: a text block per execution, as its list results came.
    blocks = every_block(record)
    if outcome["client"] != "mcp2-auto":
        assert len(blocks) == len(several) and all(isinstance(b, dict) for b in blocks), blocks
    else:
        assert blocks == [several], blocks


def test_unknown_execution_id_is_not_found(outcome: Outcome) -> None:
    for name in ("unknown_output", "unknown_status", "unknown_stdin", "unknown_cancel"):
        data = assert_one_clear_line(step(outcome, name, "unknown_ids"), name)
        assert "not found" in data["error"].lower(), (name, data)
        if name == "unknown_output":
            assert data.get("output") == [], data


def test_bad_arguments_get_one_clear_line(outcome: Outcome) -> None:
    # 0.2 ignored an argument it did not know; we name it (a deliberate difference, README).
    extra = assert_one_clear_line(step(outcome, "bad_extra_argument", "bad_input"), "extra")
    assert "unknown argument" in extra["error"], extra
    for name in (
        "bad_timeout_type",
        "bad_command_type",
        "bad_wait_type",
        "bad_huge_id",
        "bad_negative_limit",
    ):
        assert_one_clear_line(step(outcome, name, "bad_input"), name)
    # The server still answers the same client afterwards.
    listed_executions(step(outcome, "after_bad", "bad_input"))
