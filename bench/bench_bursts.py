"""New sessions in bursts (the computesdk shape, create -> first command): the first
`execute_code echo hi` of a new named session (`session="s-<n>"`), with the official mcp client
against a real server this bench starts, the clients in a process of their own.

- sequential: --sessions new sessions one after another;
- bursts of W (--bursts 10,50): --sessions new sessions in rounds of W at once (W clients,
  each its own connection), --gap seconds between rounds; `burstW_last`: the last round alone
  (the server has seen the rounds before it: its blank-workspace pool has grown to them);
- later: calls in a session that has had its first, one after another, and per burst width
  the burst's sessions' second calls, W at once — the ratios' denominators.
Per phase also the server's mean sandbox start (srt_sandbox_spawn_seconds: the workspace made
ready and the sandbox started or handed its command), and CPU seconds of server and clients.

p50/p95/p99 of each, first/later ratios, against the targets (first <= 1.2x later, also in
bursts of 10; burst-of-50 p99 <= 300 ms). The server runs with its defaults but for the caps a
burst of 50 would hit (SANDBOX_MAX_CONCURRENT, the per-principal mount cap), and logs at WARNING.

    .venv/bin/python bench/bench_bursts.py [--sessions 100] [--bursts 10,50] [--gap 1.0]
        [--mode auto|legacy] [--set SANDBOX_X=value ...] [--json] [--profile FILE]

(--profile: py-spy, from PyPI, on PATH, samples the server's stacks into FILE.)

`run(...) -> dict` is what bench_perf.py calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TOKEN = "bench-bursts-token-0123456789"
SETTINGS = {
    "SANDBOX_AUTH_TOKEN": TOKEN,
    "SANDBOX_LOG_LEVEL": "WARNING",
    "SANDBOX_ACCESS_LOG": "false",
    "SANDBOX_WORKSPACE_MB": "1024",  # (the server's default; the test harness's is smaller)
    # A burst of 50 runs 50 executions at once (the default cap is 16), and one principal's
    # few hundred new sessions stay mounted (default 64 per principal: past it each new one
    # would first unmount an idle one).
    "SANDBOX_MAX_CONCURRENT": "128",
    "SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL": "1024",
}
WARM_CALLS = 5
TARGET_RATIO = 1.2
TARGET_P99_50_MS = 300.0
MISSES = "srt_sandbox_pool_misses_total"
SPAWN = "srt_sandbox_spawn_seconds"


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50/p95/p99/max in ms of samples in seconds."""
    ordered = sorted(samples)
    if len(ordered) < 2:
        ordered = ordered * 2 or [float("nan")] * 2
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "p50_ms": round(q[49] * 1000, 1),
        "p95_ms": round(q[94] * 1000, 1),
        "p99_ms": round(q[98] * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
        "n": len(samples),
    }


# -- the client process ---------------------------------------------------------------------


async def _echo(conn: Any, session: str) -> float:
    began = time.perf_counter()
    out = await conn.ok("execute_code", command="echo hi", session=session)
    elapsed = time.perf_counter() - began
    stdout = "".join(e.get("data", "") for e in out["output"] if e.get("type") == "stdout")
    if out.get("exit_code") != 0 or stdout != "hi\n":
        raise RuntimeError(f"echo in session {session!r} returned {out}")
    return elapsed


async def _spawn_total(url: str, token: str) -> tuple[float, float]:
    """The server's srt_sandbox_spawn_seconds sum and count (what starting the sandboxes took
    on the server: the workspace made ready, the sandbox started or handed its command)."""
    import httpx2

    base = url.rsplit("/", 1)[0]
    async with httpx2.AsyncClient(timeout=10) as http:
        text = (
            await http.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"})
        ).text
    found = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        for suffix in found:
            if line.startswith(f"{SPAWN}{suffix}"):
                found[suffix] = float(line.rsplit(" ", 1)[1])
    return found["_sum"], found["_count"]


