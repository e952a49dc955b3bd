"""Code mode's stubs: a file per tool of a hosted server (its signature, argument types and
description) and an index, written into a bridge's directory so code and agents read only the
tools they need (/run/srt-bridge/servers/NAME/TOOL.py). Written by a few threads of their
own (STUB_WRITERS), never on the event loop, within a budget per bridge (files, bytes)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

MAX_STUB_FILES = 2000  # stub files per bridge (every server's, with their indexes)
MAX_STUB_BYTES = 16 << 20  # bytes of stubs written per bridge, rewrites included
# The threads that write bridges' files: a few, so bridges opening at once queue here
# instead of taking every thread of the loop's default executor.
STUB_WRITERS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="bridge-stubs")


@dataclass
class StubBudget:
    """What one bridge may still write (files, bytes), and whether it closed (a write then
    stops at its next file). Used by one job at a time (`serially`)."""

    files: int = MAX_STUB_FILES
    bytes: int = MAX_STUB_BYTES
    stopped: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def serially(self, work: Callable[[], None]) -> None:
        with self._lock:
            if not self.stopped.is_set():
                work()

    def write(self, path: Path, text: str, index: bool = False) -> bool:
        """Write `text` to `path` if the budget allows it (False: it did not). A server's
        index counts in bytes only (one a server: it says what was left out)."""
        data = text.encode(errors="replace")  # (a lone surrogate from a hostile server)
        new = not index and not path.exists()
        if self.stopped.is_set() or len(data) > self.bytes or (new and self.files <= 0):
            return False
        path.write_bytes(data)
        self.files -= new
        self.bytes -= len(data)
        return True


def write_stubs(
    directory: Path,
    server: str,
    tools: list[dict[str, Any]],
    seen: dict[str, str],
    budget: StubBudget,
) -> None:
    """A file per tool (its signature, argument types and description) and an index, so code
    and agents read only the tools they need: /run/srt-bridge/servers/NAME/TOOL.py. Blocking
    (a stub writer runs it); past the bridge's budget, the rest are left out and the index
    says so."""
    try:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        index = [f'"""Tools of {server} (from mcp_servers import {server})."""']
        left_out = 0
        for tool in tools[:500]:
            name = str(tool.get("name", ""))
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                continue
            try:
                text = stub(server, tool, seen.get(name))
            except Exception as exc:  # (a hostile tool's schema: that stub is left out)
                logger.debug("stub {}.{} not written: {}", server, name, exc)
                continue
            if not budget.write(directory / f"{name}.py", text):
                left_out += 1
                continue
            summary = str(tool.get("description") or "").strip().splitlines()
            index.append(f"# {name}: {summary[0][:120] if summary else ''}")
        if left_out:
            index.append(f"# ({left_out} more not written: this execution's stub limits)")
        if len(tools) > 1 or not (directory / "__index__.py").exists():
            budget.write(directory / "__index__.py", "\n".join(index) + "\n", index=True)
    except OSError as exc:  # (stubs are a convenience: the calls work without them)
        logger.debug("stubs of {} not written: {}", server, exc)


JSON_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
              "array": "list", "object": "dict", "null": "None"}  # fmt: skip


def stub(server: str, tool: dict[str, Any], seen: str | None = None) -> str:
    """One tool as Python: `def NAME(*, arg: type = None) -> returns` and its description."""
    raw = tool.get("inputSchema")
    schema: dict[str, Any] = raw if isinstance(raw, dict) else {}
    raw = schema.get("properties")
    properties: dict[str, Any] = raw if isinstance(raw, dict) else {}
    listed = schema.get("required")
    required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
    params = []
    for arg, spec in list(properties.items())[:100]:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", str(arg)):
            continue
        kind = spec.get("type") if isinstance(spec, dict) else None
        hint = JSON_TYPES.get(kind, "object") if isinstance(kind, str) else "object"
        params.append(f"{arg}: {hint}" + ("" if arg in required else " = None"))
    output = tool.get("outputSchema")
    returns, _, note = (
        "dict" if isinstance(output, dict) else seen or "object|not seen yet"
    ).partition("|")
    name = re.sub(r"\W", "_", str(tool.get("name")))
    quote = '"' * 3
    description = str(tool.get("description") or "").replace(quote, "'''")[:4000]
    signature = f"*, {', '.join(params)}" if params else ""
    lines = [
        f"# from mcp_servers import {server}; {server}.{name}(...)  (returns the result; "
        f"concurrently: await {server}.{name}.aio(...))",
        f"def {name}({signature}) -> {returns}:" + (f"  # returns: {note}" if note else ""),
        f"    {quote}{description}{quote}",
    ]
    if isinstance(output, dict):
        lines.append(f"# output schema: {json.dumps(output)[:2000]}")
    return "\n".join(lines) + "\n"
