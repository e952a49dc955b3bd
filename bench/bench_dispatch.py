"""tools/call dispatch: our server with its fast path (SANDBOX_FAST_DISPATCH, the default) and
without it (the library's path: "before"), against the library's floor (floor_server.py: a
FastMCP no-op) and the SDK's low-level server answering the same no-op, in the same run, in
alternating rounds, both protocol eras, with the official mcp client over HTTP.

Per server and era: p50 of `execute_code echo hi` (ours) or `noop` (floors), sequential in one
client; for ours also a call that runs no sandbox (`get_execution_status` of a finished
execution: the dispatch without the execution), and the server's CPU per call
(/proc/PID/stat). With --earlier, srt-mcp-server 0.2's `execute_code echo hi` too (its venv
is made with pip when missing, as bench_mcp.py does).

    .venv/bin/python bench/bench_dispatch.py [--calls 200] [--rounds 3] [--earlier]

`run(...)` returns the figures as a dict (bench_perf.py prints them in its table).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mcp import TOKEN, Server, client, cpu_seconds
from new_clients import earlier_server, floor_server

ERAS = {"modern": "auto", "legacy": "legacy"}
ECHO = ("execute_code", {"command": "echo hi"})
SETTLE = 1.0  # seconds for the sandboxes started ahead after echo calls to be ready
EARLIER_CALLS = 10  # per round: 0.2 takes ~0.5 s a call
DEFAULT_EARLIER_VENV = Path(tempfile.gettempdir()) / "srt-compat-02" / "ref"


async def _latencies(
    url: str, era: str, calls: int, tool: str, args: dict[str, Any]
) -> list[float]:
    """Seconds of each of `calls` sequential calls in one client (after 3 unmeasured)."""
    out = []
    async with client(url, era) as c:
        for _ in range(3):
            await c.call_tool(tool, args)
        for _ in range(calls):
            t = time.perf_counter()
            result = await c.call_tool(tool, args)
            out.append(time.perf_counter() - t)
            if result.is_error:
                raise RuntimeError(f"{tool} failed: {result.content}")
    return out


async def _finished_execution(url: str) -> str:
    async with client(url) as c:
        result = await c.call_tool(*ECHO)
        return str(result.structured_content["execution_id"])  # type: ignore[index]


def run(
    calls: int = 200,
    rounds: int = 3,
    earlier: bool = False,
    quiet: bool = False,
    earlier_venv: Path = DEFAULT_EARLIER_VENV,
) -> dict[str, Any]:
    """The figures (ms) by server and era: {"p50": {server: {era: ms}}, "status_p50", "cpu"
    and "status_cpu" (ours: ms of server CPU per call), "ratios"}; servers "floor", "lowlevel",
    "before" (ours, the library's dispatch), "after" (ours, the fast path), "earlier"."""
    per_round = max(1, calls // rounds)
    echo: dict[str, dict[str, list[float]]] = {}
    status: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, float]] = {}
    status_cpu: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="srt-bench-") as tmp, ExitStack() as stack:
        os.chmod(tmp, 0o711)
        ours = {
            "after": Server(Path(tmp) / "after", None, "after", quiet, pool=True),
            "before": Server(
                Path(tmp) / "before", None, "before", quiet, True, SANDBOX_FAST_DISPATCH="false"
            ),
        }
        for server in ours.values():
            stack.callback(server.stop)
        floors = {
            "floor": stack.enter_context(floor_server(TOKEN)).url,
            "lowlevel": stack.enter_context(floor_server(TOKEN, lowlevel=True)).url,
        }
        if earlier:
            work = Path(tmp) / "earlier"
            work.mkdir()
            floors["earlier"] = stack.enter_context(earlier_server(earlier_venv, TOKEN, work)).url
        finished = {label: asyncio.run(_finished_execution(s.url)) for label, s in ours.items()}
        for r in range(rounds):
            order = list(ours.items()) if r % 2 == 0 else list(reversed(ours.items()))
            for era, mode in ERAS.items():
                for label, url in floors.items():
                    tool = ECHO if label == "earlier" else ("noop", {})
                    n = min(per_round, EARLIER_CALLS) if label == "earlier" else per_round
                    times = asyncio.run(_latencies(url, mode, n, *tool))
                    echo.setdefault(label, {}).setdefault(era, []).extend(times)
                # The no-sandbox call first, once the pool has refilled: a sandbox starting
                # beside it would take the CPU it is measured by.
                time.sleep(SETTLE)
                for label, server in order:
                    args = {"execution_id": finished[label]}
                    used = cpu_seconds(server.proc.pid)
                    call = ("get_execution_status", args)
                    times = asyncio.run(_latencies(server.url, mode, per_round, *call))
                    spent = (cpu_seconds(server.proc.pid) - used) / (per_round + 3)
                    status_cpu.setdefault(label, {}).setdefault(era, 0.0)
                    status_cpu[label][era] += spent * 1000 / rounds
                    status.setdefault(label, {}).setdefault(era, []).extend(times)
                for label, server in order:
                    used = cpu_seconds(server.proc.pid)
                    times = asyncio.run(_latencies(server.url, mode, per_round, *ECHO))
                    spent = (cpu_seconds(server.proc.pid) - used) / (per_round + 3)
                    cpu.setdefault(label, {}).setdefault(era, 0.0)
                    cpu[label][era] += spent * 1000 / rounds
                    echo.setdefault(label, {}).setdefault(era, []).extend(times)
                    time.sleep(SETTLE)

    def p50(table: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
        return {
            k: {e: statistics.median(v) * 1000 for e, v in row.items()} for k, row in table.items()
        }

    out: dict[str, Any] = {
        "p50": p50(echo),
        "status_p50": p50(status),
        "cpu": cpu,
        "status_cpu": status_cpu,
    }
    ratios: dict[str, dict[str, float]] = {}
    for era in ERAS:
        row = {
            "echo_vs_floor": out["p50"]["after"][era] / out["p50"]["floor"][era],
            "echo_before_vs_after": out["p50"]["before"][era] / out["p50"]["after"][era],
            "status_vs_floor": out["status_p50"]["after"][era] / out["p50"]["floor"][era],
            "status_before_vs_after": out["status_p50"]["before"][era]
            / out["status_p50"]["after"][era],
        }
        if "earlier" in out["p50"]:
            row["earlier_vs_echo"] = out["p50"]["earlier"][era] / out["p50"]["after"][era]
        ratios[era] = row
    out["ratios"] = ratios
    return out


def report(out: dict[str, Any]) -> None:
    p50, status, cpu, scpu = out["p50"], out["status_p50"], out["cpu"], out["status_cpu"]
    earlier = "  0.2 echo  0.2/ours" if "earlier" in p50 else ""
    print(
        f"\n{'era':<7} {'floor no-op':>11} {'low-level':>9} {'echo before':>11} "
        f"{'echo after':>10} {'CPU/call before/after':>21} {'status before/after':>19} "
        f"{'its CPU before/after':>20} "
        f"{'echo/floor':>10} {'status/floor':>12}{earlier}"
    )
    for era in ERAS:
        r = out["ratios"][era]
        extra = ""
        if "earlier" in p50:
            extra = f"  {p50['earlier'][era]:8.1f}  {r['earlier_vs_echo']:7.1f}x"
        print(
            f"{era:<7} {p50['floor'][era]:>11.2f} {p50['lowlevel'][era]:>9.2f} "
            f"{p50['before'][era]:>11.2f} {p50['after'][era]:>10.2f} "
            f"{cpu['before'][era]:>10.2f}/{cpu['after'][era]:<10.2f} "
            f"{status['before'][era]:>9.2f}/{status['after'][era]:<9.2f} "
            f"{scpu['before'][era]:>9.2f}/{scpu['after'][era]:<10.2f} "
            f"{r['echo_vs_floor']:>10.2f} {r['status_vs_floor']:>12.2f}{extra}"
        )
    print(
        "(ms, p50; echo = execute_code echo hi; status = get_execution_status, no sandbox; "
        "targets: echo <= 1.5x the floor's no-op, >= 60x srt-mcp-server 0.2)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200, help="sequential calls per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--earlier", action="store_true", help="also srt-mcp-server 0.2")
    parser.add_argument("--earlier-venv", type=Path, default=DEFAULT_EARLIER_VENV)
    parser.add_argument("--quiet", action="store_true", help="servers at WARNING, no access log")
    args = parser.parse_args()
    report(run(args.calls, args.rounds, args.earlier, args.quiet, args.earlier_venv))


if __name__ == "__main__":
    main()
