"""The text of tool results: what a model reads (DESIGN §18).

A result's structured content is for programs (the 0.2 contract, unchanged); its text block is
a screen for a model: the output as text (stderr marked), how the execution ended or that it
still runs, the files it wrote and the call to make next — no event ids, timestamps or nulls
unless `response_format="detailed"` asks. Every text is within a budget of characters; output
past it is cut head and tail, saying what was cut and the exact call that reads it. Every call
named here is one that works as written (tests/test_screens.py follows them).
"""

from __future__ import annotations

import contextvars
import json
from typing import Any

from sandbox_runtime.domain.owner import DEFAULT_SESSION
from sandbox_runtime.server.cuts import cut, first, last, measure, omitted_note
from sandbox_runtime.server.screen_spans import Span, cursor_within, detailed_events, output_in

FORMATS = ("concise", "detailed", "json")
MIN_BUDGET, MAX_BUDGET = 2_000, 400_000
NOTES_ROOM = 1_000  # characters of a budget kept for what is said around the output
TRACEBACK_LINES = 8  # of an exception's traceback, its last lines (the call that raised)

# The call's format and budget, set for it by the ErrorResults middleware (replies.py).
result_format: contextvars.ContextVar[str] = contextvars.ContextVar(
    "srt_result_format", default="concise"
)
result_budget: contextvars.ContextVar[int] = contextvars.ContextVar(
    "srt_result_budget", default=100_000
)


def screen_args() -> dict[str, Any]:
    """What a session operation is told of this call's text: its budget, and whether it is
    cut at all (JSON text, 0.2's, is shown whole: no cut and no `.outputs/` log file)."""
    return {"max_chars": result_budget.get(), "screen": result_format.get() != "json"}


def call(tool: str, session: str | None = None, **args: Any) -> str:
    """A call as a model makes it (Python syntax: keyword arguments, literal values), with the
    session when it is not the default one (ids are the session's)."""
    if session and session != DEFAULT_SESSION:
        args["session"] = session
    return f"{tool}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


def read_on(result: dict[str, Any], cursor: str, wait: bool = False) -> str:
    """The call that reads an execution's output after `cursor`."""
    more = {"wait": True} if wait else {}
    return call(
        "get_execution_output",
        result.get("session"),
        execution_id=result["execution_id"],
        last_event_id=cursor,
        **more,
    )


# -- output --------------------------------------------------------------------------------


def _event_line(event: dict[str, Any], session: str | None, execution_id: str) -> str | None:
    """One line for an event that is not output (None: nothing a model needs)."""
    kind = event.get("type")
    if kind == "truncated":
        return f"[{event.get('message') or 'output truncated'}]"
    if kind == "error":
        return f"[error: {event.get('message')}]"
    if kind == "resource_limit":
        return f"[resource limit: {event.get('reason') or event.get('message')}]"
    if kind == "network_denied":
        return f"[network denied: {event.get('host')}:{event.get('port')} ({event.get('reason')})]"
    if kind == "tool_call":
        return f"[{event.get('name')} → {event.get('reason')}, {event.get('duration_ms')} ms]"
    if kind == "input_request":
        answer = call("send_stdin", session, execution_id=execution_id, input_data="<your answer>")
        return f"[input requested: {event.get('prompt')!r}; answer with {answer}]"
    if kind == "exception":
        return error_text(event)
    if kind == "result":
        return bundle_text(event.get("bundle") or {})
    return None  # ready, exit, timeout, cancelled: the status line says them


def render(
    events: list[dict[str, Any]],
    session: str | None,
    execution_id: str,
    spans: list[Span] | None = None,
) -> str:
    """Events as a terminal shows them: stdout as is, stderr marked, others one line each;
    `spans` gets where each is (screen_spans)."""
    out: list[str] = []
    at = 0
    stream = "stdout"
    marked = False

    def put(piece: str) -> None:
        nonlocal at
        out.append(piece)
        at += len(piece)

    def line_start() -> None:
        if out and not out[-1].endswith("\n"):
            put("\n")

    for event in events:
        kind = event.get("type")
        if kind in ("stdout", "stderr"):
            if kind != stream and (kind == "stderr" or marked):
                line_start()
                put(f"[{kind}]\n")
                marked = True
            stream = kind
            start = at
            put(event.get("data") or "")
        else:
            line = _event_line(event, session, execution_id)
            if line:
                line_start()
            start = at
            if line:
                put(line + "\n")
        if spans is not None:
            spans.append((event, start, at))
    return "".join(out)