async def measure(url: str, plan: dict[str, Any]) -> dict[str, Any]:
    """The samples (seconds) of every phase, with `plan`'s numbers, and the server's mean
    sandbox start (ms) in each phase (key `spawn_ms`)."""
    from mcp_harness import open_client

    widths: list[int] = plan["bursts"]
    run_id = uuid.uuid4().hex[:6]
    counter = iter(range(10**9))

    def new() -> str:
        return f"s-{run_id}-{next(counter)}"

    out: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        conns = [  # (one after another: each is entered and left by this task)
            await stack.enter_async_context(open_client(url, plan["token"], plan["mode"]))
            for _ in range(max([1, *widths]))
        ]
        first = conns[0]
        for _ in range(WARM_CALLS):  # (imports, schema compiles, the first sandboxes)
            await _echo(first, "warm")
            await _echo(first, new())
        for conn in conns:  # (one after another, in one session: not a burst of new ones)
            await _echo(conn, "warm")
        await asyncio.sleep(plan["gap"])
        spawn: dict[str, list[float]] = {}

        async def phase(name: str, calls: Any) -> list[float]:
            before = await _spawn_total(url, plan["token"])
            samples: list[float] = await calls
            after = await _spawn_total(url, plan["token"])
            got = spawn.setdefault(name, [0.0, 0.0])
            got[0] += after[0] - before[0]
            got[1] += after[1] - before[1]
            return samples

        async def one_by_one(session: Any) -> list[float]:
            return [await _echo(first, session()) for _ in range(plan["sessions"])]

        out["later"] = await phase("later", one_by_one(lambda: "warm"))
        out["sequential"] = await phase("sequential", one_by_one(new))
        for width in widths:
            await asyncio.sleep(plan["gap"])
            firsts: list[float] = []
            later: list[float] = []
            for _ in range(max(1, plan["sessions"] // width)):
                names = [new() for _ in range(width)]
                calls = zip(conns, names, strict=False)
                firsts += await phase(
                    f"burst{width}", asyncio.gather(*(_echo(c, s) for c, s in calls))
                )
                await asyncio.sleep(plan["gap"])
                calls = zip(conns, names, strict=False)
                later += await phase(
                    f"burst{width}_later", asyncio.gather(*(_echo(c, s) for c, s in calls))
                )
            out[f"burst{width}"] = firsts
            out[f"burst{width}_last"] = firsts[-width:]  # (the pool grown by those before)
            out[f"burst{width}_later"] = later
    out["spawn_ms"] = {k: round(v[0] / v[1] * 1000, 1) if v[1] else None for k, v in spawn.items()}
    return out


def _client_main(url: str, plan_json: str) -> None:
    samples = asyncio.run(measure(url, json.loads(plan_json)))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    samples["cpu_s"] = usage.ru_utime + usage.ru_stime
    print(json.dumps(samples))


# -- the bench ------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    sessions: int = 100,
    bursts: tuple[int, ...] = (10, 50),
    gap: float = 1.0,
    mode: str = "auto",
    settings: dict[str, str] | None = None,
    profile: Path | None = None,
) -> dict[str, Any]:
    """Start a server, measure in a client process of its own, stop the server: a dict of
    percentiles per phase, ratios and target verdicts, the server's pool counters."""
    from mcp_harness import running_server

    env_settings = {**SETTINGS, **(settings or {})}
    plan = {"sessions": sessions, "bursts": list(bursts), "gap": gap, "mode": mode}
    with tempfile.TemporaryDirectory(prefix="bench-bursts-") as tmp:
        os.chmod(tmp, 0o755)
        with running_server(Path(tmp), **env_settings) as server:
            spy = None
            if profile is not None:  # (py-spy, from PyPI: samples of the server's stacks)
                record = ["py-spy", "record", "-p", str(server.pid), "-o", str(profile)]
                spy = subprocess.Popen([*record, "-f", "raw", "-r", "200", "-s"])
            server_cpu = _cpu_seconds(server.pid)
            began = time.perf_counter()
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--client",
                    server.url,
                    json.dumps(plan | {"token": TOKEN}),
                ],
                capture_output=True,
                text=True,
                check=False,
                timeout=1800,
            )
            wall = time.perf_counter() - began
            server_cpu = _cpu_seconds(server.pid) - server_cpu
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"client failed:\n{proc.stderr[-4000:]}\n{server.stderr_text()[-3000:]}"
                )
            samples = json.loads(proc.stdout.strip().splitlines()[-1])
            proc_cpu = samples.pop("cpu_s")
            spawn_ms = samples.pop("spawn_ms")
            counters = {
                label: server.metric(TOKEN, name, *labels)
                for label, name, labels in (
                    ("sandbox_hits", "srt_sandbox_pool_hits_total", ()),
                    ("sandbox_misses_empty", MISSES, ('reason="empty"',)),
                    ("sandbox_misses_busy", MISSES, ('reason="busy"',)),
                )
            }
    later = percentiles(samples["later"])
    report: dict[str, Any] = {
        "measure": 'new session: execute_code("echo hi", session=new) with the official mcp '
        f"client ({mode}), clients in their own process",
        "settings": env_settings | {"gap_s": str(gap)},
        "later": later,
        "sequential": percentiles(samples["sequential"]),
        "counters": counters,
        "server_spawn_mean_ms": spawn_ms,
        "cpu_s": {
            "wall": round(wall, 1),
            "server": round(server_cpu, 1),
            "clients": round(proc_cpu, 1),
        },
    }
    for width in bursts:
        report[f"burst{width}"] = percentiles(samples[f"burst{width}"])
        report[f"burst{width}_last"] = percentiles(samples[f"burst{width}_last"])
        report[f"burst{width}_later"] = percentiles(samples[f"burst{width}_later"])
    seq_ratio = report["sequential"]["p50_ms"] / later["p50_ms"]
    targets = {"sequential first/later p50": (round(seq_ratio, 2), TARGET_RATIO)}
    for width in bursts:
        ratio = report[f"burst{width}"]["p50_ms"] / report[f"burst{width}_later"]["p50_ms"]
        targets[f"burst{width} first/later p50"] = (round(ratio, 2), TARGET_RATIO)
    if 50 in bursts:
        targets["burst50 p99 ms"] = (report["burst50"]["p99_ms"], TARGET_P99_50_MS)
    report["targets"] = {
        name: {"got": got, "bound": bound, "ok": got <= bound}
        for name, (got, bound) in targets.items()
    }
    return report


