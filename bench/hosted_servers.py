"""Hosted MCP servers: cold start and warm `tools/call` through /servers/NAME/mcp, side by
side with the same server run directly over stdio by the official client, in the same run.

Per server (installed ahead with `srt-mcp-server servers install`, into --state, kept between
runs):

- cold: a new principal's first `tools/call` (its instance starts in a sandbox, initializes
  and answers); the client's connect and initialize come before and are not counted;
- warm: p50 and p90 of `tools/call` on a started instance, through our endpoint (legacy era:
  one HTTP request each) and directly over stdio (the same program, on the host, no sandbox);
- overhead: warm p50 through us minus direct.

Targets (2 cores): warm overhead <= 2 ms p50; cold <= 1 s for a Python server, <= 1.5 s for
a Node one.

    .venv/bin/python bench/hosted_servers.py [--calls 200] [--cold 5] [--state DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "sandbox_runtime.cli"]
SERVERS: dict[str, tuple[str, list[str], str, dict[str, Any], float]] = {
    # name: (package, args, tool, arguments, cold target in s)
    "time": ("pypi:mcp-server-time==2026.10.19", [], "get_current_time", {"timezone": "UTC"}, 1.0),
    "memory": (
        "npm:@modelcontextprotocol/server-memory@2026.8.31",
        ["--env=MEMORY_FILE_PATH=/workspace/memory.jsonl"],
        "read_graph",
        {},
        1.5,
    ),
    "everything": (
        "npm:@modelcontextprotocol/server-everything@2026.8.31",
        [],
        "echo",
        {"message": "hi"},
        1.5,
    ),
}
COLD_TOKENS = 12


def token(i: int) -> str:
    return f"bench-hosted-token-{i:02d}-0123456789"


def env_for(state: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    tokens = ",".join(f"p{i}:{token(i)}" for i in range(COLD_TOKENS + 1))
    env.update(
        {
            "SANDBOX_STATE_DIR": str(state),
            "SANDBOX_PORT": str(port),
            "SANDBOX_HOST": "127.0.0.1",
            "SANDBOX_AUTH_TOKENS": tokens,
            "SANDBOX_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
            "SANDBOX_WORKSPACE_MB": "64",
            "SANDBOX_MAX_SERVER_INSTANCES": "64",
        }
    )
    return env


def install(state: Path) -> None:
    env = env_for(state, 0)
    for name, (package, args, *_) in SERVERS.items():
        subprocess.run(
            [*CLI, "servers", "add", name, package, "--replace", *args],
            env=env,
            check=True,
            capture_output=True,
        )
    out = subprocess.run(
        [*CLI, "servers", "install"], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        sys.exit(f"servers install failed:\n{out.stdout}{out.stderr}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def through_us(
    url: str, tok: str, tool: str, args: dict[str, Any], calls: int
) -> list[float]:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {tok}"})
    async with http, Client(streamable_http_client(url, http_client=http), mode="legacy") as c:
        await c.call_tool(tool, args)  # started, and the client's schema compiled
        return await timed(lambda: c.call_tool(tool, args), calls)


async def cold(url: str, tok: str, tool: str, args: dict[str, Any]) -> float:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {tok}"})
    async with http, Client(streamable_http_client(url, http_client=http), mode="legacy") as c:
        started = time.perf_counter()
        result = await c.call_tool(tool, args)
        elapsed = time.perf_counter() - started
        assert not result.is_error, result
        return elapsed


async def direct(
    state: Path, name: str, tool: str, args: dict[str, Any], calls: int
) -> tuple[float, list[float]]:
    """The same program on the host over stdio: its cold start (process start, initialize,
    first call) and warm calls."""

    record = json.loads((state / "servers" / "install" / name / "installed.json").read_text())
    mount = str(state / "servers" / "install" / name)
    program = [p.replace("/opt/srt-server", mount) for p in record["program"]]
    workdir = state / "bench-direct" / name
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir)}
    if name == "memory":
        env["MEMORY_FILE_PATH"] = str(workdir / "memory.jsonl")
    params = StdioServerParameters(command=program[0], args=program[1:], env=env, cwd=workdir)
    started = time.perf_counter()
    async with Client(stdio_client(params)) as c:
        await c.call_tool(tool, args)
        cold = time.perf_counter() - started
        return cold, await timed(lambda: c.call_tool(tool, args), calls)


async def floor(calls: int) -> list[float]:
    """The library's HTTP floor: a no-op tool on a minimal FastMCP server (floor_server.py)."""
    port, tok = free_port(), "bench-floor-token"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "floor_server.py"), str(port), tok],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await healthy(f"http://127.0.0.1:{port}/mcp", accept_any=True)
        return await through_us(f"http://127.0.0.1:{port}/mcp", tok, "noop", {}, calls)
    finally:
        proc.terminate()
        proc.wait(10)


