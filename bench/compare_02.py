"""Compare the execution tools on the wire: our server against srt-mcp-server 0.2.

A developer's script, not a test. It runs one scenario (the seven execution tools, the
resume-by-event-id calls, unknown ids, bad arguments, a wrong token) against two servers with
the mcp 1.x client in the legacy era (2025-11-25), as 0.2's users call it, and prints, step
by step, what differs:

- content blocks: how many, of which type, whether each text block parses as JSON;
- isError;
- the JSON of the text blocks and the structuredContent, as paths (`text.output[].event_id`)
  present on one side only (the top of such a subtree; `x[]` only on one side: the list is
  empty on the other) or with different JSON types on each side; `event.*` is every output
  event whatever its list is called, `listed.*` every execution list_executions lists;
- a few values that must agree (status, exit_code, success, was_running, event types, the
  data printed...); ids, timestamps and durations are never compared;
- errors: each side's text (first line), and whether it is JSON, one line, free of pydantic's
  URL;
- tools/list: each execution tool's input schema (properties, types, required, root
  additionalProperties, $ref/$defs) and whether it declares an outputSchema;
- HTTP 401 for a wrong token and for none: status, body and WWW-Authenticate.

Two ways to run it:

    python bench/compare_02.py --ours URL --ref URL --token T [--ours-token T] [--ref-token T]

against two servers already running (URL ends in /mcp), or

    python bench/compare_02.py --start [--ref-install SPEC] [--ours-python PY]

which makes a venv with the reference (default `sandbox-runtime[server]==0.2.0` from PyPI, with
mcp<2; pass a directory such as an export of the 0.2 repository's HEAD, `DIR[server]`, for the
version with `last_event_id`), starts it and our server (`PY -m sandbox_runtime.cli`, default
.venv/bin/python, state in a temporary dir) on free ports, compares, and stops both. The
reference sandboxes with bubblewrap and also needs `rg` (ripgrep) and `socat` on the host.

The client must be mcp 1.x. Run under any other Python, the script re-runs itself with the
first of --client-python, $SRT_CLIENTS_PY, .clients/py/bin/python and the reference venv's
python that has mcp 1.x. `--json FILE` also writes every call's raw result from both sides.
Exit status: 0 when the comparison ran (differences or not), 2 when it could not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REF_VENV = Path(tempfile.gettempdir()) / "srt-compat-02" / "ref"
DEFAULT_REF_INSTALL = "sandbox-runtime[server]==0.2.0"
MADE_UP_EVENT_ID = "00000000-0000-0000-0000-000000000000"
EXECUTION_TOOLS = (
    "execute_code",
    "execute_code_async",
    "get_execution_output",
    "get_execution_status",
    "send_stdin",
    "cancel_execution",
    "list_executions",
)
# Keys whose values are compared (where both sides have them); all others by JSON type only.
VALUE_KEYS = {
    "status",
    "exit_code",
    "success",
    "was_running",
    "type",
    "data",
    "code",
    "interactive",
    "command",
}
# Steps whose event lists depend on timing (a poll while the program prints).
TIMING = {"get_execution_output/running", "get_execution_output/resume-after-2nd"}
SLOW_PRINTER = (
    "python3 -u -c \"import time\nfor i in range(7): print('Event', i, flush=True); "
    'time.sleep(0.3)"'
)


# -- which python runs the client --------------------------------------------------------------


def mcp_major(python: str | None = None) -> int | None:
    """The major version of mcp importable by `python` (None: this process) or None."""
    if python is None:
        try:
            return int(metadata.version("mcp").split(".")[0])
        except metadata.PackageNotFoundError:
            return None
    probe = "import importlib.metadata as m; print(m.version('mcp'))"
    try:
        out = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out.stdout.strip().split(".")[0])


def client_python(args: argparse.Namespace) -> str | None:
    """A python with mcp 1.x, first of the candidates the docstring lists."""
    candidates = [
        args.client_python,
        os.environ.get("SRT_CLIENTS_PY"),
        str(ROOT / ".clients" / "py" / "bin" / "python"),
        str(Path(args.ref_venv) / "bin" / "python"),
    ]
    for python in candidates:
        if python and Path(python).exists() and mcp_major(python) == 1:
            return python
    return None


def ensure_ref_venv(venv: Path, spec: str) -> Path:
    """The reference's venv (made with pip when its srt-mcp-server is missing)."""
    server = venv / "bin" / "srt-mcp-server"
    if server.exists():
        return venv
    print(f"installing the reference into {venv}: {spec} (mcp<2)", file=sys.stderr)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", spec, "mcp<2", "httpx"], check=True)
    return venv


