"""Named sessions on 3 replicas + redis-server + nginx (the shipped config): local vs forwarded.

a) `execute_code echo hi` p50/p95 for a named session (the `session` argument) called on its
   home replica directly ("local") and on another replica, which forwards the call to the home
   over the signed cluster channel ("forwarded"); calls interleaved, both protocol eras.
b) calls/s with concurrent clients, each on its own `/s/{session}/mcp` URL through nginx, and
   the fraction of those calls some replica forwarded (from the replicas' /metrics).

    .venv/bin/python bench/bench_sessions.py [--calls 200] [--clients 10] [--duration 10 |
        --count N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mcp_harness import Conn, Mode, open_client
from topology_harness import TOKEN, Topology, running_topology

PRINCIPAL = "default"  # the principal of the harness's bearer token
WARMUP = 5
TARGET_MS = 3.0
SETTINGS = {"SANDBOX_LOG_LEVEL": "WARNING", "SANDBOX_ACCESS_LOG": "false"}
FORWARDED = "srt_forwarded_calls_total"
SERVED = "srt_forwarded_calls_served_total"
CHANNEL = "srt_forwarded_call_seconds"  # histogram on the forwarding replica


class BenchFailure(Exception):
    """Something the benchmark relies on did not hold (not a missed target)."""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def echo(conn: Conn, session: str) -> str:
    """`echo hi` in `session`; its execution id."""
    out = await conn.ok("execute_code", command="echo hi", session=session)
    stdout = "".join(e.get("data", "") for e in out["output"] if e.get("type") == "stdout")
    if out.get("exit_code") != 0 or stdout != "hi\n":
        raise BenchFailure(f"echo in session {session!r} returned {out}")
    return str(out["execution_id"])


async def metric_sum(topo: Topology, name: str, rids: list[str] | None = None) -> float:
    rids = list(topo.replicas) if rids is None else rids
    return sum(await asyncio.gather(*(asyncio.to_thread(topo.metric, r, name) for r in rids)))


async def local_vs_forwarded(topo: Topology, mode: Mode, calls: int) -> dict[str, float]:
    """N interleaved calls on the session's home (A) and through another replica (B)."""
    a, b = list(topo.replicas)[:2]
    session = f"bench-{mode}-{uuid.uuid4().hex[:8]}"
    async with (
        open_client(topo.replicas[a].url, TOKEN, mode) as local,
        open_client(topo.replicas[b].url, TOKEN, mode) as remote,
    ):
        await echo(local, session)  # the first call makes A the home
        home = await asyncio.to_thread(topo.home_of, PRINCIPAL, session)
        if home != a:
            raise BenchFailure(f"session {session!r} homed on {home!r}, expected {a!r}")
        for _ in range(WARMUP):
            await echo(local, session)
            await echo(remote, session)
        forwarded_before = await metric_sum(topo, FORWARDED, [a, b])
        served_before = await metric_sum(topo, SERVED, [a])
        channel_before = await metric_sum(topo, CHANNEL + "_sum", [b])
        times: dict[str, list[float]] = {"local": [], "forwarded": []}
        ids: dict[str, list[str]] = {"local": [], "forwarded": []}
        for i in range(calls):
            order = (("local", local), ("forwarded", remote))
            for kind, conn in order if i % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                execution_id = await echo(conn, session)
                times[kind].append(time.perf_counter() - t)
                ids[kind].append(execution_id)
        forwarded = await metric_sum(topo, FORWARDED, [a, b]) - forwarded_before
        served = await metric_sum(topo, SERVED, [a]) - served_before
        channel = await metric_sum(topo, CHANNEL + "_sum", [b]) - channel_before
    if forwarded != calls or served != calls:
        raise BenchFailure(
            f"{mode}: expected {calls} forwarded calls B->A, metrics say {forwarded:g} "
            f"forwarded and {served:g} served by the home"
        )
    sample = [e for values in ids.values() for e in values[:: max(1, calls // 3)]]
    ran_on = {await asyncio.to_thread(topo.replica_of, e) for e in sample}
    if ran_on != {a} or await asyncio.to_thread(topo.home_of, PRINCIPAL, session) != a:
        raise BenchFailure(f"{mode}: session {session!r} ran on {ran_on}, not only its home {a!r}")
    row = {"channel_mean": channel / calls * 1000}
    for kind, values in times.items():
        row[f"{kind}_p50"] = statistics.median(values) * 1000
        row[f"{kind}_p95"] = pct(values, 0.95) * 1000
    return row


async def through_nginx(
    topo: Topology, clients: int, duration: float, count: int | None
) -> dict[str, float | str]:
    """`clients` clients, each on its own /s/{session}/mcp URL, calling in a loop."""
    sessions = [f"bench-c{i}-{uuid.uuid4().hex[:8]}" for i in range(clients)]
    async with AsyncExitStack() as stack:
        conns = [
            await stack.enter_async_context(open_client(topo.session_url(s), TOKEN, "auto"))
            for s in sessions
        ]

        async def warm(conn: Conn, session: str) -> None:
            for _ in range(WARMUP):
                await echo(conn, session)

        await asyncio.gather(*(warm(c, s) for c, s in zip(conns, sessions, strict=True)))
        forwarded_before = await metric_sum(topo, FORWARDED)
        done = 0
        stop = time.perf_counter() + duration

        async def worker(conn: Conn, session: str) -> None:
            nonlocal done
            n = 0
            while (n < count) if count is not None else (time.perf_counter() < stop):
                await echo(conn, session)
                n += 1
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(c, s) for c, s in zip(conns, sessions, strict=True)))
        elapsed = time.perf_counter() - started
        forwarded = await metric_sum(topo, FORWARDED) - forwarded_before
    homes = Counter([await asyncio.to_thread(topo.home_of, PRINCIPAL, s) or "?" for s in sessions])
    return {
        "calls": done,
        "seconds": elapsed,
        "cps": done / elapsed,
        "forwarded": forwarded,
        "fraction": forwarded / done if done else float("nan"),
        "homes": " ".join(f"{rid}:{homes.get(rid, 0)}" for rid in topo.replicas),
    }


async def run_all(topo: Topology, args: argparse.Namespace) -> None:
    rows = {}
    for mode in ("auto", "legacy"):
        print(f"  a) {mode}: {args.calls} local + {args.calls} forwarded calls ...", flush=True)
        rows[mode] = await local_vs_forwarded(topo, mode, args.calls)
    what = f"{args.count} calls each" if args.count is not None else f"{args.duration:g} s"
    print(f"  b) {args.clients} clients through nginx, {what} ...", flush=True)
    conc = await through_nginx(topo, args.clients, args.duration, args.count)

    a, b = list(topo.replicas)[:2]
    era = {"auto": "2026-07-28 (auto)", "legacy": "2025-11-25 (legacy)"}
    print()
    print(
        f"a) execute_code 'echo hi', named session homed on {a}; local = client on {a}, "
        f"forwarded = client on {b} -> {a}; {args.calls} calls each, interleaved"
    )
    head = (
        f"{'era':<20} {'local p50':>9} {'p95':>6} {'fwd p50':>8} {'p95':>6} "
        f"{'overhead p50':>12} {'B->A channel mean':>17}  target"
    )
    print(head)
    print("-" * len(head))
    verdicts = []
    for mode, r in rows.items():
        overhead = r["forwarded_p50"] - r["local_p50"]
        verdict = "PASS" if overhead <= TARGET_MS else "MISS"
        verdicts.append(verdict)
        print(
            f"{era[mode]:<20} {r['local_p50']:>9.2f} {r['local_p95']:>6.2f} "
            f"{r['forwarded_p50']:>8.2f} {r['forwarded_p95']:>6.2f} {overhead:>12.2f} "
            f"{r['channel_mean']:>17.2f}  {verdict}"
        )
    print(
        "(ms; overhead = fwd p50 - local p50; channel mean = the forwarding replica's time in "
        f"the signed call to the home, {CHANNEL})"
    )
    print()
    print(
        f"b) {args.clients} concurrent clients, each on its own /s/{{session}}/mcp via nginx, "
        "2026-07-28 (auto), execute_code 'echo hi' in a loop"
    )
    head = (
        f"{'clients':>7} {'calls':>7} {'seconds':>7} {'calls/s':>8} {'forwarded':>9} "
        f"{'fraction':>8}  homes"
    )
    print(head)
    print("-" * len(head))
    print(
        f"{args.clients:>7} {conc['calls']:>7} {conc['seconds']:>7.1f} {conc['cps']:>8.1f} "
        f"{conc['forwarded']:>9g} {conc['fraction']:>8.1%}  {conc['homes']}"
    )
    print()
    print(f"target: forwarding adds <= {TARGET_MS:g} ms at p50 -> {', '.join(verdicts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=None, help="timed calls each way (200)")
    parser.add_argument("--clients", type=int, default=10)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--duration", type=float, default=None, help="seconds of b) (10)")
    group.add_argument("--count", type=int, default=None, help="calls per client in b)")
    parser.add_argument("--quick", action="store_true", help="a small run: 30 calls, 3 s")
    args = parser.parse_args()
    if args.calls is None:
        args.calls = 30 if args.quick else 200
    if args.duration is None:
        args.duration = 3.0 if args.quick else 10.0
    if args.calls < 1 or args.clients < 1 or args.duration <= 0 or (args.count or 1) < 1:
        parser.error("--calls, --clients, --duration and --count must be positive")

    print(
        f"bench_sessions: 3 replicas + redis-server + nginx (shipped config), "
        f"{os.cpu_count()} cores shared by all"
    )
    print("replica settings: " + ", ".join(f"{k}={v}" for k, v in SETTINGS.items()))
    print(f"warm-up: {WARMUP} calls each way before timing", flush=True)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="srt-bench-sessions-") as tmp:
            os.chmod(tmp, 0o711)
            with running_topology(Path(tmp), count=3, **SETTINGS) as topo:
                asyncio.run(run_all(topo, args))
    except BenchFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"(whole run {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
