"""What a call's kernel says, as its execution's events; and the caller's environment, as code.

Everything a kernel sends comes from code the server does not trust: every text and MIME bundle
kept is bounded here before it becomes an event. Pure: no kernel, no process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from sandbox_runtime.domain.models import EventType
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.interpreters.kernel_wire import MESSAGE_MAX_BYTES
from sandbox_runtime.interpreters.runtime import KernelSpec

# One MIME value kept in an execution's events. A reply carries it about twice, and the
# official MCP client refuses a message over 1 MiB: a plot is tens of KB.
MAX_BUNDLE_BYTES = 256 * 1024
MAX_BUNDLE_ENTRIES = 32  # MIME types of one result
MAX_TEXT_CHARS = 8192  # an exception's name, value and each traceback line; a prompt
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class CallOutput:
    """A call's kernel messages (the `on_message` of SandboxedKernel.execute) recorded as its
    execution's events. `failed`: the code raised (an error message came); `on_input` is told
    when the kernel asks for input."""

    def __init__(self, execution: Execution, on_input: Callable[[], None]) -> None:
        self.execution = execution
        self.on_input = on_input
        self.failed = False

    def __call__(self, kind: str, content: dict[str, Any]) -> None:
        # (Everything here comes from code the server does not trust: bounded, counted.)
        execution = self.execution
        if kind == "stream":
            stream = EventType.STDERR if content.get("name") == "stderr" else EventType.STDOUT
            execution.record_output(stream, str(content.get("text", "")))
        elif kind in ("display_data", "execute_result", "update_display_data"):
            data = content.get("data")
            bundle, size = bounded_bundle(data if isinstance(data, dict) else {})
            count = content.get("execution_count")
            execution.record_event(
                EventType.RESULT,
                size,
                bundle=bundle,
                execution_count=count if isinstance(count, int) else None,
            )
        elif kind == "error":
            trace = content.get("traceback")
            lines = trace[-100:] if isinstance(trace, list) else []
            error = {
                "name": bounded_text(content.get("ename")),
                "value": bounded_text(content.get("evalue")),
                "traceback": [ANSI.sub("", bounded_text(t)) for t in lines],
            }
            self.failed = True
            size = len(error["name"]) + len(error["value"]) + sum(map(len, error["traceback"]))
            execution.record_event(EventType.EXCEPTION, size, **error)
        elif kind == "input_request":
            self.on_input()
            prompt = bounded_text(content.get("prompt"))
            execution.record_event(
                EventType.INPUT_REQUEST,
                len(prompt),
                prompt=prompt,
                password=bool(content.get("password")),
            )
        elif kind == "dropped":
            execution.record_dropped(
                int(content["bytes"]),
                "the interpreter sent output faster than it could be taken, or a message "
                f"over {MESSAGE_MAX_BYTES} bytes: {content['bytes']} bytes of it dropped",
            )


def bounded_text(value: object) -> str:
    """A text of the kernel's, at most MAX_TEXT_CHARS characters (and a mark when cut)."""
    text = value if isinstance(value, str) else "" if value is None else str(value)
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + " [...]"


def bounded_bundle(data: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A result's MIME bundle within bounds (MAX_BUNDLE_ENTRIES types, each value at most
    MAX_BUNDLE_BYTES, types' names at most 255 characters), and about how many bytes it holds."""
    out: dict[str, Any] = {}
    size = 0
    for mime, value in list(data.items())[:MAX_BUNDLE_ENTRIES]:
        mime = str(mime)[:255]
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > MAX_BUNDLE_BYTES:
            note = f"[{mime} output of {len(text)} bytes dropped: over {MAX_BUNDLE_BYTES} bytes]"
            out["text/plain"] = note
            size += len(note)
            continue
        out[mime] = value
        size += len(mime) + len(text)
    if len(data) > MAX_BUNDLE_ENTRIES:
        out["text/plain"] = f"[{len(data) - MAX_BUNDLE_ENTRIES} more MIME types dropped]"
    return out, size + 64 * len(out)


def env_prelude(spec: KernelSpec, env: dict[str, str]) -> str:
    """Code that sets the caller's environment variables in the interpreter first."""
    if not env:
        return ""
    if spec.language == "python":
        return f"import os as _srt_os; _srt_os.environ.update({json.dumps(env)}); del _srt_os\n"
    if spec.language == "bash":
        return "".join(f"export {k}={shell_quote(v)}\n" for k, v in env.items())
    if spec.kernel == "deno":
        return "".join(f"Deno.env.set({json.dumps(k)}, {json.dumps(v)});\n" for k, v in env.items())
    raise InvalidRequestError(f"environment is not supported for {spec.language}")


def shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"
