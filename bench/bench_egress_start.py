"""What egress adds to an execution's start: `execute_code echo hi` with the network off and on,
and a short command that makes one HTTP request through the relay and the proxy (curl to the
network lab's origin; no internet), in one server, p50/p95 of --calls each, as a client sees
them (the call's round trip through the official `mcp` client).

Each kind runs in a session of its own, the three taking turns (so the machine's load falls on
all alike): a session's sandboxes are started ahead of need by the pool, with egress too (its
relay and its socket on the proxy under the session's policy), so this is a warm session's
call. The pool's hits and misses are read from /metrics. Target (issue 47): on <= 1.3x off.

    SRT_TEST_RUNTIME_DIR=/work/main/.runtime .venv/bin/python bench/bench_egress_start.py
        [--calls 60]

`run(calls=60) -> dict` is what bench/bench_perf.py calls. Needs root (the lab's network
namespace, the sandboxes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_egress import BenchFailure, pct, stdout_of
from mcp_harness import Conn, ServerProcess, client_in_task, running_server
from netlab import NetLab

TOKEN = "bench-egress-start-token-0123456789"
WARMUP = 5
KINDS = {  # kind: (command, sandbox_config, what its stdout starts with)
    "off": ("echo hi", {"network": False}, "hi"),
    "on": ("echo hi", None, "hi"),
    "http": ("curl -sS --fail http://allowed.test/hello", None, "hello"),
}


async def call(conn: Conn, kind: str) -> float:
    """One execution of `kind` in its own session: the client's round trip in ms."""
    command, config, expected = KINDS[kind]
    extra = {"sandbox_config": config} if config is not None else {}
    started = time.perf_counter()
    result = await conn.ok("execute_code", command=command, session=f"bench-{kind}", **extra)
    elapsed = (time.perf_counter() - started) * 1000
    if not stdout_of(result).startswith(expected):
        raise BenchFailure(f"{kind}: {stdout_of(result)[:200]!r}")
    return elapsed


def pool_counts(server: ServerProcess) -> dict[str, float]:
    counts = {"hits": server.metric(TOKEN, "srt_sandbox_pool_hits_total")}
    for reason in ("empty", "busy", "limits", "network", "unpoolable", "failed", "ended"):
        counts[reason] = server.metric(
            TOKEN, "srt_sandbox_pool_misses_total{", f'reason="{reason}"'
        )
    return counts


async def measure(
    server: ServerProcess, calls: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """The measured calls' times of each kind, and how many of each a pooled sandbox served
    (/metrics read after each call, outside its time)."""
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    hits = dict.fromkeys(KINDS, 0)
    async with client_in_task(server.url, TOKEN, "auto") as conn:
        for i in range(WARMUP + calls):
            for kind in KINDS:
                before = await asyncio.to_thread(pool_hits, server)
                elapsed = await call(conn, kind)
                if i >= WARMUP:
                    times[kind].append(elapsed)
                    hits[kind] += int(await asyncio.to_thread(pool_hits, server) - before)
    return times, hits


def pool_hits(server: ServerProcess) -> float:
    return server.metric(TOKEN, "srt_sandbox_pool_hits_total")


def run(calls: int = 60, tmp: Path | None = None) -> dict[str, object]:
    """p50/p95 (ms) of each kind, on/off and http/off at p50, the pool's hits and misses."""
    with NetLab() as lab, tempfile.TemporaryDirectory(prefix="srt-bench-egress-start-") as t:
        os.chmod(t, 0o711)
        settings = {
            "SANDBOX_AUTH_TOKEN": TOKEN,
            "SANDBOX_LOG_LEVEL": "WARNING",
            "SANDBOX_ACCESS_LOG": "false",
            "SANDBOX_EGRESS_ALLOW": "allowed.test",
            "SANDBOX_EGRESS_ALLOW_CIDRS": f"{lab.origin_ip}/32",
            "SANDBOX_EGRESS_RESOLVER": lab.resolver,
        }
        with running_server(Path(tmp or t) / "server", **settings) as server:
            times, hits = asyncio.run(measure(server, calls))
            pool = pool_counts(server)
    out: dict[str, object] = {"calls": calls, "pool": pool}
    for kind, values in times.items():
        out[kind] = {"p50": pct(values, 0.5), "p95": pct(values, 0.95), "pooled": hits[kind]}
    off = pct(times["off"], 0.5)
    out["ratio_on_off"] = pct(times["on"], 0.5) / off
    out["ratio_http_off"] = pct(times["http"], 0.5) / off
    return out


def report(result: dict[str, object]) -> None:
    print(
        f"{'execute_code, a warm session (ms)':<44}{'p50':>9}{'p95':>9}{'/off p50':>10}"
        f"{'pooled':>9}"
    )
    print("-" * 81)
    off = result["off"]["p50"]  # type: ignore[index]
    for kind, what in (
        ("off", "echo hi, network off"),
        ("on", "echo hi, egress on (relay + proxy socket)"),
        ("http", "curl http://allowed.test/hello via proxy"),
    ):
        row = result[kind]
        print(
            f"{what:<44}{row['p50']:>9.2f}{row['p95']:>9.2f}{row['p50'] / off:>10.2f}"  # type: ignore[index]
            f"{row['pooled']:>6}/{result['calls']}"  # type: ignore[index]
        )
    print(f"(pool, all calls: {result['pool']})")
    print("(pooled: calls a sandbox started ahead served; a busy miss: its start was skipped")
    print(" for want of spare CPU, docs/performance.md. Target: egress on <= 1.3x off)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60, help="measured calls of each kind")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error("--calls must be positive")
    if os.geteuid() != 0:
        print("bench_egress_start needs root (network namespace, sandboxes)", file=sys.stderr)
        return 2
    print(
        f"bench_egress_start: {args.calls} calls of each kind (+{WARMUP} warm-up), one server; "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"
    )
    try:
        result = run(args.calls)
    except BenchFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
