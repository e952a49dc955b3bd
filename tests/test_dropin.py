"""What a client written for another server, or an agent framework, meets on its first calls:
portable schemas, progress while a silent program runs, a cancelled wait that leaves the program
running, sessions that survive a transport session per call, interpreters that make room at the
token's limit, and a plain "invalid token".

A real server and the official MCP client in both protocol eras.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from mcp_harness import Mode, ServerProcess, Servers, open_client

pytestmark = pytest.mark.e2e

TOKEN = "dropin-token-1"


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve(
        "dropin",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_MAX_INTERPRETERS_PER_PRINCIPAL="2",
        SANDBOX_PROGRESS_INTERVAL="1",
    )


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}/{i}")


async def test_every_schema_is_self_contained_open_at_the_root_and_strict_convertible(
    server: ServerProcess,
) -> None:
    async with open_client(server.url, TOKEN, "legacy") as conn:
        tools = (await conn.client.list_tools()).tools
    assert len(tools) >= 16
    for tool in tools:
        schema = tool.input_schema
        assert tool.description, tool.name
        for path, node in _walk([schema, tool.output_schema or {}]):
            assert "$ref" not in node and "$defs" not in node, (tool.name, path)
        for name, prop in schema["properties"].items():
            assert prop.get("description"), (tool.name, name)
        # OpenAI strict mode: every object below the root names its properties (an open dict
        # would be refused); google-genai's converter crashes on any `additionalProperties`.
        for path, node in _walk(schema):
            assert "additionalProperties" not in node, (tool.name, path)
            if node.get("type") == "object" and path:
                assert node.get("properties"), (tool.name, path)
    execute = next(t for t in tools if t.name == "execute_code").input_schema["properties"]
    config = next(c for c in execute["sandbox_config"]["anyOf"] if c.get("type") == "object")
    assert {"memory_mb", "pids", "network"} <= set(config["properties"])
    env = next(c for c in execute["environment"]["anyOf"] if c.get("type") == "array")
    assert env["items"]["required"] == ["name", "value"]


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_strict_mode_arguments_reach_the_program(server: ServerProcess, mode: Mode) -> None:
    """What a strict-mode model sends: every field, null where it means "unset"."""
    config = {key: None for key in ("memory_mb", "pids", "cpu_cores", "network")}
    async with open_client(server.url, TOKEN, mode) as conn:
        result = await conn.ok(
            "execute_code",
            command="echo $GREETING $OTHER",
            environment=[{"name": "GREETING", "value": "hi"}, {"name": "OTHER", "value": "x"}],
            sandbox_config={**config, "memory_mb": 128},
            timeout_seconds=None,
            working_directory=None,
            session=None,
        )
        assert _stdout(result) == "hi x\n"
        status = await conn.ok("get_execution_status", execution_id=result["execution_id"])
        assert status["limits"]["memory_mb"] == 128
        # 0.2's form of the environment still works.
        result = await conn.ok("execute_code", command="echo $A", environment={"A": "b"})
        assert _stdout(result) == "b\n"
        bad = await conn.error("execute_code", command="true", environment=[{"name": "A"}])
        assert bad.startswith("environment"), bad


def _stdout(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_silent_wait_sends_progress_and_a_cancelled_wait_leaves_it_running(
    server: ServerProcess, mode: Mode
) -> None:
    seen: list[tuple[float, float, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((time.monotonic(), value, message))

    async with open_client(server.url, TOKEN, mode) as conn:
        began = time.monotonic()
        result = await conn.call("execute_code", progress, command="sleep 4; echo done")
        assert not result.is_error and result.structured_content is not None
        assert result.structured_content["status"] == "completed"
        beats = [s for s in seen if s[0] - began < 3.9]
        assert len(beats) >= 2, seen  # every second (SANDBOX_PROGRESS_INTERVAL=1) with no output
        values = [s[1] for s in seen]
        assert values == sorted(set(values)), values  # strictly increasing

        seen.clear()
        started = await conn.ok("run_code_async", code="import time; time.sleep(3)")
        began = time.monotonic()
        page = await conn.call(
            "get_execution_output",
            progress,
            execution_id=started["execution_id"],
            last_event_id="1",
            wait=True,
            wait_seconds=2.5,
        )
        assert not page.is_error
        assert len([s for s in seen if s[0] - began < 2.5]) >= 1, seen

        # The client gives up on a waiting call: the program runs on and can be read later.
        apart = f"cancelled-wait-{uuid.uuid4().hex[:6]}"
        waiting = asyncio.create_task(
            conn.call("execute_code", command="sleep 2; echo survived", session=apart)
        )
        await asyncio.sleep(0.8)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        listed = await conn.ok("list_executions", session=apart)
        (info,) = listed["result"]
        assert info["status"] == "running"
        page = await conn.ok(
            "get_execution_output",
            execution_id=info["id"],
            session=apart,
            wait=True,
            last_event_id="1",
        )
        deadline = time.monotonic() + 10
        while page["status"] == "running" and time.monotonic() < deadline:
            page = await conn.ok(
                "get_execution_output", execution_id=info["id"], session=apart, wait=True
            )
        assert page["status"] == "completed"
        assert "survived\n" in _stdout(page)


async def test_a_transport_session_per_call_keeps_state_and_holds_one_interpreter(
    server: ServerProcess,
) -> None:
    """As langchain-mcp-adapters does by default: a new MCP session for every call."""
    session = f"per-call-{uuid.uuid4().hex[:6]}"
    for i, mode in enumerate(["legacy", "auto", "legacy", "legacy", "auto", "legacy"]):
        async with open_client(server.url, TOKEN, mode) as conn:  # type: ignore[arg-type]
            result = await conn.ok("run_code", code=f"n = {i} if {i} == 0 else n + 1; print(n)")
            assert result["session"] == "default"
            assert result["output"][-1]["type"] != "error"
            assert _stdout(result) == f"{i}\n", result
            if i == 0:
                named = await conn.ok("run_code", code="n = 'mine'", session=session)
                assert named["session"] == session
    # Naming "default" is the same as naming none.
    async with open_client(server.url, TOKEN, "auto") as conn:
        result = await conn.ok("run_code", code="print(n)", session="default")
        assert _stdout(result) == "5\n"


async def test_at_the_token_limit_the_least_recently_used_idle_interpreter_makes_room(
    server: ServerProcess,
) -> None:
    tag = uuid.uuid4().hex[:6]
    a, b, c = (f"{name}-{tag}" for name in "abc")
    async with open_client(server.url, TOKEN, "auto") as conn:
        # The module's other tests may hold the default session's interpreter: start clean.
        await conn.ok("restart_interpreter", session="default")
        for session in (a, b):
            await conn.ok("run_code", code="x = 1", session=session)
        await conn.ok("run_code", code="x", session=a)  # b is now the least recently used
        result = await conn.ok("run_code", code="x = 3", session=c)  # limit 2: b makes room
        assert result["status"] == "completed"
        again = await conn.ok("run_code", code="print('x' in dir())", session=b)
        assert again["state_reset"] == {"reason": "evicted"}
        assert _stdout(again) == "False\n"
        # Both slots busy: the refusal names what holds them and how to free them.
        busy = [
            await conn.ok("run_code_async", code="import time; time.sleep(4)", session=s)
            for s in (a, b)
        ]
        refused = await conn.error("run_code", code="1", session=c)
        assert "maximum of 2 interpreters" in refused and a in refused and b in refused, refused
        assert "cancel_execution" in refused
        for started, session in zip(busy, (a, b), strict=True):
            await conn.ok(
                "cancel_execution",
                execution_id=started["execution_id"],
                force=True,
                session=session,
            )


async def test_a_wrong_or_missing_token_says_so_in_plain_words(server: ServerProcess) -> None:
    hello = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    headers = {"Accept": "application/json, text/event-stream"}
    for token, word in (("Bearer nope", "invalid token"), (None, "missing token")):
        sent = {**headers, **({"Authorization": token} if token else {})}
        response = httpx2.post(server.url, json=hello, headers=sent, timeout=10)
        assert response.status_code == 401
        body = response.json()  # a JSON-RPC error: what the 2.x clients show from a 401
        assert body["error"]["message"].startswith(f"{word}: "), body
        challenge = response.headers["www-authenticate"]
        assert challenge.startswith("Bearer ") and "resource_metadata" not in challenge
        assert ("invalid_token" in challenge) == (token is not None)
        assert "re-register" not in json.dumps(body)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_plot_comes_once_as_an_image_and_the_text_says_what_it_is(
    server: ServerProcess, mode: Mode
) -> None:
    code = "from IPython.display import Image, display\nimport base64\n" + (
        "display(Image(data=base64.b64decode('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUl"
        "EQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==')))"
    )
    async with open_client(server.url, TOKEN, mode) as conn:
        result = await conn.call("run_code", code=code, session=f"plot-{mode}")
    assert not result.is_error and result.structured_content is not None
    png = result.structured_content["results"][0]["image/png"]
    images = [b for b in result.content if b.type == "image"]
    assert [i.data for i in images] == [png]
    (text,) = [b.text for b in result.content if b.type == "text"]
    assert text == "[png image]", text
    async with open_client(server.url, TOKEN, mode) as conn:
        result = await conn.call(
            "run_code", code=code, session=f"plot-{mode}", response_format="json"
        )
    (text,) = [b.text for b in result.content if b.type == "text"]
    assert png not in text
    if mode == "legacy":  # as json, 0.2's era: the result's JSON, the image named in it
        shown = json.loads(text)
        assert shown["execution_id"] == (result.structured_content or {})["execution_id"]
        assert "the image content" in shown["results"][0]["image/png"]


async def test_what_a_hostile_or_sloppy_caller_sends_gets_one_line_and_nothing_hangs(
    server: ServerProcess,
) -> None:
    async with open_client(server.url, TOKEN, "legacy") as conn:
        apart = f"sloppy-{uuid.uuid4().hex[:6]}"
        started = await conn.ok("execute_code_async", command="sleep 3", session=apart)
        eid = started["execution_id"]
        began = time.monotonic()
        # NaN as a wait once spun the event loop; a bad limit is refused before any wait.
        for args in ({"wait_seconds": "NaN"}, {"wait_seconds": "inf"}, {"limit": 0}):
            text = await conn.error(
                "get_execution_output", execution_id=eid, session=apart, wait=True, **args
            )
            assert "must be" in text, text
        assert time.monotonic() - began < 2
        health = await asyncio.to_thread(httpx2.get, f"{server.base_url}/health", timeout=3)
        assert health.status_code == 200
        # An argument named as the caller spelt it, clipped; an unknown tool in JSON too.
        text = await conn.error("get_execution_output", execution_id=eid, **{"last-event-id": 3})
        assert "unknown argument 'last-event-id'" in text, text
        text = await conn.error("execute_code", command="true", **{"x" * 5000: 1})
        assert len(text) < 1000, len(text)
        text = await conn.error("no_such_tool")
        assert text.startswith("unknown tool 'no_such_tool'"), text
        # An event id sent as a number (as models do) reads as its text.
        page = await conn.ok(
            "get_execution_output", execution_id=eid, session=apart, last_event_id=1
        )
        assert page["next_cursor"] >= "1"
        # A variable named twice in the list form is refused, not silently overwritten.
        env = [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]
        text = await conn.error("execute_code", command="true", environment=env)
        assert "given twice" in text, text


async def test_a_large_run_code_reply_fits_the_official_clients_limit_in_the_legacy_era(
    server: ServerProcess,
) -> None:
    """The client refuses an SSE event over 1 MiB; a legacy reply carries its result twice."""
    async with open_client(server.url, TOKEN, "legacy") as conn:
        code = 'print("\\"" * 250000); print("中" * 100000)'
        concise = await conn.call("run_code", code=code, session="big-reply")
        result = await conn.call("run_code", code=code, session="big-reply", response_format="json")
    (text,) = [b.text for b in concise.content if b.type == "text"]
    assert len(text) <= 100_000 and "omitted; read them with read_file(" in text, text[-300:]
    assert not result.is_error, result.content
    assert result.structured_content is not None
    (text,) = [b.text for b in result.content if b.type == "text"]
    shown = json.loads(text)
    assert shown["status"] == "completed"
    assert shown["execution_id"] == result.structured_content["execution_id"]
    # The output read in full, in pages: every byte printed comes back.
    printed = 250000 + 1 + 3 * 100000 + 1
    cursor, got = "0", 0
    async with open_client(server.url, TOKEN, "legacy") as conn:
        while True:
            page = await conn.ok(
                "get_execution_output",
                execution_id=shown["execution_id"],
                session="big-reply",
                last_event_id=cursor,
            )
            got += sum(len(e.get("data", "").encode()) for e in page["output"])
            cursor = page["next_cursor"]
            if not page["has_more"]:
                break
    assert got == printed


async def test_a_large_file_read_fits_too_and_its_text_says_what_it_left_out(
    server: ServerProcess,
) -> None:
    body = '"quoted" ' * 70_000  # 630 KB, quotes escaped twice in a legacy text block
    async with open_client(server.url, TOKEN, "legacy") as conn:
        await conn.ok("write_file", path="big.txt", content=body, session="big-file")
        result = await conn.call("read_file", path="big.txt", length=700_000, session="big-file")
    assert not result.is_error, result.content
    assert result.structured_content is not None
    assert result.structured_content["content"] == body
    (text,) = [b.text for b in result.content if b.type == "text"]
    # The text within its budget, and the call that reads on (SANDBOX_RESULT_TEXT=json: the
    # JSON with the content left out, `text_left_out` naming it: tests/test_compat_02.py's era).
    assert len(text) <= 100_000 and text.startswith('"quoted" "quoted"')
    end = len(text[: text.rindex("\n[bytes ")].encode())
    assert text.endswith(
        f"[bytes 0-{end:,} of {len(body):,}; read on with read_file(path='big.txt', "
        f"offset={end}, length=99000, session='big-file')]"
    ), text[-300:]