def print_table(report: dict[str, Any]) -> None:
    print(report["measure"])
    print(f"{'phase':<18}{'p50':>8}{'p95':>8}{'p99':>8}{'max':>8}{'n':>5}   (ms)")
    for phase, row in report.items():
        if isinstance(row, dict) and "p50_ms" in row:
            cells = "".join(f"{row[k]:>8.1f}" for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms"))
            print(f"{phase:<18}{cells}{row['n']:>5}")
    spawn = report["server_spawn_mean_ms"]
    print(
        "server's mean sandbox start (workspace + sandbox), ms: "
        + ", ".join(f"{k}={v}" for k, v in spawn.items())
    )
    print("cpu seconds: " + ", ".join(f"{k}={v}" for k, v in report["cpu_s"].items()))
    print("pool: " + ", ".join(f"{k}={v:g}" for k, v in report["counters"].items()))
    for name, t in report["targets"].items():
        print(f"  {name:<28} {t['got']:>8} vs {t['bound']:<6} {'OK' if t['ok'] else 'MISS'}")


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--client":
        _client_main(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--bursts", default="10,50", help="burst widths, comma-separated")
    p.add_argument("--gap", type=float, default=1.0, help="seconds between rounds")
    p.add_argument("--mode", choices=("auto", "legacy"), default="auto")
    p.add_argument("--set", action="append", default=[], metavar="SANDBOX_X=value")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--profile", type=Path, help="py-spy's samples of the server (collapsed)")
    args = p.parse_args()
    settings = dict(item.split("=", 1) for item in args.set)
    widths = tuple(int(w) for w in args.bursts.split(",") if w)
    report = run(args.sessions, widths, args.gap, args.mode, settings, args.profile)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