async def healthy(url: str, accept_any: bool = False) -> None:
    for _ in range(150):
        try:
            async with create_mcp_http_client() as http:
                status = (await http.get(url)).status_code
                if status == 200 or accept_any:
                    return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise SystemExit(f"{url} did not answer")


async def timed(call: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)
    return out


def ms(values: list[float], q: float = 0.5) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


@contextlib.asynccontextmanager
async def serving(state: Path) -> AsyncIterator[str]:
    """The server on `state` (its log in state/server.log), healthy: its base URL."""
    port = free_port()
    with (state / "server.log").open("wb") as log:
        server = subprocess.Popen(
            [*CLI], env=env_for(state, port), stdout=subprocess.DEVNULL, stderr=log
        )
    try:
        base = f"http://127.0.0.1:{port}"
        await healthy(f"{base}/health")
        yield base
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cold", type=int, default=5, help="cold starts per server")
    parser.add_argument("--state", type=Path, default=Path("/tmp/srt-bench-hosted"))
    opts = parser.parse_args()
    opts.state.mkdir(parents=True, exist_ok=True)
    install(opts.state)
    async with serving(opts.state) as base:
        rows = []
        for n, (name, (_, _, tool, args, target)) in enumerate(SERVERS.items()):
            url = f"{base}/servers/{name}/mcp"
            colds = [
                await cold(url, token(1 + (n * opts.cold + i) % COLD_TOKENS), tool, args)
                for i in range(opts.cold)
            ]
            ours = await through_us(url, token(0), tool, args, opts.calls)
            direct_cold, theirs = await direct(opts.state, name, tool, args, opts.calls)
            rows.append((name, colds, direct_cold, target, ours, theirs))
        floor_calls = await floor(opts.calls)
        print(f"\nhosted servers: {opts.calls} warm calls, {opts.cold} cold starts each (ms)\n")
        head = (
            "server      cold p50   max  direct  target   warm p50 us / direct   p90 us / direct"
            "   overhead"
        )
        print(head)
        print("-" * len(head))
        for name, colds, direct_cold, target, ours, theirs in rows:
            cold_ms = statistics.median(colds) * 1000
            print(
                f"{name:<11} {cold_ms:8.0f} {max(colds) * 1000:5.0f} {direct_cold * 1000:7.0f} "
                f"{target * 1000:7.0f}   {ms(ours):7.2f} / {ms(theirs):5.2f}     "
                f"{ms(ours, 0.9):6.2f} / {ms(theirs, 0.9):5.2f}   {ms(ours) - ms(theirs):+7.2f}"
            )
        print(
            f"\nthe HTTP floor: a no-op tool on a minimal FastMCP server, same client: "
            f"p50 {ms(floor_calls):.2f} ms, p90 {ms(floor_calls, 0.9):.2f} ms"
        )
        print(
            "targets: overhead <= 2 ms p50; cold <= 1000 ms (Python), <= 1500 ms (Node); "
            "direct = the same program on the host over stdio (cold: start to first answer)"
        )


if __name__ == "__main__":
    asyncio.run(main())