# -- servers started here (--start) ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.2)
    raise SystemExit(f"{base} did not answer /health in {timeout:g}s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def started_servers(args: argparse.Namespace, token: str) -> Iterator[tuple[str, str]]:
    """Start the reference and ours; yields their /mcp URLs; stops both (by their pids)."""
    for tool in ("bwrap", "rg", "socat"):
        if shutil.which(tool) is None:
            raise SystemExit(f"the reference server needs {tool} on PATH")
    ref_venv = ensure_ref_venv(Path(args.ref_venv), args.ref_install)
    work = Path(tempfile.mkdtemp(prefix="srt-compare-02-"))
    os.chmod(work, 0o711)  # the sandbox uid traverses to our state dir
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ref_port, ours_port = free_port(), free_port()
        ref_log, ours_log = work / "ref.log", work / "ours.log"
        ref_env = {
            **os.environ,
            "SANDBOX_AUTH_TOKEN": token,
            "SANDBOX_PORT": str(ref_port),
            "SANDBOX_LOG_FILE": str(work / "ref-loguru.log"),
        }
        with open(ref_log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    [str(ref_venv / "bin" / "srt-mcp-server")],
                    env=ref_env,
                    cwd=work,
                    stdout=out,
                    stderr=out,
                    stdin=subprocess.DEVNULL,
                )
            )
        state = work / "state"
        state.mkdir(mode=0o711)
        os.chmod(state, 0o711)
        ours_env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
        ours_env.pop("REDIS_URL", None)
        ours_env.update(
            SANDBOX_AUTH_TOKEN=token,
            SANDBOX_HOST="127.0.0.1",
            SANDBOX_PORT=str(ours_port),
            SANDBOX_STATE_DIR=str(state),
            SANDBOX_WORKSPACE_MB="64",
        )
        if (ROOT / ".runtime").is_dir():
            ours_env.setdefault("SANDBOX_RUNTIME_DIR", str(ROOT / ".runtime"))
        with open(ours_log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    [args.ours_python, "-m", "sandbox_runtime.cli"],
                    env=ours_env,
                    cwd=work,
                    stdout=out,
                    stderr=out,
                    stdin=subprocess.DEVNULL,
                )
            )
        wait_healthy(f"http://127.0.0.1:{ref_port}", procs[0], ref_log, 30)
        wait_healthy(f"http://127.0.0.1:{ours_port}", procs[1], ours_log, 60)
        yield f"http://127.0.0.1:{ours_port}/mcp", f"http://127.0.0.1:{ref_port}/mcp"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}", file=sys.stderr)


# -- the scenario (mcp 1.x client) ------------------------------------------------------------


def record_of(label: str, result: Any = None, client_error: str | None = None) -> dict[str, Any]:
    """One call's result as plain JSON: blocks (each text block parsed if it is JSON),
    isError, structuredContent, or the client's own exception."""
    if result is None:
        return {"label": label, "client_error": client_error}
    blocks = []
    for block in result.content:
        entry: dict[str, Any] = {"type": block.type}
        if block.type == "text":
            entry["text"] = block.text
            try:
                entry["json"] = json.loads(block.text)
                entry["is_json"] = True
            except ValueError:
                entry["is_json"] = False
        blocks.append(entry)
    return {
        "label": label,
        "is_error": bool(result.isError),
        "blocks": blocks,
        "structured": result.structuredContent,
        "client_error": client_error,
    }


def first_json(record: dict[str, Any]) -> dict[str, Any]:
    """The first text block's JSON object ({} when there is none)."""
    for block in record.get("blocks") or []:
        if isinstance(block.get("json"), dict):
            return dict(block["json"])
    if isinstance(record.get("structured"), dict):
        return dict(record["structured"])
    return {}


def events_in(data: dict[str, Any]) -> list[dict[str, Any]]:
    events = data.get("output")
    if not isinstance(events, list):
        events = data.get("events")  # (our server's name for it before the 0.2 contract)
    return [e for e in events or [] if isinstance(e, dict)]


