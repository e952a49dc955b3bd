"""Issue 47's one table: every figure it names, measured in one run, against its target.

    SRT_TEST_RUNTIME_DIR=/work/main/.runtime .venv/bin/python bench/bench_perf.py
        [--only echo,clients,bursts,egress,hosted,unit] [--quick] [--json PATH] [--no-earlier]

Parts (each starts the servers it needs and stops them; `--only` runs some):

- echo: `execute_code echo hi` p50, sequential in one session, on our server, on the library's
  floor (floor_server.py: FastMCP and one no-op tool) and on srt-mcp-server 0.2 (from PyPI in a
  venv of its own, new_clients.ensure_earlier; it needs rg and socat on the host); both eras
  for ours and the floor, 0.2 in the legacy era its users speak;
- clients: 10 workers, each over and over opening a new client, making 5 calls in a session
  of its own and leaving (new_clients.churn): calls/s, ours and the floor's;
- bursts: 100 new sessions' first calls, one after another, then in bursts of 10 and of 50
  (concurrent, each from a client connected before: the computesdk shape, create -> first
  command), p50/p95/p99, against the same sessions' next call made the same way (the server
  with SANDBOX_MAX_CONCURRENT=50: by default it runs 16 at once and refuses the rest);
- egress: `execute_code echo hi` p50 on a server whose sandboxes have egress
  (SANDBOX_EGRESS_ALLOW set: the in-sandbox relay and the proxy socket) against one without;
- hosted: a Python hosted server (hosted_servers.py's `time`): a new principal's first call
  (cold start) and the warm call's overhead over the same program on stdio;
- unit: `pytest -m unit -q`, timed.

Each part is a `measure_*(opts) -> dict` of raw figures and a `rows_*(figures) -> list[Row]`;
a part measured elsewhere (bench_bursts.run, bench_egress.run, ...) is swapped in by changing
its entry in PARTS. `--quick` takes fewer samples (a smoke run: the figures are noisier).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from bench_mcp import TOKEN, Server  # noqa: E402
from new_clients import MODES, Target, _call, _client, churn, earlier_server, floor_server  # noqa: E402

ECHO = ("execute_code", {"command": "echo hi"})
Row = dict[str, Any]  # measure, value, target, met (None: no target, a reference figure)


def row(measure: str, value: float, unit: str, target: str = "", met: bool | None = None) -> Row:
    if value != value:  # (NaN: not measured; the part's figures say why)
        return {"measure": measure, "value": "n/a", "raw": None, "target": target, "met": None}
    text = f"{value:.1f} {unit}".strip()
    return {"measure": measure, "value": text, "raw": value, "target": target, "met": met}


@contextmanager
def without_env(name: str) -> Iterator[None]:
    """`name` out of os.environ meanwhile: 0.2's venv must import its own sandbox_runtime,
    not the one a PYTHONPATH (a worktree's) puts first."""
    kept = os.environ.pop(name, None)
    try:
        yield
    finally:
        if kept is not None:
            os.environ[name] = kept


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) in ms."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


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


# -- echo: ours, the floor, 0.2 ----------------------------------------------------------------


