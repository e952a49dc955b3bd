"""What the hosted-server tests share: a catalog written from a dict, and the text of results
and of the client's errors."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
from mcp.types import CallToolResult, TextContent
from mcp_harness import ServerProcess, free_port, stop_all, stop_if_running


def toml(catalog: dict[str, dict[str, Any]]) -> str:
    """A catalog file's text: [servers.NAME] tables of strings, numbers, lists and tables."""
    lines = []
    for name, table in catalog.items():
        lines.append(f"[servers.{name}]")
        for key, value in table.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{ {inner} }}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


SCRIPTS = Path(__file__).resolve().parent / "hosted_servers"


def script_entry(script: str, *args: str, **fields: Any) -> dict[str, Any]:
    """A catalog entry running one of tests/hosted_servers/ (bound at /opt/srt-server)."""
    return {
        "command": ["/usr/bin/python3", f"/opt/srt-server/{script}", *args],
        "directory": str(SCRIPTS),
        **fields,
    }


@contextlib.contextmanager
def remote_server(script: str, probe: str) -> Iterator[int]:
    """One of tests/hosted_servers/'s HTTP servers on a free port of its own (the port), once
    it answers GET `probe`; killed at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / script), str(port)])
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx2.get(f"http://127.0.0.1:{port}{probe}", timeout=1)
                break
            except httpx2.TransportError:
                assert time.monotonic() < deadline, f"{script} did not start"
                time.sleep(0.1)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def catalog_server(
    workdir: Path, catalog: dict[str, dict[str, Any]], tokens: str, **env: str
) -> Iterator[ServerProcess]:
    """A real server started with `catalog` as its hosted servers' catalog, `tokens` as its
    SANDBOX_AUTH_TOKENS, no warm interpreters and `env` besides; stopped at the end."""
    (workdir / "servers.toml").write_text(toml(catalog))
    settings = {
        "SANDBOX_AUTH_TOKENS": tokens,
        "SANDBOX_SERVERS_FILE": str(workdir / "servers.toml"),
        "SANDBOX_INTERPRETER_WARM": "",
        **env,
    }
    server = ServerProcess(workdir, settings)
    try:
        server.start()
        yield server
    finally:
        stop_all(stop_if_running(server))


def text_of(result: CallToolResult) -> str:
    return "".join(b.text for b in result.content if isinstance(b, TextContent))


def message_of(exc: BaseException) -> str:
    """The messages of an exception and of those grouped in it (the client's task groups)."""
    if isinstance(exc, BaseExceptionGroup):
        return " | ".join(message_of(e) for e in exc.exceptions)
    return str(exc)
