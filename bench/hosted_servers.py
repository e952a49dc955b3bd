"""Hosted MCP servers: cold start and warm `tools/call` through /servers/NAME/mcp, side by
side with the same server run directly over stdio by the official client, in the same run.

Per server (installed ahead with `srt-mcp-server servers install`, into --state, kept between
runs):

- cold: a new principal's first `tools/call` (its instance starts in a sandbox, initializes
  and answers); the client's connect and initialize come before and are not counted;
- warm: p50 and p90 of `tools/call` on a started instance, through our endpoint (legacy era:
  one HTTP request each) and directly over stdio (the same program, on the host, no sandbox);
- overhead: warm p50 through us minus direct;
- the warm entry: the time server again as `time-warm` (`shared`, `warm = 1`): a new
  client's first `tools/call` finds the instance started ahead with the server.

Targets (2 cores): warm overhead <= 2 ms p50; cold <= 1 s for a Python server, <= 1.5 s for
a Node one.

    .venv/bin/python bench/hosted_servers.py [--calls 200] [--cold 5] [--state DIR] [--json]

`run(calls, cold, state, servers) -> dict` gives the same figures to other benches.
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
WARM = "time-warm"  # the time server again, `shared` and `warm = 1`


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
    entries = [(name, package, args) for name, (package, args, *_) in SERVERS.items()]
    entries.append((WARM, SERVERS["time"][0], ["--scope=shared", "--warm=1"]))
    for name, package, args in entries:
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


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def through_us(
    url: str, tok: str, tool: str, args: dict[str, Any], calls: int, cpu: list[float] | None = None
) -> list[float]:
    """`calls` timed calls; `cpu` ([pid]): gets the server's CPU ms per call appended (what a
    busy machine changes least: the wall times of one run on a shared VM vary 3x)."""
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {tok}"})
    async with http, Client(streamable_http_client(url, http_client=http), mode="legacy") as c:
        await c.call_tool(tool, args)  # started, and the client's schema compiled
        before = cpu_seconds(int(cpu[0])) if cpu else 0.0
        times = await timed(lambda: c.call_tool(tool, args), calls)
        if cpu:
            cpu.append((cpu_seconds(int(cpu[0])) - before) / calls * 1000)
        return times


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


async def floor(calls: int, cpu: list[float] | None = None) -> list[float]:
    """The library's HTTP floor: a no-op tool on a minimal FastMCP server (floor_server.py);
    `cpu` ([]): gets its CPU ms per call appended."""
    port, tok = free_port(), "bench-floor-token"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "floor_server.py"), str(port), tok],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await healthy(f"http://127.0.0.1:{port}/mcp", accept_any=True)
        meter = None if cpu is None else [float(proc.pid)]
        times = await through_us(f"http://127.0.0.1:{port}/mcp", tok, "noop", {}, calls, meter)
        if cpu is not None and meter:
            cpu.append(meter[-1])
        return times
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
async def serving(state: Path, pid: list[int] | None = None) -> AsyncIterator[str]:
    """The server on `state` (its log in state/server.log), healthy: its base URL (and its
    process id appended to `pid`)."""
    port = free_port()
    with (state / "server.log").open("wb") as log:
        server = subprocess.Popen(
            [*CLI], env=env_for(state, port), stdout=subprocess.DEVNULL, stderr=log
        )
    if pid is not None:
        pid.append(server.pid)
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


async def measure(state: Path, calls: int, colds: int, names: list[str]) -> dict[str, Any]:
    """Every figure of one run (milliseconds), with the server on `state` installed."""
    out: dict[str, Any] = {"calls": calls, "cold_starts": colds, "servers": {}}
    pid: list[int] = []
    async with serving(state, pid) as base:
        for n, name in enumerate(names):
            _, _, tool, args, target = SERVERS[name]
            url = f"{base}/servers/{name}/mcp"
            firsts = [
                await cold(url, token(1 + (n * colds + i) % COLD_TOKENS), tool, args)
                for i in range(colds)
            ]
            meter = [float(pid[0])]
            ours = await through_us(url, token(0), tool, args, calls, meter)
            direct_cold, theirs = await direct(state, name, tool, args, calls)
            out["servers"][name] = {
                "cold_p50_ms": statistics.median(firsts) * 1000,
                "cold_max_ms": max(firsts) * 1000,
                "direct_cold_ms": direct_cold * 1000,
                "cold_target_ms": target * 1000,
                "warm_p50_ms": ms(ours),
                "warm_p90_ms": ms(ours, 0.9),
                "direct_p50_ms": ms(theirs),
                "direct_p90_ms": ms(theirs, 0.9),
                "overhead_p50_ms": ms(ours) - ms(theirs),
                "server_cpu_per_call_ms": meter[-1],
            }
        if "time" in names:
            # A `warm = 1` entry: started with the server, so a new client's first call
            # finds it running (the shared instance: one for every principal).
            _, _, tool, args, _ = SERVERS["time"]
            url = f"{base}/servers/{WARM}/mcp"
            firsts = [await cold(url, token(COLD_TOKENS - i), tool, args) for i in range(colds)]
            out["warm_entry_first_call_p50_ms"] = statistics.median(firsts) * 1000
    floor_cpu: list[float] = []
    floor_calls = await floor(calls, floor_cpu)
    out["floor_p50_ms"], out["floor_p90_ms"] = ms(floor_calls), ms(floor_calls, 0.9)
    out["floor_cpu_per_call_ms"] = floor_cpu[0]
    return out


def run(
    calls: int = 200,
    cold: int = 5,
    state: Path = Path("/tmp/srt-bench-hosted"),
    servers: list[str] | None = None,
) -> dict[str, Any]:
    """Install (kept in `state` between runs), measure and return the figures: per server
    `cold_p50_ms`, `warm_p50_ms`, `direct_p50_ms`, `overhead_p50_ms` (ours - stdio) and
    more; `warm_entry_first_call_p50_ms`; the HTTP floor `floor_p50_ms`."""
    names = list(servers or SERVERS)
    state.mkdir(parents=True, exist_ok=True)
    install(state)
    return asyncio.run(measure(state, calls, cold, names))


def report(figures: dict[str, Any]) -> None:
    calls, colds = figures["calls"], figures["cold_starts"]
    print(f"\nhosted servers: {calls} warm calls, {colds} cold starts each (ms)\n")
    head = (
        "server      cold p50   max  direct  target   warm p50 us / direct   p90 us / direct"
        "   overhead  cpu"
    )
    print(head)
    print("-" * len(head))
    for name, f in figures["servers"].items():
        print(
            f"{name:<11} {f['cold_p50_ms']:8.0f} {f['cold_max_ms']:5.0f} "
            f"{f['direct_cold_ms']:7.0f} {f['cold_target_ms']:7.0f}   "
            f"{f['warm_p50_ms']:7.2f} / {f['direct_p50_ms']:5.2f}     "
            f"{f['warm_p90_ms']:6.2f} / {f['direct_p90_ms']:5.2f}   {f['overhead_p50_ms']:+7.2f}"
            f"  {f['server_cpu_per_call_ms']:4.2f}"
        )
    if "warm_entry_first_call_p50_ms" in figures:
        print(
            f"\n{WARM} (the time server, shared, warm = 1): a new client's first call p50 "
            f"{figures['warm_entry_first_call_p50_ms']:.1f} ms"
        )
    print(
        f"the HTTP floor: a no-op tool on a minimal FastMCP server, same client: "
        f"p50 {figures['floor_p50_ms']:.2f} ms, p90 {figures['floor_p90_ms']:.2f} ms, "
        f"its server's CPU {figures['floor_cpu_per_call_ms']:.2f} ms a call"
    )
    print(
        "targets: overhead <= 2 ms p50; cold <= 1000 ms (Python), <= 1500 ms (Node); "
        "direct = the same program on the host over stdio (cold: start to first answer); "
        "cpu = this server's CPU time per warm call (the instance's own not included)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cold", type=int, default=5, help="cold starts per server")
    parser.add_argument("--state", type=Path, default=Path("/tmp/srt-bench-hosted"))
    parser.add_argument("--servers", nargs="*", choices=list(SERVERS), help="default: all")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    opts = parser.parse_args()
    figures = run(opts.calls, opts.cold, opts.state, opts.servers)
    if opts.json:
        print(json.dumps(figures, indent=1))
    else:
        report(figures)


if __name__ == "__main__":
    main()
