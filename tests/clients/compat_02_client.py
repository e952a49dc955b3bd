"""What a client of srt-mcp-server 0.2 does with the execution tools, as one scenario.

tests/test_compat_02.py runs it two ways:

- as a script, by a python with mcp 1.x (the 2025 era, as 0.2's users call the server):
  `python compat_02_client.py URL TOKEN` prints one JSON object, the scenario's result;
- in-process, with `scenario(call, tool_names)` and its own mcp 2.x client (both eras).

The scenario only calls and records; the test asserts. A record is what one call returned:
{"texts": [every text block's text], "other_blocks": [other blocks' types], "is_error",
"structured", "client_error"} ("client_error": the client itself raised, e.g. the mcp 1.x
client checks structured content against the tool's outputSchema). To go on, the scenario
reads ids out of results with json.loads on the text blocks, as 0.2's clients do; a part that
cannot go on is recorded in "problems" and the others still run.

Nothing here imports mcp at module level: the in-process test imports this file under mcp 2.x.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

Record = dict[str, Any]
Call = Callable[[str, dict[str, Any]], Awaitable[Record]]

MADE_UP_EVENT_ID = "00000000-0000-0000-0000-000000000000"
UNKNOWN_EXECUTION = "no-such-execution-0123456789"
HELLO = "python3 -c \"print('hello through the 0.2 contract')\""
READER = "read answer; echo got $answer"
POLL_WITHIN = 20.0  # seconds a poll waits for what it needs (a sandbox's start included)


def printer(lines: int, pause: float) -> str:
    """A command printing `lines` lines, `pause` seconds apart."""
    return (
        f'python3 -u -c "import time\nfor i in range({lines}): '
        f"print('Event', i, flush=True); time.sleep({pause})\""
    )


def decoded(record: Record) -> list[Any]:
    """json.loads of every text block (raises on one that is not JSON)."""
    if record.get("client_error"):
        raise RuntimeError(f"the client raised: {record['client_error']}")
    return [json.loads(text) for text in record["texts"]]


def body(record: Record) -> dict[str, Any]:
    """The JSON object of a result's text blocks (the last one, as 0.2's clients kept it)."""
    objects = [data for data in decoded(record) if isinstance(data, dict)]
    if not objects:
        raise ValueError(f"no JSON object in the text blocks: {record['texts']!r}")
    return objects[-1]


def output_of(record: Record) -> list[dict[str, Any]]:
    output = body(record).get("output")
    if not isinstance(output, list):
        raise ValueError(f"no output list in {body(record)!r}")
    return output


async def scenario(call: Call, tool_names: list[str]) -> dict[str, Any]:
    """Run every part; returns {"tools", "steps": {name: record}, "problems": {part: text},
    "ids": {name: execution id}}."""
    steps: dict[str, Record] = {}
    problems: dict[str, str] = {}
    ids: dict[str, str] = {}

    async def step(name: str, tool: str, **arguments: Any) -> Record:
        record = await call(tool, arguments)
        steps[name] = record
        return record

    async def poll(name: str, execution_id: str, enough: Callable[[Record], bool]) -> Record:
        """get_execution_output (no wait) until `enough` says so or POLL_WITHIN passes."""
        deadline = time.monotonic() + POLL_WITHIN
        while True:
            record = await step(name, "get_execution_output", execution_id=execution_id)
            if enough(record) or time.monotonic() > deadline:
                return record
            await asyncio.sleep(0.2)

    async def until_finished(name: str, execution_id: str) -> Record:
        """get_execution_output with wait=true until the execution is no longer running (0.2's
        wait blocks to the end; a bounded long poll may need asking again)."""
        deadline = time.monotonic() + POLL_WITHIN
        while True:
            record = await step(name, "get_execution_output", execution_id=execution_id, wait=True)
            if body(record).get("status") != "running" or time.monotonic() > deadline:
                return record

    async def execute_wait() -> None:
        record = await step(
            "execute_wait",
            "execute_code",
            command=HELLO,
            wait_for_completion=True,
            timeout_seconds=10,
        )
        ids["execute_wait"] = body(record)["execution_id"]
        await step("status_completed", "get_execution_status", execution_id=ids["execute_wait"])

    async def stream() -> None:
        record = await step(
            "stream_start",
            "execute_code",
            command=printer(5, 0.2),
            wait_for_completion=False,
            timeout_seconds=10,
        )
        ids["stream"] = body(record)["execution_id"]
        await asyncio.sleep(0.5)
        await poll("stream_poll", ids["stream"], lambda r: bool(output_of(r)))

    async def resume() -> None:
        record = await step(
            "resume_start", "execute_code_async", command=printer(7, 0.3), timeout_seconds=10
        )
        ids["resume"] = body(record)["execution_id"]
        await asyncio.sleep(1.0)
        first = await poll("resume_first", ids["resume"], lambda r: len(output_of(r)) >= 2)
        second_id = output_of(first)[1]["event_id"]
        await asyncio.sleep(1.0)
        await step(
            "resume_after_second",
            "get_execution_output",
            execution_id=ids["resume"],
            wait=False,
            last_event_id=second_id,
        )

    async def resume_at_last() -> None:
        record = await step(
            "last_run",
            "execute_code",
            command="python3 -c \"print('single line')\"",
            wait_for_completion=True,
            timeout_seconds=10,
        )
        ids["last_run"] = body(record)["execution_id"]
        last_id = output_of(record)[-1]["event_id"]
        await step(
            "last_resume",
            "get_execution_output",
            execution_id=ids["last_run"],
            wait=False,
            last_event_id=last_id,
        )

    async def made_up_event() -> None:
        record = await step(
            "made_up_run",
            "execute_code",
            command="python3 -c \"print('test')\"",
            wait_for_completion=True,
            timeout_seconds=10,
        )
        ids["made_up_run"] = body(record)["execution_id"]
        await step(
            "made_up_resume",
            "get_execution_output",
            execution_id=ids["made_up_run"],
            wait=False,
            last_event_id=MADE_UP_EVENT_ID,
        )

    async def wait_to_end() -> None:
        record = await step("wait_start", "execute_code_async", command="sleep 1; echo done")
        ids["wait"] = body(record)["execution_id"]
        await step("wait_to_end", "get_execution_output", execution_id=ids["wait"], wait=True)

    async def stdin() -> None:
        record = await step("stdin_start", "execute_code_async", command=READER, interactive=True)
        ids["stdin"] = body(record)["execution_id"]
        await poll("stdin_ready", ids["stdin"], lambda r: bool(output_of(r)))
        await step("stdin_send", "send_stdin", execution_id=ids["stdin"], input_data="abc")
        await until_finished("stdin_output", ids["stdin"])

    async def cancel() -> None:
        record = await step("cancel_start", "execute_code_async", command="sleep 60")
        ids["cancel"] = body(record)["execution_id"]
        await poll("cancel_ready", ids["cancel"], lambda r: bool(output_of(r)))
        await step("cancel_status_running", "get_execution_status", execution_id=ids["cancel"])
        await step("cancel_running", "cancel_execution", execution_id=ids["cancel"])
        await step("cancel_again", "cancel_execution", execution_id=ids["cancel"])
        await step("cancel_status_after", "get_execution_status", execution_id=ids["cancel"])

    async def listing() -> None:
        await step("list_several", "list_executions")

    async def unknown_ids() -> None:
        unknown = UNKNOWN_EXECUTION
        await step("unknown_output", "get_execution_output", execution_id=unknown)
        await step("unknown_status", "get_execution_status", execution_id=unknown)
        await step("unknown_stdin", "send_stdin", execution_id=unknown, input_data="x")
        await step("unknown_cancel", "cancel_execution", execution_id=unknown)

    async def bad_input() -> None:
        known = ids.get("execute_wait", UNKNOWN_EXECUTION)
        await step("bad_extra_argument", "execute_code", command="echo extra", bogus=1)
        await step("bad_timeout_type", "execute_code", command="echo", timeout_seconds="abc")
        await step("bad_command_type", "execute_code", command=5)
        await step("bad_wait_type", "get_execution_output", execution_id=known, wait="maybe")
        await step("bad_huge_id", "get_execution_status", execution_id="x" * 100_000)
        await step("bad_negative_limit", "get_execution_output", execution_id=known, limit=-1)
        await step("after_bad", "list_executions")

    await step("list_none", "list_executions")  # (each run has a principal of its own)
    for name, part in (
        ("execute_wait", execute_wait),
        ("list_one", lambda: step("list_one", "list_executions")),
        ("stream", stream),
        ("resume", resume),
        ("resume_at_last", resume_at_last),
        ("made_up_event", made_up_event),
        ("wait_to_end", wait_to_end),
        ("stdin", stdin),
        ("cancel", cancel),
        ("listing", listing),
        ("unknown_ids", unknown_ids),
        ("bad_input", bad_input),
    ):
        try:
            await part()
        except Exception as exc:  # recorded; the test reports it with the part's assertions
            problems[name] = f"{type(exc).__name__}: {exc}"[:2000]
    return {"tools": tool_names, "steps": steps, "problems": problems, "ids": ids}


# -- the script: the mcp 1.x client ----------------------------------------------------------


async def run_with_mcp1(url: str, token: str) -> dict[str, Any]:
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with (
        httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120) as http,
        streamable_http_client(url, http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        init = await session.initialize()
        listed = await session.list_tools()

        async def call(tool: str, arguments: dict[str, Any]) -> Record:
            try:
                result = await session.call_tool(tool, arguments)
            except Exception as exc:  # e.g. structured content that fails the outputSchema
                return {"client_error": f"{type(exc).__name__}: {exc}"[:2000]}
            return {
                "texts": [b.text for b in result.content if b.type == "text"],
                "other_blocks": [b.type for b in result.content if b.type != "text"],
                "is_error": bool(result.isError),
                "structured": result.structuredContent,
                "client_error": None,
            }

        outcome = await scenario(call, [tool.name for tool in listed.tools])
        outcome["protocol_version"] = init.protocolVersion
        return outcome


def main() -> None:
    url, token = sys.argv[1], sys.argv[2]
    print(json.dumps(asyncio.run(run_with_mcp1(url, token))))


if __name__ == "__main__":
    main()