class Caller:
    def __init__(self, session: Any) -> None:
        self.session = session
        self.records: list[dict[str, Any]] = []

    async def call(self, label: str, tool: str, **arguments: Any) -> dict[str, Any]:
        started = time.monotonic()
        try:
            result = await self.session.call_tool(tool, arguments)
        except Exception as exc:  # the 1.x client's own checks (output schema) raise
            record = record_of(label, client_error=f"{type(exc).__name__}: {exc}")
        else:
            record = record_of(label, result)
        record["elapsed"] = round(time.monotonic() - started, 2)
        self.records.append(record)
        return record

    async def poll(self, label: str, execution_id: Any, events: int) -> list[dict[str, Any]]:
        """get_execution_output (no wait) until it shows `events` events (10 s at most: a
        sandbox's start may take a while); only the last call is kept as the step."""
        deadline = time.monotonic() + 10
        while True:
            record = await self.call(
                label, "get_execution_output", execution_id=execution_id, wait=False
            )
            seen = events_in(first_json(record))
            if len(seen) >= events or time.monotonic() > deadline:
                return seen
            self.records.remove(record)
            await asyncio.sleep(0.2)


async def run_scenario(url: str, token: str) -> dict[str, Any]:
    """Every step against one server; returns {"init", "tools", "steps", "http"}."""
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    out: dict[str, Any] = {}
    async with (
        httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120) as http,
        streamable_http_client(url, http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        init = await session.initialize()
        out["init"] = {
            "protocolVersion": init.protocolVersion,
            "serverInfo": init.serverInfo.model_dump(exclude_none=True),
            "capabilities": sorted(init.capabilities.model_dump(exclude_none=True)),
        }
        listed = await session.list_tools()
        out["tools"] = {
            t.name: t.model_dump(by_alias=True, exclude_none=True, mode="json")
            for t in listed.tools
        }
        c = Caller(session)
        await scenario(c)
        out["steps"] = c.records
    out["http"] = await unauthorized(url)
    return out


async def scenario(c: Caller) -> None:
    await c.call("list_executions/none", "list_executions")
    done = first_json(
        await c.call(
            "execute_code/wait",
            "execute_code",
            command="echo hello; echo err >&2; exit 3",
            timeout_seconds=10,
        )
    )
    done_id = done.get("execution_id")
    done_events = events_in(done)
    await c.call("list_executions/one", "list_executions")
    await c.call(
        "execute_code/no-wait",
        "execute_code",
        command="sleep 0.2; echo later",
        wait_for_completion=False,
    )
    slow_id = first_json(
        await c.call("execute_code_async", "execute_code_async", command=SLOW_PRINTER)
    ).get("execution_id")
    await asyncio.sleep(1.0)
    polled = await c.poll("get_execution_output/running", slow_id, 2)
    await c.call("get_execution_status/running", "get_execution_status", execution_id=slow_id)
    if len(polled) >= 2:
        await asyncio.sleep(1.0)
        await c.call(
            "get_execution_output/resume-after-2nd",
            "get_execution_output",
            execution_id=slow_id,
            last_event_id=polled[1].get("event_id"),
        )
    await c.call(
        "get_execution_output/wait", "get_execution_output", execution_id=slow_id, wait=True
    )
    await c.call("get_execution_status/completed", "get_execution_status", execution_id=slow_id)
    if done_events:
        await c.call(
            "get_execution_output/resume-at-last",
            "get_execution_output",
            execution_id=done_id,
            last_event_id=done_events[-1].get("event_id"),
        )
    await c.call(
        "get_execution_output/resume-unknown-event",
        "get_execution_output",
        execution_id=done_id,
        last_event_id=MADE_UP_EVENT_ID,
    )
    await c.call(
        "get_execution_output/finished", "get_execution_output", execution_id=done_id, wait=False
    )

    reader_id = first_json(
        await c.call(
            "execute_code_async/interactive",
            "execute_code_async",
            command="read x; echo got $x",
            interactive=True,
        )
    ).get("execution_id")
    await c.poll("get_execution_output/interactive-started", reader_id, 1)
    await c.call("send_stdin/running", "send_stdin", execution_id=reader_id, input_data="abc")
    await c.call(
        "get_execution_output/interactive-wait",
        "get_execution_output",
        execution_id=reader_id,
        wait=True,
    )
    await c.call("send_stdin/finished", "send_stdin", execution_id=reader_id, input_data="x")
    await c.call("send_stdin/not-interactive", "send_stdin", execution_id=done_id, input_data="x")

    sleeper_id = first_json(
        await c.call("execute_code_async/sleep", "execute_code_async", command="sleep 30")
    ).get("execution_id")
    await c.poll("get_execution_output/sleep-started", sleeper_id, 1)
    await c.call("cancel_execution/running", "cancel_execution", execution_id=sleeper_id)
    await asyncio.sleep(0.5)
    await c.call("cancel_execution/finished", "cancel_execution", execution_id=sleeper_id)
    await c.call("get_execution_status/cancelled", "get_execution_status", execution_id=sleeper_id)
    await c.call("get_execution_output/cancelled", "get_execution_output", execution_id=sleeper_id)
    await c.call("list_executions/several", "list_executions")

    unknown = "no-such-execution"
    await c.call("get_execution_output/unknown-id", "get_execution_output", execution_id=unknown)
    await c.call("get_execution_status/unknown-id", "get_execution_status", execution_id=unknown)
    await c.call("send_stdin/unknown-id", "send_stdin", execution_id=unknown, input_data="x")
    await c.call("cancel_execution/unknown-id", "cancel_execution", execution_id=unknown)

    await c.call("bad/timeout-not-a-number", "execute_code", command="echo", timeout_seconds="x")
    await c.call("bad/command-int", "execute_code", command=5)
    await c.call("bad/command-missing", "execute_code")
    await c.call("bad/extra-argument", "execute_code", command="echo extra", bogus=1)
    await c.call("bad/wait-not-a-bool", "get_execution_output", execution_id=done_id, wait="maybe")
    await c.call("bad/negative-limit", "get_execution_output", execution_id=done_id, limit=-1)
    await c.call("bad/huge-execution-id", "get_execution_status", execution_id="x" * 100_000)
    await c.call("bad/unknown-tool", "no_such_tool")
    await c.call(
        "coerce/timeout-numeric-string", "execute_code", command="echo c", timeout_seconds="5"
    )
    await c.call("list_executions/after-errors", "list_executions")


async def unauthorized(url: str) -> dict[str, Any]:
    import httpx

    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    base = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    out = {}
    async with httpx.AsyncClient(timeout=30) as http:
        for label, extra in (
            ("wrong-token", {"Authorization": "Bearer not-the-token"}),
            ("no-header", {}),
        ):
            resp = await http.post(url, json=body, headers={**base, **extra})
            out[label] = {
                "status": resp.status_code,
                "content_type": resp.headers.get("content-type"),
                "www_authenticate": resp.headers.get("www-authenticate"),
                "body": resp.text,
            }
    return out


# -- comparing ----------------------------------------------------------------------------------


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "array"
    return "object"


def flatten(
    value: Any, path: str, types: dict[str, set[str]], values: dict[str, list[Any]]
) -> None:
    """Every path in `value` (list items as `[]`) with the JSON types seen there; the values of
    VALUE_KEYS leaves in order."""
    types.setdefault(path, set()).add(type_name(value))
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(item, f"{path}.{key}", types, values)
    elif isinstance(value, list):
        for item in value:
            flatten(item, f"{path}[]", types, values)
    elif path.rsplit(".", 1)[-1] in VALUE_KEYS:
        values.setdefault(path, []).append(value)


def block_summary(record: dict[str, Any]) -> str:
    if record.get("client_error"):
        return f"client raised {record['client_error'][:160]}"
    parts = []
    for block in record.get("blocks") or []:
        if block["type"] != "text":
            parts.append(block["type"])
        elif block.get("is_json"):
            parts.append(f"text(JSON {type_name(block['json'])})")
        else:
            parts.append("text(not JSON)")
    counted: dict[str, int] = {}
    for part in parts:
        counted[part] = counted.get(part, 0) + 1
    shown = ", ".join(f"{n}x {p}" if n > 1 else p for p, n in counted.items())
    return f"{len(parts)} block(s): {shown or '-'}"


def error_text(record: dict[str, Any]) -> str | None:
    """The error a result carries: a tool error's text, or a JSON body's `error`."""
    if record.get("client_error"):
        return None
    texts = [b.get("text", "") for b in record.get("blocks") or []]
    data = first_json(record)
    if record.get("is_error"):
        if isinstance(data.get("error"), str):  # a JSON error body: its error
            return f"{data['error']}  <JSON body with {sorted(data)}>"
        return "\n".join(texts)
    if isinstance(data.get("error"), str):
        return str(data["error"])
    return None


def describe_error(text: str) -> str:
    first = text.splitlines()[0] if text else ""
    notes = []
    if "\n" in text.strip():
        notes.append(f"{len(text.splitlines())} lines")
    if "errors.pydantic.dev" in text:
        notes.append("pydantic URL")
    try:
        json.loads(text)
        notes.append("JSON")
    except ValueError:
        pass
    suffix = f"  [{', '.join(notes)}]" if notes else ""
    return f"{first[:150]!r}{suffix}"


def compare_step(ref: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The differences of one step, each line marked: "!" what a 0.2 client could notice
    (blocks, isError, a field missing or of another type, a value), "+" fields only ours
    sends (listed on one line per source), " " errors' texts side by side."""
    lines: list[str] = []
    ref_blocks, our_blocks = block_summary(ref), block_summary(ours)
    if ref_blocks != our_blocks:
        lines.append(f"! blocks      ref: {ref_blocks}\n{'':16}ours: {our_blocks}")
    if ref.get("is_error") != ours.get("is_error"):
        lines.append(f"! isError     ref: {ref.get('is_error')}  ours: {ours.get('is_error')}")
    ref_sc, our_sc = ref.get("structured"), ours.get("structured")
    if (ref_sc is None) != (our_sc is None):
        lines.append(
            f"{'+' if ref_sc is None else '!'} structuredContent  ref: "
            f"{'present' if ref_sc is not None else 'absent'}"
            f"  ours: {'present' if our_sc is not None else 'absent'}"
        )
    for source in ("text", "event", "listed", "structured"):
        ref_types: dict[str, set[str]] = {}
        our_types: dict[str, set[str]] = {}
        ref_values: dict[str, list[Any]] = {}
        our_values: dict[str, list[Any]] = {}
        for rec, types, values in ((ref, ref_types, ref_values), (ours, our_types, our_values)):
            for value in parts_of(rec, source):
                flatten(value, source, types, values)
        if not ref_types and not our_types:
            continue
        if source == "structured" and (not ref_types or not our_types):
            continue  # said above
        added = []
        for path in sorted(set(ref_types) | set(our_types)):
            r, o = ref_types.get(path), our_types.get(path)
            up = parent(path)
            if r is None:
                if up in ref_types:  # (the top of a subtree only ours has)
                    added.append(path[len(source) :].lstrip("."))
            elif o is None:
                if up in our_types:
                    lines.append(f"! {path:40} missing in ours (ref: {'|'.join(sorted(r))})")
            elif r != o:
                both = f"ref {'|'.join(sorted(r))} / ours {'|'.join(sorted(o))}"
                lines.append(f"! {path:40} type {both}")
        if added:
            lines.append(f"+ {source} only in ours: {', '.join(added)}")
        if source == "event":
            ref_values, our_values = event_summary(ref), event_summary(ours)
        if source == "text":  # (list items are compared as events and listed executions)
            ref_values = {k: v for k, v in ref_values.items() if "[]" not in k}
            our_values = {k: v for k, v in our_values.items() if "[]" not in k}
        if source == "listed" or ref["label"].startswith("list_executions"):
            # (0.2 lists in no particular order)
            ref_values = {k: sorted(v, key=json.dumps) for k, v in ref_values.items()}
            our_values = {k: sorted(v, key=json.dumps) for k, v in our_values.items()}
        if source in ("text", "event", "listed") and ref["label"] not in TIMING:
            for path in sorted(set(ref_values) & set(our_values)):
                if ref_values[path] != our_values[path]:
                    lines.append(
                        f"! {path:40} values ref {short(ref_values[path])} / ours "
                        f"{short(our_values[path])}"
                    )
    ref_err, our_err = error_text(ref), error_text(ours)
    if ref_err is not None or our_err is not None:
        lines.append(f"  error       ref: {describe_error(ref_err) if ref_err else '-'}")
        lines.append(f"{'':14}ours: {describe_error(our_err) if our_err else '-'}")
    if ours.get("client_error") or ref.get("client_error"):
        lines.append(
            f"! client raised  ref: {ref.get('client_error')}  ours: {ours.get('client_error')}"
        )
    return lines


def event_summary(record: dict[str, Any]) -> dict[str, list[Any]]:
    """What a result's events say, however the output was cut into events: the event types
    (runs of one type as one), the stdout and stderr text, the exit code."""
    events = parts_of(record, "event")
    if not events:
        return {}
    types: list[Any] = []
    for event in events:
        if not types or types[-1] != event.get("type"):
            types.append(event.get("type"))
    summary: dict[str, list[Any]] = {"event.types": types}
    for stream in ("stdout", "stderr"):
        text = "".join(str(e.get("data", "")) for e in events if e.get("type") == stream)
        summary[f"event.{stream}"] = [text]
    exits = [e.get("code") for e in events if e.get("type") == "exit"]
    if exits:
        summary["event.exit.code"] = exits
    return summary


def parent(path: str) -> str:
    return path[:-2] if path.endswith("[]") else path.rsplit(".", 1)[0]


def parts_of(record: dict[str, Any], source: str) -> list[Any]:
    """What is compared under `source`: "text" every text block's JSON; "event" every output
    event (whatever the list is called); "listed" each execution a list_executions result
    lists (a block of its own in 0.2, items of a list in a block otherwise); "structured" the
    structuredContent."""
    texts = [b["json"] for b in record.get("blocks") or [] if b.get("is_json")]
    if source == "text":
        return texts
    if source == "event":
        return [e for t in texts if isinstance(t, dict) for e in events_in(t)]
    if source == "listed":
        if not record["label"].startswith("list_executions"):
            return []
        items: list[Any] = []
        for t in texts:
            if isinstance(t, list):
                items.extend(t)
            elif isinstance(t, dict) and isinstance(t.get("executions"), list):
                items.extend(t["executions"])
            elif isinstance(t, dict) and isinstance(t.get("result"), list):
                items.extend(t["result"])
            else:
                items.append(t)
        return items
    structured = record.get("structured")
    return [] if structured is None else [structured]


def short(values: list[Any]) -> str:
    text = json.dumps(values)
    return text if len(text) <= 90 else text[:87] + "..."


def schema_types(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return "|".join(schema_types(p) for p in prop["anyOf"])
    if "$ref" in prop:
        return f"$ref:{prop['$ref']}"
    kind = prop.get("type", "?")
    if kind == "array" and isinstance(prop.get("items"), dict):
        return f"array<{schema_types(prop['items'])}>"
    return "|".join(kind) if isinstance(kind, list) else str(kind)


def compare_tools(ref: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    lines = []
    for name in EXECUTION_TOOLS:
        r, o = ref.get(name), ours.get(name)
        if r is None or o is None:
            lines.append(f"{name}: listed by {'ref' if r else 'ours' if o else 'neither'} only")
            continue
        ri, oi = r.get("inputSchema", {}), o.get("inputSchema", {})
        rp, op = ri.get("properties", {}), oi.get("properties", {})
        for prop in sorted(set(rp) | set(op)):
            if prop not in op:
                lines.append(f"{name}.{prop}: only in ref ({schema_types(rp[prop])})")
            elif prop not in rp:
                lines.append(f"{name}.{prop}: only in ours ({schema_types(op[prop])})")
            else:
                rt, ot = schema_types(rp[prop]), schema_types(op[prop])
                if rt != ot:
                    lines.append(f"{name}.{prop}: type ref {rt} / ours {ot}")
                if rp[prop].get("default") != op[prop].get("default"):
                    lines.append(
                        f"{name}.{prop}: default ref {rp[prop].get('default')!r}"
                        f" / ours {op[prop].get('default')!r}"
                    )
        if sorted(ri.get("required", [])) != sorted(oi.get("required", [])):
            lines.append(
                f"{name}: required ref {ri.get('required', [])} / ours {oi.get('required', [])}"
            )
        for key in ("additionalProperties", "$defs"):
            if (key in ri) != (key in oi) or ri.get(key) != oi.get(key):
                lines.append(f"{name}: root {key} ref {ri.get(key)!r} / ours {oi.get(key)!r}")
        if "$ref" in json.dumps(oi) and "$ref" not in json.dumps(ri):
            lines.append(f"{name}: ours' inputSchema uses $ref")
        ro, oo = r.get("outputSchema"), o.get("outputSchema")
        if (ro is None) != (oo is None):
            lines.append(
                f"{name}: outputSchema ref {'yes' if ro else 'no'} / ours {'yes' if oo else 'no'}"
            )
        elif ro and oo and sorted(ro.get("properties", {})) != sorted(oo.get("properties", {})):
            lines.append(
                f"{name}: outputSchema properties ref {sorted(ro.get('properties', {}))}"
                f" / ours {sorted(oo.get('properties', {}))}"
            )
    extra = sorted(set(ours) - set(ref))
    if extra:
        lines.append(f"tools only in ours ({len(extra)}): {', '.join(extra)}")
    return lines


def compare_http(ref: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    lines = []
    for label in ref:
        r, o = ref[label], ours.get(label, {})
        for key in ("status", "content_type", "www_authenticate", "body"):
            if r.get(key) != o.get(key):
                lines.append(f"{label}.{key}:\n    ref:  {r.get(key)!r}\n    ours: {o.get(key)!r}")
    return lines


def report(ref: dict[str, Any], ours: dict[str, Any]) -> int:
    print("== initialize")
    for key in ("protocolVersion", "serverInfo", "capabilities"):
        print(f"   {key}: ref {ref['init'][key]}  ours {ours['init'][key]}")
    print("\n== tools/list (execution tools)")
    for line in compare_tools(ref["tools"], ours["tools"]) or ["same"]:
        print(f"   {line}")
    ref_steps = {s["label"]: s for s in ref["steps"]}
    our_steps = {s["label"]: s for s in ours["steps"]}
    differing = 0
    for label in list(ref_steps) + [k for k in our_steps if k not in ref_steps]:
        took = ""
        if label in ref_steps and label in our_steps:
            ref_s, our_s = ref_steps[label].get("elapsed", 0), our_steps[label].get("elapsed", 0)
            if max(ref_s, our_s) >= 0.5:
                took = f"  (took ref {ref_s:g} s, ours {our_s:g} s)"
        print(f"\n== {label}{'  (timing-dependent)' if label in TIMING else ''}{took}")
        if label not in ref_steps or label not in our_steps:
            print(f"   only run against {'ref' if label in ref_steps else 'ours'}")
            differing += 1
            continue
        lines = compare_step(ref_steps[label], our_steps[label])
        differing += any(line.startswith("!") for line in lines)
        for line in lines or ["same"]:
            print(f"   {line}")
    print("\n== HTTP 401")
    for line in compare_http(ref["http"], ours["http"]) or ["same"]:
        print(f"   {line}")
    print(
        f"\n{differing} of {len(ref_steps)} steps have a '!' difference (blocks, isError, a"
        " field missing in ours or of another type, a value); '+' lines are only additions"
    )
    return differing


# -- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ours", help="our server's /mcp URL")
    parser.add_argument("--ref", help="the 0.2 server's /mcp URL")
    parser.add_argument("--token", default="compare-02-token-0123456789")
    parser.add_argument("--ours-token", help="(default: --token)")
    parser.add_argument("--ref-token", help="(default: --token)")
    parser.add_argument("--start", action="store_true", help="install/start both servers here")
    parser.add_argument("--ref-install", default=DEFAULT_REF_INSTALL, help="pip spec (--start)")
    parser.add_argument("--ref-venv", default=str(DEFAULT_REF_VENV), help="(--start)")
    parser.add_argument("--ours-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--client-python", help="a python with mcp 1.x for the client")
    parser.add_argument("--json", help="write both sides' raw records to this file")
    parser.add_argument("--keep", action="store_true", help="keep --start's logs and state")
    args = parser.parse_args()
    if not args.start and not (args.ours and args.ref):
        parser.error("give --ours URL and --ref URL, or --start")
    return args


def main() -> int:
    args = parse_args()
    if mcp_major() != 1:
        if args.start:
            ensure_ref_venv(Path(args.ref_venv), args.ref_install)
        python = client_python(args)
        if python is None:
            print(
                "no python with mcp 1.x: pass --client-python, set SRT_CLIENTS_PY, or use --start",
                file=sys.stderr,
            )
            return 2
        os.execv(python, [python, str(Path(__file__).resolve()), *sys.argv[1:]])
    if args.start:
        with started_servers(args, args.token) as (ours_url, ref_url):
            return compare(args, ours_url, ref_url)
    return compare(args, args.ours, args.ref)


def compare(args: argparse.Namespace, ours_url: str, ref_url: str) -> int:
    ref = asyncio.run(run_scenario(ref_url, args.ref_token or args.token))
    ours = asyncio.run(run_scenario(ours_url, args.ours_token or args.token))
    if args.json:
        Path(args.json).write_text(json.dumps({"ref": ref, "ours": ours}, indent=1, default=str))
    report(ref, ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