def measure_echo(opts: argparse.Namespace) -> dict[str, Any]:
    calls = 30 if opts.quick else 150
    out: dict[str, Any] = {"calls": calls}
    with tempfile.TemporaryDirectory(prefix="srt-perf-") as tmp, ExitStack() as stack:
        os.chmod(tmp, 0o711)
        server = ours(Path(tmp), "echo")
        stack.callback(server.stop)
        targets = {
            "ours": Target(server.url, TOKEN, ECHO, ("list_executions", {})),
            "floor": stack.enter_context(floor_server(TOKEN)),
        }
        if not opts.no_earlier:
            work = Path(tmp) / "earlier"
            work.mkdir()
            try:
                with without_env("PYTHONPATH"):
                    started = earlier_server(Path(opts.earlier_venv), TOKEN, work)
                    targets["earlier"] = stack.enter_context(started)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                out["earlier_error"] = f"{type(exc).__name__}: {exc}"
        for label, target in targets.items():
            for era, mode in MODES.items():
                if label == "earlier" and era != "legacy":
                    continue
                n = max(5, calls // 10) if label == "earlier" else calls  # (0.2: ~0.6 s a call)
                try:
                    times = asyncio.run(sequential(target, mode, n, f"echo-{era}"))
                except Exception as exc:  # (a server that cannot answer: its row says so)
                    out[f"{label}_{era}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                out[f"{label}_{era}_p50_ms"] = p50(times)
                out[f"{label}_{era}_p95_ms"] = pct(times, 0.95)
    return out


def rows_echo(f: dict[str, Any]) -> list[Row]:
    nan = float("nan")
    rows = []
    for era in MODES:
        mine, floor = f.get(f"ours_{era}_p50_ms", nan), f.get(f"floor_{era}_p50_ms", nan)
        rows.append(row(f"echo p50, ours ({era})", mine, "ms"))
        rows.append(row(f"no-op p50, the floor ({era})", floor, "ms"))
        ratio = mine / floor
        rows.append(row(f"echo / floor no-op ({era})", ratio, "x", "<= 1.5x", ratio <= 1.5))
    earlier = f.get("earlier_legacy_p50_ms", nan)
    rows.append(row("echo p50, srt-mcp-server 0.2 (legacy)", earlier, "ms"))
    if "earlier_error" in f:
        rows[-1]["value"] = "did not start"
    speedup = earlier / f.get("ours_legacy_p50_ms", nan)
    rows.append(row("echo, 0.2 / ours (legacy)", speedup, "x", ">= 60x", speedup >= 60))
    return rows


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


# -- bursts: new sessions' first calls ---------------------------------------------------------


async def _bursts(url: str, mode: str, size: int, total: int, pause: float) -> dict[str, Any]:
    """`total` new sessions in bursts of `size` (1: one after another), each first call from a
    client connected before; then each session's next call, made the same way: latencies (s)."""
    target = Target(url, TOKEN, ECHO, ("list_executions", {}))
    first: list[float] = []
    later: list[float] = []
    async with AsyncExitStack() as stack:
        clients = []
        for _ in range(size):
            http, client = _client(target, mode)
            await stack.enter_async_context(http)
            c = await stack.enter_async_context(client)
            await c.list_tools()
            await _call(c, ("execute_code", {"command": "true", "session": "perf-warm"}))
            clients.append(c)

        async def timed(c: Any, session: str, into: list[float]) -> None:
            began = time.perf_counter()
            await _call(c, ("execute_code", {"command": "echo hi", "session": session}))
            into.append(time.perf_counter() - began)

        for _ in range(total // size):
            sessions = [f"burst-{size}-{uuid.uuid4().hex[:12]}" for _ in clients]
            await asyncio.gather(
                *(timed(c, s, first) for c, s in zip(clients, sessions, strict=True))
            )
            await asyncio.gather(
                *(timed(c, s, later) for c, s in zip(clients, sessions, strict=True))
            )
            if pause:
                await asyncio.sleep(pause)
    return {"first": first, "later": later}


BURSTS = (1, 10, 50)


def measure_bursts(opts: argparse.Namespace) -> dict[str, Any]:
    total = 50 if opts.quick else 100
    pause = 2.0  # (between bursts: an eval harness's next fan-out comes after a while)
    out: dict[str, Any] = {
        "sessions": total,
        "pause_s": pause,
        "era": "legacy",
        "max_concurrent": max(BURSTS),
    }
    with tempfile.TemporaryDirectory(prefix="srt-perf-") as tmp:
        os.chmod(tmp, 0o711)
        # (16 executions at once by default: a burst of 50 needs room for 50)
        server = ours(Path(tmp), "bursts", SANDBOX_MAX_CONCURRENT=str(max(BURSTS)))
        try:
            for size in BURSTS:
                got = asyncio.run(
                    _bursts(server.url, "legacy", size, total, 0 if size == 1 else pause)
                )
                out[str(size)] = {
                    key: {"p50": pct(v, 0.5), "p95": pct(v, 0.95), "p99": pct(v, 0.99), "n": len(v)}
                    for key, v in got.items()
                }
        finally:
            server.stop()
    return out


def rows_bursts(f: dict[str, Any]) -> list[Row]:
    rows = []
    for size in BURSTS:
        got = f[str(size)]
        first, later = got["first"], got["later"]
        shape = "one after another" if size == 1 else f"bursts of {size}"
        rows.append(row(f"new session's first call, {shape}: p50", first["p50"], "ms"))
        rows.append(
            row(
                "  p95 / p99",
                first["p95"],
                f"/ {first['p99']:.1f} ms",
                "<= 300 ms p99" if size == 50 else "",
                first["p99"] <= 300 if size == 50 else None,
            )
        )
        ratio = first["p50"] / later["p50"]
        target = size in (1, 10)
        rows.append(
            row(
                f"  first / next call p50 ({later['p50']:.1f} ms)",
                ratio,
                "x",
                "<= 1.2x" if target else "",
                ratio <= 1.2 if target else None,
            )
        )
    return rows


# -- egress on vs off --------------------------------------------------------------------------


def measure_egress(opts: argparse.Namespace) -> dict[str, Any]:
    calls = 30 if opts.quick else 100
    out: dict[str, Any] = {"calls": calls}
    with tempfile.TemporaryDirectory(prefix="srt-perf-") as tmp, ExitStack() as stack:
        os.chmod(tmp, 0o711)
        servers = {
            "off": ours(Path(tmp), "egress-off"),
            "on": ours(Path(tmp), "egress-on", SANDBOX_EGRESS_ALLOW="allowed.test"),
        }
        for server in servers.values():
            stack.callback(server.stop)
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(2):  # (alternating rounds: the machine's phases fall on both)
            for label, server in servers.items():
                target = Target(server.url, TOKEN, ECHO, ("list_executions", {}))
                times[label] += asyncio.run(sequential(target, "legacy", calls // 2, "egress"))
        for label, values in times.items():
            out[f"{label}_p50_ms"] = p50(values)
            out[f"{label}_p95_ms"] = pct(values, 0.95)
    return out


def rows_egress(f: dict[str, Any]) -> list[Row]:
    ratio = f["on_p50_ms"] / f["off_p50_ms"]
    return [
        row("echo p50, egress off", f["off_p50_ms"], "ms"),
        row("echo p50, egress on", f["on_p50_ms"], "ms"),
        row("egress on / off", ratio, "x", "<= 1.3x", ratio <= 1.3),
    ]


# -- hosted: a Python server's cold start and warm overhead ------------------------------------


def measure_hosted(opts: argparse.Namespace) -> dict[str, Any]:
    import hosted_servers as hs

    name = "time"
    package, extra, tool, args, _ = hs.SERVERS[name]
    calls, colds = (40, 3) if opts.quick else (200, 5)
    state = Path(opts.hosted_state)
    state.mkdir(parents=True, exist_ok=True)
    env = hs.env_for(state, 0)
    cli = [*hs.CLI, "servers"]
    subprocess.run(
        [*cli, "add", name, package, "--replace", *extra], env=env, check=True, capture_output=True
    )
    done = subprocess.run([*cli, "install"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"servers install failed: {done.stdout}{done.stderr}"[-2000:])

    async def run() -> dict[str, Any]:
        async with hs.serving(state) as base:
            url = f"{base}/servers/{name}/mcp"
            cold = [await hs.cold(url, hs.token(1 + i), tool, args) for i in range(colds)]
            warm = await hs.through_us(url, hs.token(0), tool, args, calls)
            direct_cold, direct = await hs.direct(state, name, tool, args, calls)
        return {
            "cold_p50_ms": p50(cold),
            "cold_max_ms": max(cold) * 1000,
            "direct_cold_ms": direct_cold * 1000,
            "warm_p50_ms": p50(warm),
            "direct_p50_ms": p50(direct),
            "overhead_ms": p50(warm) - p50(direct),
        }

    return {"server": name, **asyncio.run(run())}


def rows_hosted(f: dict[str, Any]) -> list[Row]:
    return [
        row(f"hosted {f['server']}: warm p50 through us", f["warm_p50_ms"], "ms"),
        row("  the same program over stdio, p50", f["direct_p50_ms"], "ms"),
        row("  warm overhead", f["overhead_ms"], "ms", "<= 2 ms", f["overhead_ms"] <= 2),
        row(
            f"hosted {f['server']} (Python): cold start p50",
            f["cold_p50_ms"],
            "ms",
            "<= 1000 ms",
            f["cold_p50_ms"] <= 1000,
        ),
        row("  its own start on the host over stdio", f["direct_cold_ms"], "ms"),
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
