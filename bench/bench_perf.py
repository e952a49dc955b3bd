"""Issue 47's one table: every figure it names, measured in one run, against its target.

    SRT_TEST_RUNTIME_DIR=/work/main/.runtime .venv/bin/python bench/bench_perf.py
        [--only echo,clients,bursts,egress,hosted,unit] [--quick] [--json PATH] [--no-earlier]

Parts (each starts the servers it needs and stops them; `--only` runs some). Where a bench of
its own measures a part, the part calls that bench's `run()` (or its `measure()`) and only
puts its figures in rows:

- echo (bench_dispatch.run): `execute_code echo hi` p50, sequential in one session, on our
  server with default settings (its fast dispatch path on, and off: "without the fast path"),
  against the library's floor (floor_server.py: FastMCP and one no-op tool), the SDK's
  low-level server's no-op, and srt-mcp-server 0.2 (from PyPI in a venv of its own,
  new_clients.ensure_earlier; it needs rg and socat on the host), in alternating rounds, both
  eras;
- clients: 10 workers, each over and over opening a new client, making 5 calls in a session
  of its own and leaving (new_clients.churn): calls/s, ours and the floor's;
- bursts (bench_bursts.run): 100 new sessions' first calls, one after another, then in bursts
  of 10 and of 50 (concurrent, each from a client connected before: the computesdk shape,
  create -> first command), p50/p95/p99, against a later call in a session and the bursts'
  sessions' second calls; the clients in a process of their own, the server with its
  defaults but SANDBOX_MAX_CONCURRENT and the per-principal mount cap (a burst of 50 would hit
  both);
- egress (bench_egress_start.run): `execute_code echo hi` p50 with egress on (the in-sandbox
  relay and a proxy socket) and with `network: false`, warm sessions taking turns on one
  server with the network lab's origin allowed; how many calls a pooled sandbox served;
- hosted (hosted_servers.measure): the Python `time` server: a new principal's first call
  (cold start, without `warm`), a `warm = 1` entry's first call from a new client, and the
  warm call's overhead over the same program on stdio;
- unit: `pytest -m unit -q`, timed.

Each part is a `measure_*(opts) -> dict` of raw figures and a `rows_*(figures) -> list[Row]`.
`--quick` takes fewer samples (a smoke run: the figures are noisier).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from bench_mcp import TOKEN, Server  # noqa: E402
from new_clients import MODES, Target, _call, _client, churn, floor_server  # noqa: E402

ECHO = ("execute_code", {"command": "echo hi"})
Row = dict[str, Any]  # measure, value, target, met (None: no target, a reference figure)


def row(measure: str, value: float, unit: str, target: str = "", met: bool | None = None) -> Row:
    if value != value:  # (NaN: not measured; the part's figures say why)
        return {"measure": measure, "value": "n/a", "raw": None, "target": target, "met": None}
    text = f"{value:.{2 if unit == 'x' else 1}f} {unit}".strip()  # (ratios near 1.2x, 1.3x)
    return {"measure": measure, "value": text, "raw": value, "target": target, "met": met}


def ours(tmp: Path, name: str, quiet: bool = False, **settings: str) -> Server:
    """Our server with default settings (pool on), plus `settings`."""
    return Server(tmp / name, None, f"perf-{name}", quiet, pool=True, **settings)


async def sequential(target: Target, mode: str, calls: int, session: str | None) -> list[float]:
    """Latencies (s) of `calls` calls in one client (and session), after 3 not counted."""
    name, args = target.call
    tool = (name, {**args, "session": session}) if session and target.sessions else target.call
    http, client = _client(target, mode)
    times = []
    async with http, client as c:
        for _ in range(3):
            await _call(c, tool)
        for _ in range(calls):
            began = time.perf_counter()
            await _call(c, tool)
            times.append(time.perf_counter() - began)
    return times


# -- echo: ours, the floor, 0.2 (bench_dispatch.run) ---------------------------------------------


def measure_echo(opts: argparse.Namespace) -> dict[str, Any]:
    import bench_dispatch

    calls, rounds = (30, 2) if opts.quick else (150, 3)
    out: dict[str, Any] = {"calls": calls, "rounds": rounds}
    # (ours with default settings: INFO logging and the access log, as bench_mcp.Server runs
    # it; 0.2 from its own venv, PYTHONPATH dropped for it by new_clients.earlier_server)
    venv = Path(opts.earlier_venv)
    out.update(bench_dispatch.run(calls, rounds, not opts.no_earlier, False, venv))
    return out


def rows_echo(f: dict[str, Any]) -> list[Row]:
    nan = float("nan")
    p50s, rows = f["p50"], []
    for era in bench_dispatch_eras():
        mine = p50s["after"][era]
        floor = p50s["floor"][era]
        rows.append(row(f"echo p50, ours ({era})", mine, "ms"))
        rows.append(row(f"  without the fast path ({era})", p50s["before"][era], "ms"))
        rows.append(row(f"no-op p50, the floor: FastMCP ({era})", floor, "ms"))
        rows.append(row(f"  the SDK's low-level server ({era})", p50s["lowlevel"][era], "ms"))
        ratio = mine / floor
        rows.append(row(f"echo / floor no-op ({era})", ratio, "x", "<= 1.5x", ratio <= 1.5))
    for era in bench_dispatch_eras():
        earlier = p50s.get("earlier", {}).get(era, nan)
        rows.append(row(f"echo p50, srt-mcp-server 0.2 ({era})", earlier, "ms"))
        speedup = earlier / p50s["after"][era]
        rows.append(row(f"echo, 0.2 / ours ({era})", speedup, "x", ">= 60x", speedup >= 60))
    return rows


def bench_dispatch_eras() -> list[str]:
    import bench_dispatch

    return list(bench_dispatch.ERAS)


# -- clients: 10 new clients x 5 calls, a session each -----------------------------------------


def measure_clients(opts: argparse.Namespace) -> dict[str, Any]:
    seconds = 3.0 if opts.quick else 8.0
    out: dict[str, Any] = {"seconds": seconds}
    with tempfile.TemporaryDirectory(prefix="srt-perf-") as tmp, ExitStack() as stack:
        os.chmod(tmp, 0o711)
        server = ours(Path(tmp), "clients")
        stack.callback(server.stop)
        targets = {
            "ours": Target(server.url, TOKEN, ECHO, ("list_executions", {})),
            "floor": stack.enter_context(floor_server(TOKEN)),
        }
        for label, target in targets.items():
            for era, mode in MODES.items():
                asyncio.run(sequential(target, mode, 1, f"warm-{era}"))  # (imports, the pool)
                out[f"{label}_{era}_cps"] = asyncio.run(churn(target, mode, 10, seconds))
    return out


def rows_clients(f: dict[str, Any]) -> list[Row]:
    rows = []
    for era in MODES:
        cps = f[f"ours_{era}_cps"]
        rows.append(
            row(f"10 new clients x 5 calls, ours ({era})", cps, "calls/s", ">= 120", cps >= 120)
        )
        rows.append(
            row(f"10 new clients x 5 no-ops, the floor ({era})", f[f"floor_{era}_cps"], "calls/s")
        )
    return rows


# -- bursts: new sessions' first calls (bench_bursts.run) -------------------------------------

BURSTS = (10, 50)


def measure_bursts(opts: argparse.Namespace) -> dict[str, Any]:
    import bench_bursts

    # (the server's defaults but SANDBOX_MAX_CONCURRENT and the per-principal mount cap, which
    # a burst of 50 would hit; the clients in a process of their own; 2026-07-28 era)
    sessions = 50 if opts.quick else 100
    return bench_bursts.run(sessions, BURSTS, gap=1.0, mode="auto")


def rows_bursts(f: dict[str, Any]) -> list[Row]:
    later = f["later"]
    rows = [row("a later call in a session, p50 (2026-07-28)", later["p50_ms"], "ms")]
    phases = [("sequential", "one after another", "later")]
    phases += [(f"burst{w}", f"in bursts of {w}", f"burst{w}_later") for w in BURSTS]
    for phase, shape, next_ in phases:
        first, second = f[phase], f[next_]
        n = first["n"]
        rows.append(row(f"{n} new sessions' first call, {shape}: p50", first["p50_ms"], "ms"))
        p99_target = phase == "burst50"
        rows.append(
            row(
                "  p95 / p99",
                first["p95_ms"],
                f"/ {first['p99_ms']:.1f} ms",
                "p99 <= 300 ms" if p99_target else "",
                first["p99_ms"] <= 300 if p99_target else None,
            )
        )
        ratio = first["p50_ms"] / second["p50_ms"]
        what = "a later call" if phase == "sequential" else "the burst's second calls"
        has_target = phase != "burst50"
        rows.append(
            row(
                f"  first / {what} p50 ({second['p50_ms']:.1f} ms)",
                ratio,
                "x",
                "<= 1.2x" if has_target else "",
                ratio <= 1.2 if has_target else None,
            )
        )
    return rows


# -- egress on vs off (bench_egress_start.run) ---------------------------------------------------


def measure_egress(opts: argparse.Namespace) -> dict[str, Any]:
    import bench_egress_start

    # (one server with egress; `network: false` and egress-on sessions take turns, each
    # warm, so the pool starts their sandboxes ahead: counted in `pooled`)
    return bench_egress_start.run(20 if opts.quick else 60)


def rows_egress(f: dict[str, Any]) -> list[Row]:
    calls = f["calls"]
    ratio = f["ratio_on_off"]

    def pooled(kind: str) -> str:
        return f"ms, {f[kind]['pooled']}/{calls} pooled"

    return [
        row("echo p50, network off (a warm session)", f["off"]["p50"], pooled("off")),
        row("echo p50, egress on (relay + proxy socket)", f["on"]["p50"], pooled("on")),
        row("egress on / off", ratio, "x", "<= 1.3x", ratio <= 1.3),
        row("  curl of a page through the proxy, p50", f["http"]["p50"], "ms"),
    ]


# -- hosted: a Python server's cold start and warm overhead (hosted_servers.measure) -----------


def measure_hosted(opts: argparse.Namespace) -> dict[str, Any]:
    import hosted_servers as hs

    calls, colds = (40, 3) if opts.quick else (200, 5)
    state = Path(opts.hosted_state)
    state.mkdir(parents=True, exist_ok=True)
    # hosted_servers.run installs its Node servers too; the table asks for the Python one: the
    # time server, and the same as `time-warm` (shared, warm = 1)
    env = hs.env_for(state, 0)
    package, extra, *_ = hs.SERVERS["time"]
    for name, args in (("time", extra), (hs.WARM, ["--scope=shared", "--warm=1"])):
        subprocess.run(
            [*hs.CLI, "servers", "add", name, package, "--replace", *args],
            env=env,
            check=True,
            capture_output=True,
        )
    done = subprocess.run([*hs.CLI, "servers", "install"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"servers install failed: {done.stdout}{done.stderr}"[-2000:])
    return asyncio.run(hs.measure(state, calls, colds, ["time"]))


def rows_hosted(f: dict[str, Any]) -> list[Row]:
    t = f["servers"]["time"]
    overhead = t["overhead_p50_ms"]
    return [
        row("hosted time: warm p50 through us", t["warm_p50_ms"], "ms"),
        row("  the same program over stdio, p50", t["direct_p50_ms"], "ms"),
        row("  warm overhead", overhead, "ms", "<= 2 ms", overhead <= 2),
        row("  the HTTP floor's no-op, p50", f["floor_p50_ms"], "ms"),
        row(
            "hosted time (Python): cold start p50, without warm",
            t["cold_p50_ms"],
            "ms",
            "<= 1000 ms",
            t["cold_p50_ms"] <= 1000,
        ),
        row(
            "  with warm = 1: a new client's first call",
            f["warm_entry_first_call_p50_ms"],
            "ms",
            "<= 1000 ms",
            f["warm_entry_first_call_p50_ms"] <= 1000,
        ),
        row("  its own start on the host over stdio", t["direct_cold_ms"], "ms"),
    ]


# -- unit: the developers' loop ----------------------------------------------------------------


def measure_unit(opts: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-m", "unit", "-q", "-p", "no:cacheprovider"]
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    passed = re.search(r"(\d+) passed", tail)
    return {
        "seconds": seconds,
        "passed": int(passed.group(1)) if passed else 0,
        "exit": done.returncode,
        "summary": tail,
    }


def rows_unit(f: dict[str, Any]) -> list[Row]:
    ok = f["exit"] == 0
    r = row(
        f"pytest -m unit ({f['passed']} tests{'' if ok else ', FAILED'})",
        f["seconds"],
        "s",
        "<= 30 s",
        ok and f["seconds"] <= 30,
    )
    return [r]


# -- the table ---------------------------------------------------------------------------------

PARTS: dict[
    str, tuple[Callable[[argparse.Namespace], dict[str, Any]], Callable[..., list[Row]]]
] = {
    "echo": (measure_echo, rows_echo),
    "clients": (measure_clients, rows_clients),
    "bursts": (measure_bursts, rows_bursts),
    "egress": (measure_egress, rows_egress),
    "hosted": (measure_hosted, rows_hosted),
    "unit": (measure_unit, rows_unit),
}


def print_table(rows: list[Row]) -> None:
    width = max(len(r["measure"]) for r in rows)
    head = f"{'measure':<{width}}  {'value':>20}  {'target':<14}  met?"
    print(f"\n{head}\n{'-' * len(head)}")
    for r in rows:
        met = {True: "yes", False: "NO", None: ""}[r["met"]]
        print(f"{r['measure']:<{width}}  {r['value']:>20}  {r['target']:<14}  {met}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help="parts, comma-separated")
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke run")
    parser.add_argument("--json", type=Path, help="also write the figures and rows here")
    parser.add_argument("--no-earlier", action="store_true", help="without srt-mcp-server 0.2")
    parser.add_argument(
        "--earlier-venv", default=str(Path(tempfile.gettempdir()) / "srt-compat-02" / "ref")
    )
    parser.add_argument(
        "--hosted-state", default=str(Path(tempfile.gettempdir()) / "srt-bench-perf-hosted")
    )
    opts = parser.parse_args()
    parts = [p.strip() for p in opts.only.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    figures: dict[str, Any] = {}
    rows: list[Row] = []
    started = time.time()
    for part in parts:
        measure, to_rows = PARTS[part]
        print(f"[{part}] measuring ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        try:
            figures[part] = measure(opts)
            rows += to_rows(figures[part])
        except Exception as exc:  # (one part failing leaves the others' rows)
            figures[part] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            rows.append(
                {
                    "measure": f"{part}: FAILED ({type(exc).__name__})",
                    "value": "n/a",
                    "raw": None,
                    "target": "",
                    "met": False,
                }
            )
            print(f"[{part}] failed: {figures[part]['error']}", file=sys.stderr)
        print(f"[{part}] {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    print_table(rows)
    print(f"\n(2 cores; {'--quick, ' if opts.quick else ''}{time.time() - started:.0f} s in all)")
    if opts.json:
        opts.json.write_text(json.dumps({"figures": figures, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
