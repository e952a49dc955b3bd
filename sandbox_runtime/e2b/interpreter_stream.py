"""An interpreter call's events as E2B's `POST /execute` answer: NDJSON lines, streamed.

E2B's lines (template/server in e2b-dev/code-interpreter, read by both SDKs' parseOutput):
`{type: stdout|stderr, text, timestamp}`, `{type: result, text, html, markdown, svg, png, jpeg,
pdf, latex, json, javascript, data, chart, extra, is_main_result}` (absent fields left out),
`{type: error, name, value, traceback}`, `{type: number_of_executions, execution_count}`,
`{type: keepalive}` while nothing comes (a write that finds the client gone), and last
`{type: end_of_execution}`. The call's events are read as any reader of the execution reads
them (Router.executions: this replica's memory, or another's mirror), so the stream owns
nothing: a client that goes away stops the reading, and the call is interrupted as E2B's
server interrupts it (its kernel keeps its state; its end is recorded as `cancelled`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sandbox_runtime.domain.models import EventType, ExecutionInfo, ExecutionStatus, OutputEvent
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import ExecutionNotFoundError

KEEPALIVE_SECONDS = 5.0  # E2B's KEEPALIVE_INTERVAL
PAGE_EVENTS = 1000
MIRROR_LAG_SECONDS = 5.0  # a call started on another replica, not yet in the mirror
# A result's MIME types and the fields E2B names them by; the rest go to `extra`.
RESULT_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}
# How a call that ended otherwise than by finishing its code is told (when its code raised
# nothing itself): E2B's own names where it has one.
END_ERRORS = {
    ExecutionStatus.TIMEOUT: "TimeoutError",
    ExecutionStatus.CANCELLED: "ExecutionAborted",
    ExecutionStatus.FAILED: "InterpreterError",
    ExecutionStatus.LOST: "InterpreterError",
}


async def read_page(
    read: Callable[..., Any], owner: Owner, execution_id: str, after: int, wait: float
) -> Any:
    """A page of the call's events after `after` (ExecutionAccess.read_output). A call
    started on another replica (the session's home) reaches this one's view through the
    mirror a moment after its start was answered: not found is retried for MIRROR_LAG_SECONDS.

    Raises ExecutionNotFoundError after that, and what the read raises."""
    unseen_until = time.monotonic() + MIRROR_LAG_SECONDS
    while True:
        try:
            return await read(owner, execution_id, after, PAGE_EVENTS, wait)
        except ExecutionNotFoundError:
            if after > 0 or time.monotonic() > unseen_until:
                raise
            await asyncio.sleep(0.02)


def line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item, separators=(",", ":")) + "\n").encode()


def timestamp(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


def result_line(bundle: dict[str, Any], is_main_result: bool) -> dict[str, Any]:
    """A MIME bundle as E2B's result (its text/plain unquoted, as E2B's server does)."""
    out: dict[str, Any] = {"type": "result"}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        name = RESULT_FIELDS.get(mime)
        if name is None:
            extra[mime] = value
        elif value is not None:
            out[name] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    out["extra"] = extra
    out["is_main_result"] = is_main_result
    return out


def event_lines(event: OutputEvent) -> list[dict[str, Any]]:
    """The NDJSON items of one of our events (most have none: the end is told apart)."""
    kind = event.type
    if kind in (EventType.STDOUT, EventType.STDERR) and event.data:
        return [{"type": kind.value, "text": event.data, "timestamp": timestamp(event.ts)}]
    if kind is EventType.RESULT:
        return [result_line(event.bundle or {}, event.execution_count is not None)]
    if kind is EventType.EXCEPTION:
        trace = "\n".join(event.traceback or [])
        return [{"type": "error", "name": event.name, "value": event.value, "traceback": trace}]
    if kind in (EventType.TRUNCATED, EventType.NETWORK_DENIED):
        note = event.message or f"network access to {event.host}:{event.port} denied"
        return [
            {"type": "stderr", "text": f"[sandbox: {note}]\n", "timestamp": timestamp(event.ts)}
        ]
    return []


def end_lines(info: ExecutionInfo, raised: bool) -> list[dict[str, Any]]:
    """What closes a call: its error when it ended otherwise than by its code's own end (and
    its code raised nothing), its count, and end_of_execution."""
    out: list[dict[str, Any]] = []
    name = END_ERRORS.get(info.status)
    if name is not None and not raised:
        value = info.error or info.reason or info.status.value
        out.append({"type": "error", "name": name, "value": value, "traceback": ""})
    if info.execution_count is not None:
        out.append({"type": "number_of_executions", "execution_count": info.execution_count})
    out.append({"type": "end_of_execution"})
    return out


async def stream_call(
    read: Callable[..., Any],
    owner: Owner,
    execution_id: str,
    first: list[dict[str, Any]],
    on_input: Callable[[], Any],
    on_abandoned: Callable[[], None],
    wait: float = KEEPALIVE_SECONDS,
) -> AsyncIterator[bytes]:
    """The NDJSON of call `execution_id`, read with `read` (ExecutionAccess.read_output) as it
    comes, after the `first` items. `on_input` is awaited when the code asks for input (E2B's
    kernels have no stdin); `on_abandoned` is called when the stream ends before the call
    did (the client went away). `wait`: the longest silence before a keepalive."""
    done = False
    try:
        for item in first:
            yield line(item)
        after, raised, asked = 0, False, False
        while True:
            page = await read_page(read, owner, execution_id, after, wait)
            for event in page.events:
                if event.type is EventType.INPUT_REQUEST and not asked:
                    asked = True
                    await on_input()
                for item in event_lines(event):
                    raised = raised or item["type"] == "error"
                    yield line(item)
            after = max(after, page.next_cursor)
            if page.has_more:
                continue
            if page.info.status.finished:
                if asked and not raised:
                    raised = True
                    yield line(input_error())
                for item in end_lines(page.info, raised):
                    yield line(item)
                done = True
                return
            if not page.events:
                yield line({"type": "keepalive"})
    finally:
        if not done:
            on_abandoned()


def input_error() -> dict[str, Any]:
    return {
        "type": "error",
        "name": "StdinNotImplementedError",
        "value": "input() is not supported by the code interpreter: pass data in the code "
        "or in a file instead",
        "traceback": "",
    }