# -- executions ------------------------------------------------------------------------------


def ending(result: dict[str, Any]) -> str:
    """How an execution ended, in a few words (`exit 0, 12 ms`)."""
    status = result.get("status")
    parts = [] if status in ("completed", "failed") else [str(status)]
    if result.get("exit_code") is not None:
        parts.append(f"exit {result['exit_code']}")
    if result.get("signal"):
        parts.append(f"signal {result['signal']}")
    if result.get("reason") and result.get("reason") not in parts:
        parts.append(str(result["reason"]))
    if isinstance(result.get("error"), str) and result["error"]:
        parts.append(result["error"])
    if result.get("duration_ms") is not None:
        ms = int(result["duration_ms"])
        parts.append(f"{ms} ms" if ms < 10_000 else f"{ms / 1000:.1f} s")
    return ", ".join(parts) or str(status)


def execution_screen(
    result: dict[str, Any], budget: int, show_end: bool = True, after: str = "0"
) -> str:
    """execute_code(_async), get_execution_output (its page read `after` a cursor) and
    run_code: output, end, next step. `result["screen"]`: the tail and log of an output larger
    than the budget (sessions/output_log.py)."""
    session = result.get("session")
    execution_id = result["execution_id"]
    events = result.get("output") or []
    detailed = result_format.get() == "detailed"
    spans: list[Span] = []
    if detailed:
        text = detailed_events(events, spans)
    else:
        text = render(events, session, execution_id, spans)
    budget = max(MIN_BUDGET, budget) - NOTES_ROOM  # (what is said around the output)
    screen = result.get("screen") or {}
    tail_spans: list[Span] = []
    tail = render(screen.get("tail") or [], session, execution_id, tail_spans) if screen else ""
    log = screen.get("log") or {}
    more_via: list[str] = []
    parts: list[str] = []
    # What is cut is counted as output (screen_spans): the log's bytes, the events' ids. A
    # concise head ends with a whole event when one fits (_whole_head): the cursor after it
    # reads on repeating nothing.
    whole = None if detailed else _whole_head(spans, budget)
    if tail:  # head from the first page, tail from the end; the middle is in the log
        head = text[:whole] if whole else first(text, budget // 2)
        end = last(tail, budget - len(head))
        head_out = output_in(spans, 0, len(head))
        end_out = output_in(tail_spans, len(tail) - len(end), len(tail))
        size = screen["total_bytes"] - head_out[0] - end_out[0]
        lines = screen["total_lines"] - head_out[1] - end_out[1]
        if log.get("path"):
            offset = log.get("offset", 0) + head_out[0]
            more_via.append(_read_log(log, session, offset, size, budget))
        more_via.append(read_on(result, cursor_within(spans, len(head), after)))
        parts += [head, omitted_note(max(0, size), max(0, lines), more_via, head), end]
    else:
        head, middle, end = cut(text, budget)
        if middle and whole:  # the head ends with an event: reading on repeats none of it
            head, rest = text[:whole], text[whole:]
            end = last(rest, budget - whole)
            middle = rest[: len(rest) - len(end)]
        if middle:
            size, lines = output_in(spans, len(head), len(text) - len(end))
            if log.get("path"):
                offset = log.get("offset", 0) + output_in(spans, 0, len(head))[0]
                more_via.append(_read_log(log, session, offset, size, budget))
            more_via.append(read_on(result, cursor_within(spans, len(head), after)))
            parts += [head, omitted_note(size, lines, more_via, head), end]
        elif text:
            parts.append(text)
    if log.get("error"):
        parts.append(f"[{log['error']}]")
    status = result.get("status")
    finished = status not in ("pending", "running")
    if not finished:
        cursor = str(result.get("next_cursor") or "0")
        parts.append(f"[{status}; read its output with {read_on(result, cursor, wait=True)}]")
    else:
        if result.get("has_more") and not tail:
            shown = "".join(parts)
            goes_on = ", the line goes on" if shown and not shown.endswith("\n") else ""
            more = read_on(result, str(result.get("next_cursor")))
            parts.append(f"[more output{goes_on}: {more}]")
        if show_end or status != "completed":
            parts.append(f"[{ending(result)}]")
    parts += _notes(result)
    if result_format.get() == "detailed":
        parts.insert(0, _detail_head(result))
    return _join(parts)


DETAIL_KEYS = (
    "execution_id",
    "session",
    "status",
    "exit_code",
    "signal",
    "duration_ms",
    "next_cursor",
    "has_more",
    "first_event_id",
    "dropped_bytes",
    "execution_count",
)


def _detail_head(result: dict[str, Any]) -> str:
    shown = {k: result[k] for k in DETAIL_KEYS if result.get(k) is not None}
    return " ".join(f"{k}={v}" for k, v in shown.items())


def _whole_head(spans: list[Span], budget: int) -> int | None:
    """Where a head of whole events ends: after as many events from the start as fit in
    three quarters of `budget` (a quarter is left for the tail), so the cursor after the last
    of them (screen_spans.cursor_within) reads on repeating none of the head. None when not
    even the first output event fits (events are up to 64 KiB; a small budget cuts inside
    one). (The text up to an event's span end is the text of the events up to it.)"""
    limit = budget - budget // 4
    end = None
    for event, _, last_at in spans:
        if last_at > limit:
            break
        if end is not None or event.get("type") in ("stdout", "stderr"):
            end = last_at
    return end


def _read_log(log: dict[str, Any], session: str | None, offset: int, size: int, budget: int) -> str:
    length = max(1, min(size, budget))
    return call("read_file", session, path=log["path"], offset=offset, length=length)


def _notes(result: dict[str, Any]) -> list[str]:
    notes = []
    if result.get("files"):
        listed = ", ".join(f"{f['path']} ({f['size']:,} B)" for f in result["files"][:10])
        more = len(result["files"]) - 10
        notes.append(f"[files written: {listed}{f', and {more} more' if more > 0 else ''}]")
    if result.get("session_reset"):
        reset = result["session_reset"]
        notes.append(f"[session reset ({reset.get('reason')}): a fresh workspace]")
    state = result.get("state_reset")
    if state and state.get("reason") != "first_call":
        notes.append(f"[interpreter state reset: {state['reason']}; earlier variables are gone]")
    return notes


def _join(parts: list[str]) -> str:
    out = ""
    for part in parts:
        if not part:
            continue
        if out and not out.endswith("\n"):
            out += "\n"
        out += part
    return out.rstrip("\n") or "[no output]"


# -- run_code --------------------------------------------------------------------------------

IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")


def bundle_text(bundle: dict[str, Any]) -> str | None:
    """A rich output as text: its plain, markdown or JSON form; an image is named."""
    image = next((m for m in IMAGE_TYPES if m in bundle), None)
    if image is not None:
        return f"[{image.split('/')[1]} image]"
    for mime in ("text/plain", "text/markdown", "application/json", "text/html"):
        if mime in bundle:
            value = bundle[mime]
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return f"[{', '.join(bundle)}]" if bundle else None


def error_text(error: dict[str, Any]) -> str:
    """An exception as `name: value` and the last lines of its traceback."""
    lines = "\n".join(error.get("traceback") or []).splitlines()
    head = f"{error.get('name')}: {error.get('value')}"
    body = [line for line in lines if line.strip().strip("-")][-TRACEBACK_LINES:]
    if body and body[-1].strip() == head.strip():
        body = body[:-1]
    return "\n".join([*body, head]) if body else head


def run_code_screen(result: dict[str, Any], budget: int) -> str:
    """run_code: the output, the rich results (images as image blocks), the error."""
    results = result.get("results") or []
    # Rich results appear where their events were; the structured result lists their bundles.
    events = []
    for event in result.get("output") or []:
        if event.get("type") == "result" and isinstance(event.get("index"), int):
            index = event["index"]
            bundle = results[index] if index < len(results) else {}
            event = {**event, "bundle": bundle}
        if event.get("type") == "exception":
            continue  # said once, below, from `error`
        events.append(event)
    shaped = {**result, "output": events}
    error = result.get("error")
    text = execution_screen({**shaped, "error": None}, budget, show_end=False)
    if isinstance(error, dict):
        text = _join([text if text != "[no output]" else "", error_text(error)])
    elif isinstance(error, str) and error:
        text = _join([text if text != "[no output]" else "", f"[{error}]"])
    return text


# -- other results ---------------------------------------------------------------------------


def stdin_screen(result: dict[str, Any]) -> str:
    state = "stdin open" if result.get("stdin_open") else "stdin closed"
    return f"wrote {result['bytes_written']} bytes ({state}; execution {result['status']})"


def cancel_screen(result: dict[str, Any]) -> str:
    was = "cancelled" if result.get("was_running") else "had already ended"
    return f"{result['execution_id']} {was}: {ending(result)}"


def status_line(item: dict[str, Any]) -> str:
    command = item.get("command")
    if isinstance(command, list):
        command = " ".join(command)
    command = str(command or "").replace("\n", "⏎")
    if len(command) > 80:
        command = command[:80] + "…"
    kind = f"{item['language']} code" if item.get("language") else "command"
    return f"{item['id']}  {ending(item)}  {kind}: {command}"


def status_screen(item: dict[str, Any]) -> str:
    text = status_line(item)
    if item.get("status") in ("pending", "running"):
        stdin = ", stdin open" if item.get("stdin_open") else ""
        cursor = str(item.get("last_event_id") or "0")
        hint = call(
            "get_execution_output",
            item.get("session"),
            execution_id=item["id"],
            last_event_id="0",
        )
        text += f"\n[{item['status']}{stdin}; {cursor} events so far: read them with {hint}]"
    if result_format.get() == "detailed":
        text += "\n" + compact({k: v for k, v in item.items() if k not in ("command",)})
    return text


def list_screen(structured: dict[str, Any], session: str | None, status: str | None) -> str:
    items = structured.get("result") or []
    lines = [status_line(i) for i in items] or ["no executions"]
    if structured.get("next_cursor"):
        more: dict[str, Any] = {"cursor": structured["next_cursor"]}
        if status:
            more["status"] = status
        lines.append(f"[older ones: {call('list_executions', session, **more)}]")
    return "\n".join(lines)


def error_screen(body: dict[str, Any]) -> str:
    return f"Error ({body.get('error_type')}): {body.get('error')}"


def compact(value: Any, indent: str = "") -> str:
    """Any result as `key: value` lines (nested indented, list items after `- `), without
    nulls; an empty list is `none`."""
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if item is None or item == {}:
                continue
            if item == []:
                lines.append(f"{indent}{key}: none")
            elif isinstance(item, dict | list):
                lines.append(f"{indent}{key}:\n{compact(item, indent + '  ')}")
            else:
                lines.append(f"{indent}{key}: {item}")
        return "\n".join(lines)
    if isinstance(value, list):
        return "\n".join(f"{indent}- {compact(i, indent + '  ').lstrip()}" for i in value)
    return f"{indent}{value}"


def read_screen(result: dict[str, Any], session: str | None, budget: int) -> str:
    """read_file: the text itself (within the budget), and where the next part starts when
    there is more."""
    end = result["offset"] + result["length"]
    if result.get("encoding") != "utf-8":
        text = (
            f"[{result['length']:,} bytes of {result['mime_type']} as base64 (structured content)]"
        )
    else:
        text = result.get("content") or ""
        if len(text) > budget - NOTES_ROOM:
            text = first(text, budget - NOTES_ROOM)
            end = result["offset"] + measure(text)[0]
    if end >= result["size"] and not result["offset"]:
        return text or "[empty file]"
    more = ""
    if end < result["size"]:
        length = max(1, min(result["size"] - end, budget - NOTES_ROOM))
        more = "; read on with " + call(
            "read_file", session, path=result["path"], offset=end, length=length
        )
    return f"{text}\n[bytes {result['offset']:,}-{end:,} of {result['size']:,}{more}]"
