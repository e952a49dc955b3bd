"""Code mode: what a tool call from code costs, and how much context it saves.

- bridge: p50 of server-everything's `echo` called from code (timed inside the sandbox, 100
  calls in one execute_code) against the same call through /servers/everything/mcp with the
  official client, in the same run; and the wall time of those 100 sequential calls.
  Targets (2 cores): at most 2 ms added; 100 calls within 1 s.
- context: one workflow over the four registry servers (write a file, read it back, store
  its lines in memory, read the graph, a sum, the time) done tool by tool (the model reads
  every server's tools/list, then every request and result) against code mode (the code, the
  full schemas of the tools it uses from search_tools, and execute_code's result). Bytes of
  JSON either way.

    .venv/bin/python bench/code_mode.py [--state DIR]

It installs the servers as bench/hosted_servers.py does (same --state, kept between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hosted_servers import CLI, env_for, serving, token
from test_hosted_registry import WORKFLOW

PACKAGES = {
    "time": ("pypi:mcp-server-time==2026.10.19", []),
    "memory": (
        "npm:@modelcontextprotocol/server-memory@2026.8.31",
        ["--env=MEMORY_FILE_PATH=/workspace/memory.jsonl"],
    ),
    "everything": ("npm:@modelcontextprotocol/server-everything@2026.8.31", []),
    "files": ("npm:@modelcontextprotocol/server-filesystem@2026.8.31", ["/workspace"]),
}
LOOP = """
import json, time
from mcp_servers import everything
times = []
started = time.perf_counter()
for i in range(100):
    t = time.perf_counter()
    everything.echo(message=str(i))
    times.append(time.perf_counter() - t)
total = time.perf_counter() - started
print(json.dumps({"times": times, "total": total}))
"""


def install(state: Path) -> None:
    env = env_for(state, 0)
    for name, (package, args) in PACKAGES.items():
        subprocess.run(
            [*CLI, "servers", "add", name, package, "--replace", *args],
            env=env,
            check=True,
            capture_output=True,
        )
    out = subprocess.run([*CLI, "servers", "install"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"servers install failed:\n{out.stdout}{out.stderr}")


def client(url: str, tok: str) -> tuple[Any, Client]:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {tok}"})
    return http, Client(streamable_http_client(url, http_client=http), mode="legacy")


async def direct_echo(base: str, calls: int) -> list[float]:
    http, c = client(f"{base}/servers/everything/mcp", token(0))
    async with http, c:
        await c.call_tool("echo", {"message": "warm"})
        out = []
        for i in range(calls):
            started = time.perf_counter()
            await c.call_tool("echo", {"message": str(i)})
            out.append(time.perf_counter() - started)
        return out


async def execute(base: str, tok: str, code: str) -> dict[str, Any]:
    http, c = client(f"{base}/mcp", tok)
    async with http, c:
        result = await c.call_tool(
            "execute_code",
            {"command": ["python3", "-c", code], "servers": ["*"], "timeout_seconds": 120},
        )
        assert result.structured_content is not None, result
        return dict(result.structured_content)


def stdout(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


async def tool_by_tool(base: str, tok: str) -> int:
    """Bytes a model reads doing the workflow through the servers' endpoints, as JSON."""
    seen = 0
    stack = contextlib.AsyncExitStack()
    clients = {}
    for name in PACKAGES:
        http, c = client(f"{base}/servers/{name}/mcp", tok)
        await stack.enter_async_context(http)
        clients[name] = await stack.enter_async_context(c)
        listed = await clients[name].list_tools()
        tools = [t.model_dump(mode="json", exclude_none=True) for t in listed.tools]
        seen += len(json.dumps(tools))

    async def call(server: str, tool: str, args: dict[str, Any]) -> Any:
        nonlocal seen
        result = await clients[server].call_tool(tool, args)
        dumped = result.model_dump(mode="json", exclude_none=True)
        seen += len(json.dumps({"tool": tool, "arguments": args})) + len(json.dumps(dumped))
        return result

    try:
        await call("files", "write_file", {"path": "/workspace/t.txt", "content": "a\nb\nc\n"})
        text = await call("files", "read_text_file", {"path": "/workspace/t.txt"})
        items = [x for x in (text.structured_content or {}).get("content", "").split("\n") if x]
        entities = [{"name": i, "entityType": "todo", "observations": ["x"]} for i in items]
        await call("memory", "create_entities", {"entities": entities})
        await call("memory", "read_graph", {})
        await call("everything", "get-sum", {"a": 3, "b": 3})
        await call("time", "get_current_time", {"timezone": "UTC"})
    finally:
        await stack.aclose()
    return seen


async def code_mode(base: str, tok: str) -> tuple[int, dict[str, Any]]:
    """Bytes a model reads doing it in code: its code, the schemas of the six tools it uses
    (search_tools, full), and execute_code's whole result."""
    http, c = client(f"{base}/mcp", tok)
    async with http, c:
        discovery = 0
        for query, server in (
            ("write_file", "files"),
            ("read_text_file", "files"),
            ("create_entities", "memory"),
            ("read_graph", "memory"),
            ("get-sum", "everything"),
            ("get_current_time", "time"),
        ):
            found = await c.call_tool(
                "search_tools", {"query": query, "server": server, "detail": "full", "limit": 1}
            )
            discovery += len(json.dumps(found.structured_content))
    result = await execute(base, tok, WORKFLOW)
    return len(WORKFLOW) + discovery + len(json.dumps(result)), result


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, default=Path("/tmp/srt-bench-codemode"))
    opts = parser.parse_args()
    opts.state.mkdir(parents=True, exist_ok=True)
    install(opts.state)
    async with serving(opts.state) as base:
        await execute(base, token(0), LOOP)  # (the instance started, the pool warm)
        looped = json.loads(stdout(await execute(base, token(0), LOOP)))
        direct = await direct_echo(base, 100)
        by_tool = await tool_by_tool(base, token(1))
        in_code, result = await code_mode(base, token(2))
        assert result["exit_code"] == 0, result
        bridged = ms(looped["times"])
        total = looped["total"]
        print("\ncode mode: server-everything echo, 100 sequential calls (ms)\n")
        print(f"from code (bridge)      p50 {bridged:6.2f}   100 calls in {total:.2f} s")
        print(f"through /servers/NAME   p50 {ms(direct):6.2f}   100 calls in {sum(direct):.2f} s")
        print(
            f"added by the bridge     {bridged - ms(direct):+6.2f}   (target <= +2; 100 in <= 1 s)"
        )
        print("\ncontext for one workflow over four servers (bytes of JSON a model reads)\n")
        print(f"tool by tool (every server's tools/list, every call)  {by_tool:8d}")
        print(f"code mode (the code, 6 tools' schemas, its result)    {in_code:8d}")
        print(f"saved                                                 {1 - in_code / by_tool:8.0%}")


if __name__ == "__main__":
    asyncio.run(main())
