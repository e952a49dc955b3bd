"""What a model reads (DESIGN §18), against a real server, in both protocol eras: concise text,
a budget per result, output past it cut head and tail and kept whole in the workspace, events
within their bound, and hints that work: a small hint-follower parses every call a result's text
names and makes it exactly as written.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from hints_harness import follow, hints, text_of
from mcp_harness import Mode, ServerProcess, Servers, open_client

pytestmark = pytest.mark.e2e

TOKEN = "screens-token-0123456789"
MODES: list[Mode] = ["legacy", "auto"]
LINES = 200_000
LONG = f"for i in range({LINES}):\n    print(f'line {{i}}')"
WHOLE = "".join(f"line {i}\n" for i in range(LINES))
LONG_BYTES = len(WHOLE)
EVENT_MAX = 64 * 1024


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve("screens", SANDBOX_AUTH_TOKEN=TOKEN)


@pytest.mark.parametrize("mode", MODES)
async def test_a_short_command_reads_as_its_output_and_exit(
    server: ServerProcess, mode: Mode
) -> None:
    async with open_client(server.url, TOKEN, mode) as conn:
        result = await conn.call("execute_code", command="python3 -c 'print(6*7)'")
        text = text_of(result)
        assert re.fullmatch(r"42\n\[exit 0, \d+ ms\]", text), text
        structured = result.structured_content or {}
        assert [e["type"] for e in structured["output"]][-1] == "exit"  # the contract: kept
        mixed = text_of(await conn.call("execute_code", command="echo out; echo err >&2; exit 3"))
        assert re.fullmatch(r"out\n\[stderr\]\nerr\n\[exit 3, \d+ ms\]", mixed), mixed
        detailed = await conn.call("execute_code", command="echo hi", response_format="detailed")
        assert "next_cursor=" in text_of(detailed) and "#1 ready" in text_of(detailed)
        as_json = await conn.call("execute_code", command="echo hi", response_format="json")
        if mode == "legacy":  # the JSON of the result, as before (and as 0.2 sent it)
            assert json.loads(text_of(as_json)) == as_json.structured_content
        wrong = await conn.call("get_execution_output", execution_id="no-such-execution")
        assert wrong.is_error
        assert text_of(wrong) == "Error (not_found): execution 'no-such-execution' not found"
        assert (wrong.structured_content or {})["error_type"] == "not_found"


@pytest.mark.parametrize("mode", MODES)
async def test_hints_of_a_named_session_work_as_written(server: ServerProcess, mode: Mode) -> None:
    session = f"experiment-{uuid.uuid4().hex[:6]}"
    async with open_client(server.url, TOKEN, mode) as conn:
        started = await conn.call(
            "execute_code_async", command="sleep 0.5; echo done", session=session
        )
        structured = started.structured_content or {}
        assert f"session='{session}'" in structured["message"]
        page, text = await follow(conn, text_of(started), "get_execution_output")
        assert page["status"] == "completed" and text.startswith("done\n"), text
        asked = await conn.call(
            "execute_code_async",
            command="read name; echo hello $name",
            interactive=True,
            session=session,
        )
        asked_id = (asked.structured_content or {})["execution_id"]
        await conn.ok("send_stdin", execution_id=asked_id, input_data="model", session=session)
        page, text = await follow(conn, text_of(asked), "get_execution_output")
        assert text.startswith("hello model\n"), text
        slow = await conn.ok("execute_code_async", command="sleep 60", session=session)
        status = text_of(
            await conn.call(
                "get_execution_status", execution_id=slow["execution_id"], session=session
            )
        )
        await follow(conn, status, "get_execution_output")
        cancelled = await conn.call(
            "cancel_execution", execution_id=slow["execution_id"], session=session
        )
        assert "cancelled" in text_of(cancelled), text_of(cancelled)
        listed = await conn.call("list_executions", limit=1, session=session)
        first = (listed.structured_content or {})["result"][0]["id"]
        older, text = await follow(conn, text_of(listed), "list_executions")
        assert older["result"][0]["id"] != first and first not in text


@pytest.mark.parametrize("mode", MODES)
async def test_a_long_output_is_cut_kept_and_readable_through_its_hints(
    server: ServerProcess, mode: Mode
) -> None:
    session = f"long-{uuid.uuid4().hex[:6]}"
    async with open_client(server.url, TOKEN, mode) as conn:
        result = await conn.call("run_code", code=LONG, session=session)
        text = text_of(result)
        assert len(text) <= 100_000
        structured = result.structured_content or {}
        execution_id = structured["execution_id"]
        # Head and tail, what was cut between them, and where the whole of it is.
        assert text.startswith("line 0\nline 1\n") and text.endswith(f"line {LINES - 1}")
        note = re.search(r"\[… (the line goes on; )?([\d,]+) bytes, ([\d,]+) lines omitted", text)
        assert note is not None, text[:500]
        # (The note takes the newline the tail lost at the end; when the head ends inside a
        # line, the note says so, and the line break before it is not the output's.)
        goes_on = note.group(1) is not None
        shown_lines = text.count("\n") - goes_on
        assert int(note.group(3).replace(",", "")) + shown_lines == LINES
        log = f".outputs/{execution_id}.log"
        assert log in text
        # The file holds the output whole; its hint reads exactly where the head stops.
        whole = await conn.ok("read_file", path=log, offset=0, length=1, session=session)
        assert whole["size"] == LONG_BYTES
        part, part_text = await follow(conn, text, "read_file")
        head = text[: text.index("[…") - goes_on]
        assert part["offset"] == len(head.encode())
        assert WHOLE.startswith(head + part["content"]), part["content"][:40]
        assert len(part_text) <= 100_000
        await follow(conn, part_text, "read_file")  # and its "read on" hint too
        # Events and pages within their bounds; every page's text within the budget; the
        # cursors in the text read the whole output through.
        cursor = "0"
        events = 0
        pages = 0
        while True:
            page = await conn.call(
                "get_execution_output",
                execution_id=execution_id,
                last_event_id=cursor,
                session=session,
            )
            assert not page.is_error, text_of(page)
            body = page.structured_content or {}
            assert len(json.dumps(body["output"])) <= 300 * 1024
            for event in body["output"]:
                assert len(event.get("data", "").encode()) <= EVENT_MAX
            events += len(body["output"])
            assert len(text_of(page)) <= 100_000
            pages += 1
            if not body["has_more"]:
                break
            nexts = [a for t, a in hints(text_of(page)) if t == "get_execution_output"]
            assert nexts[-1]["last_event_id"] == body["next_cursor"], text_of(page)[-400:]
            cursor = body["next_cursor"]
        assert pages >= 8 and events >= LONG_BYTES // EVENT_MAX
        # A smaller budget per call, within it.
        small = await conn.call(
            "get_execution_output", execution_id=execution_id, max_chars=5000, session=session
        )
        assert len(text_of(small)) <= 5000
        await follow(conn, text_of(small), "read_file")


@pytest.mark.parametrize("mode", MODES)
async def test_run_code_reads_as_a_notebook(server: ServerProcess, mode: Mode) -> None:
    session = f"nb-{uuid.uuid4().hex[:6]}"
    async with open_client(server.url, TOKEN, mode) as conn:
        table = await conn.call(
            "run_code",
            code="import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3]})\ndf.describe()",
            session=session,
        )
        text = text_of(table)
        assert text.startswith("         a\ncount  3.0\nmean   2.0"), text
        assert "\\n" not in text and "{" not in text
        failed = text_of(await conn.call("run_code", code="1/0", session=session))
        assert failed.endswith("ZeroDivisionError: division by zero"), failed
        assert len(failed.splitlines()) <= 9
        asked = await conn.call(
            "run_code_async", code="x = input('name? ')\nprint('hi', x)", session=session
        )
        text = ""
        for _ in range(20):  # (the kernel may not have asked yet at the first read)
            _, text = await follow(conn, text_of(asked), "get_execution_output")
            if "input requested" in text:
                break
        assert "input requested: 'name? '" in text, text
        template = next(a for t, a in hints(text) if t == "send_stdin")
        assert template["input_data"] == "<your answer>"
        await conn.ok("send_stdin", **{**template, "input_data": "model"})
        for _ in range(20):  # (the answer may not have been printed at the first read)
            done, text = await follow(conn, text_of(asked), "get_execution_output")
            if "hi model" in text:
                break
        assert "hi model" in text and done["status"] == "completed", text


async def test_a_program_writing_line_by_line_keeps_all_its_output(server: ServerProcess) -> None:
    """print() in a loop under PYTHONUNBUFFERED (the sandbox's) writes 200,000 times: its output
    is gathered into few events (it made one per read, some 20,000 on a busy machine, and the
    oldest past MAX_EVENTS_IN_MEMORY were dropped, so the whole output was never readable)."""
    loop = f"for i in range({LINES}): print(f'line {{i}}')"
    async with open_client(server.url, TOKEN, "auto") as conn:
        done = await conn.ok("execute_code", command=["python3", "-c", loop], session="lines")
        status = await conn.ok(
            "get_execution_status", execution_id=done["execution_id"], session="lines"
        )
        first = done["output"][0]
        assert first["type"] == "ready" and first["event_id"] == "1", first  # nothing dropped
        assert int(status["last_event_id"]) < 2_000, status  # (gathered: ~150 on a quiet machine)


async def _quietly(*_: Any) -> None:
    """A progress callback: asking for progress makes the reply an SSE event, whose size the
    official client bounds (1 MiB)."""


@pytest.mark.parametrize("mode", MODES)
async def test_texts_of_characters_that_cost_more_on_the_wire_fit_an_sse_event(
    server: ServerProcess, mode: Mode
) -> None:
    # A budget counts characters; JSON sends a control character as \u0001 (6 bytes) and the
    # 2026 era an emoji as 12: at the largest budget, 400,000 of them made a text of 2.4-4.8 MB,
    # which the client refused ("Server-sent event exceeded the 1048576 byte limit"); and so
    # did a read_file of 512 KiB (its default) of such text, the log's hint among them.
    session = f"wire-{uuid.uuid4().hex[:6]}"
    async with open_client(server.url, TOKEN, mode) as conn:
        for char in ("\\x01", "\\U0001F600"):
            command = f"python3 -c \"import sys; sys.stdout.write('{char}' * 3000000)\""
            ran = await conn.call(
                "execute_code", _quietly, command=command, session=session, max_chars=400_000
            )
            text = text_of(ran)
            assert len(json.dumps(text)) <= 384 * 1024  # (as the 2026 era escapes it)
            part, part_text = await follow(conn, text, "read_file", _quietly)  # as written
            assert part["length"] > 0
            await follow(conn, part_text, "read_file", _quietly)
            page = await conn.call(
                "get_execution_output",
                _quietly,
                execution_id=(ran.structured_content or {})["execution_id"],
                session=session,
                max_chars=400_000,
            )
            assert not page.is_error
            assert len(json.dumps(text_of(page))) <= 384 * 1024
        for char in ("chr(1)", "chr(0x1F600)"):
            await conn.ok(
                "execute_code", command=f"python3 -c \"open('e','w').write({char} * 3000000)\""
            )
            read = await conn.call("read_file", _quietly, path="e")
            assert not read.is_error and not (read.structured_content or {})["eof"]
            await follow(conn, text_of(read), "read_file", _quietly)


# stdout and stderr taking turns: the text marks each turn ([stderr], [stdout]), which the log
# and the events do not hold. The hints' offset and cursor counted the marks as output: the
# read_file hint skipped 9 bytes of output per turn shown, the cursor events shown only in part.
TURNS = (  # (slowly, each line one write: print() writes a line's end apart, and a read
    # between the two would end an event inside a line, which this test does not parse)
    "import os, time\nfor i in range(300):\n    os.write(1, f'out {i}\\n'.encode())\n"
    "    os.write(2, f'err {i}\\n'.encode())\n    time.sleep(0.002)"
)


@pytest.mark.parametrize("response_format", ["concise", "detailed"])
async def test_hints_read_on_exactly_where_the_text_stops_when_streams_take_turns(
    server: ServerProcess, response_format: str
) -> None:
    session = f"turns-{uuid.uuid4().hex[:6]}"
    async with open_client(server.url, TOKEN, "auto") as conn:
        ran = await conn.call(
            "execute_code",
            command=["python3", "-c", TURNS],
            session=session,
            max_chars=2000,
            response_format=response_format,
        )
        text = text_of(ran)
        execution_id = (ran.structured_content or {})["execution_id"]
        # The output the head shows (its lines without the marks), as the log holds it.
        shown = "".join(re.findall(r"^(?:out|err) \d+\n", text[: text.index("[…")], re.M))
        log = f".outputs/{execution_id}.log"
        size = (await conn.ok("read_file", path=log, length=1, session=session))["size"]
        whole = (await conn.ok("read_file", path=log, length=size, session=session))["content"]
        assert shown and whole.startswith(shown), shown[-200:]
        part, _ = await follow(conn, text, "read_file")
        assert part["offset"] == len(shown.encode()), (part["offset"], len(shown))
        # The cursor: every event up to it is shown whole (nothing skipped).
        cursor = next(a for t, a in hints(text) if t == "get_execution_output")["last_event_id"]
        upto = await conn.ok(
            "get_execution_output",
            execution_id=execution_id,
            last_event_id="0",
            limit=int(cursor),
            session=session,
        )
        data = "".join(e["data"] for e in upto["output"] if e["type"] in ("stdout", "stderr"))
        assert shown.startswith(data), (cursor, len(data), len(shown))


@pytest.mark.parametrize("tool", ["execute_code", "run_code"])
async def test_json_text_is_whole_and_keeps_no_log_file(server: ServerProcess, tool: str) -> None:
    # 0.2's programs read the JSON text (response_format="json" or SANDBOX_RESULT_TEXT=json): it
    # is shown whole, so nothing is cut and no `.outputs/` file appears in their workspace.
    session = f"json-{uuid.uuid4().hex[:6]}"
    code = "print('x' * 5000)"
    args = {"command": f'python3 -c "{code}"'} if tool == "execute_code" else {"code": code}
    async with open_client(server.url, TOKEN, "legacy") as conn:
        result = await conn.call(
            tool, session=session, response_format="json", max_chars=2000, **args
        )
        assert not result.is_error and "x" * 5000 in text_of(result)
        assert json.loads(text_of(result))["execution_id"]
        listed = await conn.call("list_files", session=session, path=".")
        assert ".outputs" not in json.dumps(listed.structured_content), listed.structured_content
        cut = await conn.call(tool, session=session, max_chars=2000, **args)  # (concise: kept)
        assert ".outputs/" in text_of(cut), text_of(cut)
