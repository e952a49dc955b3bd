"""End-to-end MCP benchmark: a real srt-mcp-server process, the official mcp client over HTTP.

Prints a table: execute_code `echo hi` p50/p95 sequential and calls/s with 10 concurrent
clients, `seq 1 1000000` end to end and the server's RSS before/after. With --redis, runs the
same server with a real redis-server mirroring and prints both rows side by side.

    .venv/bin/python bench/bench_mcp.py [--redis] [--calls 200] [--default-logging]

The server's CPU per call is its process's user+system time (/proc/PID/stat) over the
sequential runs, divided by the calls: the spawner, bwrap and the command are not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

TOKEN = "bench-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used (its own threads; not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(
        self, state: Path, redis_url: str | None, replica: str, quiet: bool = True
    ) -> None:
        self.port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")},
            "SANDBOX_PORT": str(self.port),
            "SANDBOX_AUTH_TOKEN": TOKEN,
            "SANDBOX_STATE_DIR": str(state),
            "SANDBOX_MAX_CONCURRENT": "64",
            "SANDBOX_MAX_PER_SESSION": "64",
            "SANDBOX_REPLICA_ID": replica,
        }
        if quiet:  # (default settings otherwise: INFO lines and the access log)
            env["SANDBOX_LOG_LEVEL"] = "WARNING"
        if redis_url:
            env["REDIS_URL"] = redis_url
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox_runtime.cli"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(state / "server.log", "wb"),
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx2.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


@asynccontextmanager
async def client(url: str, mode: str = "auto"):  # type: ignore[no-untyped-def]
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {TOKEN}"})
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode) as c:
        await c.list_tools()
        yield c


async def call(c: Any, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    result = await c.call_tool(tool, args)
    if result.is_error:
        raise RuntimeError(result.content[0].text)
    return dict(result.structured_content)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def bench_echo_sequential(
    url: str, calls: int, mode: str, pid: int
) -> tuple[float, float, float]:
    """p50 and p95 of `execute_code echo hi`, ms, and the server's CPU per call, ms."""
    times = []
    async with client(url, mode) as c:
        for _ in range(5):
            await call(c, "execute_code", {"command": "echo hi"})
        cpu = cpu_seconds(pid)
        for _ in range(calls):
            t = time.perf_counter()
            out = await call(c, "execute_code", {"command": "echo hi"})
            times.append(time.perf_counter() - t)
            assert out["exit_code"] == 0
        per_call = (cpu_seconds(pid) - cpu) / calls * 1000
    return statistics.median(times) * 1000, pct(times, 0.95) * 1000, per_call


async def bench_echo_concurrent(url: str, clients: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        async with client(url) as c:
            while time.perf_counter() < stop:
                out = await call(c, "execute_code", {"command": "echo hi"})
                assert out["exit_code"] == 0
                done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return done / (time.perf_counter() - started)


async def bench_seq(url: str) -> tuple[float, int]:
    async with client(url) as c:
        t = time.perf_counter()
        out = await call(c, "execute_code_async", {"command": "seq 1 1000000"})
        execution_id = out["execution_id"]
        cursor, size = 0, 0
        while True:
            page = await call(
                c,
                "get_execution_output",
                {"execution_id": execution_id, "after": cursor, "wait": True},
            )
            for event in page["events"]:
                if event["type"] == "stdout":
                    size += len(event["data"])
            cursor = page["next_cursor"]
            if page["status"] != "running" and not page["has_more"]:
                break
        return time.perf_counter() - t, size


async def run_one(label: str, server: Server, calls: int) -> dict[str, Any]:
    row: dict[str, Any] = {"label": label}
    row["rss_before"] = rss_mb(server.proc.pid)
    pid = server.proc.pid
    row["p50_legacy"], row["p95_legacy"], row["cpu_legacy"] = await bench_echo_sequential(
        server.url, calls, "legacy", pid
    )
    row["p50"], row["p95"], row["cpu"] = await bench_echo_sequential(server.url, calls, "auto", pid)
    row["cps"] = await bench_echo_concurrent(server.url, 10, 10.0)
    row["seq_s"], size = await bench_seq(server.url)
    row["seq_ok"] = size == len("".join(f"{i}\n" for i in range(1, 1_000_001)))
    row["rss_after"] = rss_mb(server.proc.pid)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", action="store_true", help="also run with a real redis-server")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--default-logging",
        action="store_true",
        help="the server as a user starts it (INFO lines and the access log), not at WARNING",
    )
    args = parser.parse_args()
    quiet = not args.default_logging
    rows = []
    with tempfile.TemporaryDirectory(prefix="srt-bench-") as tmp:
        os.chmod(tmp, 0o711)
        redis_proc = None
        try:
            server = Server(Path(tmp), None, "bench-a", quiet)
            try:
                rows.append(asyncio.run(run_one("in-memory", server, args.calls)))
            finally:
                server.stop()
            if args.redis:
                port = free_port()
                redis_proc = subprocess.Popen(
                    [shutil.which("redis-server") or "redis-server", "--port", str(port),
                     "--save", "", "--appendonly", "no"],
                    stdout=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(0.3)
                server = Server(Path(tmp), f"redis://127.0.0.1:{port}/0", "bench-b", quiet)
                try:
                    rows.append(asyncio.run(run_one("redis", server, args.calls)))
                finally:
                    server.stop()
        finally:
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait()
    print()
    print(
        f"{'state':<10} {'echo p50 ms':>11} {'p95':>6} {'legacy p50':>10} {'p95':>6} "
        f"{'10 clients/s':>12} {'seq 1e6 s':>9} {'RSS MB before->after':>20} "
        f"{'server CPU ms/call (modern, legacy)':>36}"
    )
    for r in rows:
        print(
            f"{r['label']:<10} {r['p50']:>11.1f} {r['p95']:>6.1f} {r['p50_legacy']:>10.1f} "
            f"{r['p95_legacy']:>6.1f} {r['cps']:>12.1f} {r['seq_s']:>9.2f} "
            f"{r['rss_before']:>9.1f} -> {r['rss_after']:<8.1f} "
            f"{r['cpu']:>26.2f}, {r['cpu_legacy']:.2f}"
            f"{'' if r['seq_ok'] else ' SEQ OUTPUT WRONG'}"
        )
    base = rows[0]
    print()
    print(
        "targets: p50 ≤ 20 ms, ≥ 80 calls/s, seq ≤ 3 s, RSS growth ≤ 50 MB → "
        f"p50 {'OK' if base['p50'] <= 20 else 'MISS'}, "
        f"calls/s {'OK' if base['cps'] >= 80 else 'MISS'}, "
        f"seq {'OK' if base['seq_s'] <= 3 else 'MISS'}, "
        f"RSS {'OK' if base['rss_after'] - base['rss_before'] <= 50 else 'MISS'}"
    )
    if len(rows) > 1:
        print(f"seq with Redis / without: {rows[0]['seq_s'] / rows[1]['seq_s']:.2f}x throughput")


if __name__ == "__main__":
    main()
