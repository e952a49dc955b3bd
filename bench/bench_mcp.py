"""End-to-end MCP benchmark: real srt-mcp-server processes, the official mcp client over HTTP.

Two servers with default settings (INFO logging and the access log, as `srt-mcp-server` runs),
one with sandboxes started ahead of need (the default pool) and one without
(SANDBOX_POOL_SIZE=0), measured in the same run, in alternating rounds. Per server and
protocol era (2026-07-28 "modern", and the legacy initialize/session era): `execute_code
echo hi` p50/p95 sequential in one session, the server's CPU per call, warm `run_code
print(1)` p50, `execute_code echo hi` p50 with 100 ms between calls ("paced": an agent
reading each result; back to back, the next sandbox is still starting when the next call
comes), and calls/s with 10 concurrent clients (a session each); then `seq 1 1000000` end to
end and the server's RSS. With --redis, a third server (pool on) mirrors into a real
redis-server.

    .venv/bin/python bench/bench_mcp.py [--calls 300] [--rounds 3] [--redis] [--quiet]
        [--clients 15] [--no-earlier] [--clients-only]

First, what a new client costs (new_clients.py: connect, the first call, later calls, a read,
new clients per second) on our server, the library's floor and srt-mcp-server 0.2, both eras,
against the targets. Then the tables below.

The server's CPU per call is its process's user+system time (/proc/PID/stat) over the
sequential calls, divided by the calls: the spawner, bwrap and the command are not in it
(a pooled sandbox's start is, as it is the server's work: it is done between calls).
"start/exec" are the server's own mean sandbox start (for a pooled one: the hand-over) and
execution duration over the back-to-back echo calls, from its /metrics: less noisy than
end-to-end figures on a shared machine.
Then, on the pool server alone, one client alternating call by call between a session whose
calls find a sandbox started ahead and one whose calls start their own (one MB tighter
memory: never pooled): the pool's effect with everything else equal.
`--quiet` runs the servers at WARNING without the access log.
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
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp_harness import runtime_dir
from new_clients import Target, earlier_server, floor_server, report
from new_clients import measure as measure_clients

TOKEN = "bench-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used (its own threads; not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_metrics(server: Server) -> dict[str, float]:
    """The sums and counts of the sandbox start and execution duration histograms."""
    text = httpx2.get(
        f"http://127.0.0.1:{server.port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    ).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in ("srt_sandbox_spawn_seconds_sum", "srt_execution_duration_seconds_sum",
                    "srt_sandbox_spawn_seconds_count"):  # fmt: skip
            out[name] = float(value)
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(
        self,
        state: Path,
        redis_url: str | None,
        replica: str,
        quiet: bool,
        pool: bool,
        argv: list[str] | None = None,
        **settings: str,
    ) -> None:
        self.port = free_port()
        state.mkdir(mode=0o711)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")},
            "SANDBOX_PORT": str(self.port),
            "SANDBOX_AUTH_TOKEN": TOKEN,
            "SANDBOX_STATE_DIR": str(state),
            "SANDBOX_REPLICA_ID": replica,
            "SANDBOX_RUNTIME_DIR": str(runtime_dir()),
            **settings,
        }
        if not pool:
            env["SANDBOX_POOL_SIZE"] = "0"
        if quiet:  # (default settings otherwise: INFO lines and the access log)
            env["SANDBOX_LOG_LEVEL"] = "WARNING"
            env["SANDBOX_ACCESS_LOG"] = "false"
        if redis_url:
            env["REDIS_URL"] = redis_url
        with open(state / "server.log", "wb") as log:
            self.proc = subprocess.Popen(
                argv or [sys.executable, "-m", "sandbox_runtime.cli"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
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


async def sequential(
    url: str,
    calls: int,
    mode: str,
    pid: int,
    session: str,
    tool: str,
    args: dict[str, Any],
    pause: float = 0.0,
) -> tuple[list[float], float]:
    """Latencies (s) of `calls` sequential calls in one session (`pause` s between them),
    and the server's CPU (s)."""
    times = []
    async with client(url, mode) as c:
        args = {**args, "session": session}
        for _ in range(3):  # (the session's first calls: its workspace, its interpreter)
            await call(c, tool, args)
        cpu = cpu_seconds(pid)
        for _ in range(calls):
            t = time.perf_counter()
            out = await call(c, tool, args)
            times.append(time.perf_counter() - t)
            assert out.get("exit_code", 0) == 0 and out.get("status") != "error", out
            if pause:
                await asyncio.sleep(pause)
        return times, cpu_seconds(pid) - cpu


async def interleaved(
    url: str, mode: str, pairs: int, pause: float
) -> tuple[list[float], list[float]]:
    """On one server, alternating: `execute_code echo hi` in a session whose calls find a
    sandbox started ahead, and in one whose calls start their own (`sandbox_config` one MB
    tighter than the server's memory: such calls never use the pool). Latencies (s) of each."""
    ahead: list[float] = []
    own: list[float] = []
    tag = f"{mode}-{pause}"
    hit = {"command": "echo hi", "session": f"ahead-{tag}"}
    miss = {"command": "echo hi", "session": f"own-{tag}", "sandbox_config": {"memory_mb": 511}}
    async with client(url, mode) as c:
        for _ in range(3):
            await call(c, "execute_code", hit)
            await call(c, "execute_code", miss)
        for i in range(pairs):
            order = ((ahead, hit), (own, miss)) if i % 2 else ((own, miss), (ahead, hit))
            for times, args in order:
                await asyncio.sleep(pause)
                t = time.perf_counter()
                await call(c, "execute_code", args)
                times.append(time.perf_counter() - t)
    return ahead, own


async def concurrent(url: str, mode: str, clients: int, seconds: float) -> float:
    """calls/s of `execute_code echo hi` with `clients` clients, a session each."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        nonlocal done
        args = {"command": "echo hi", "session": f"client-{mode}-{i}"}
        async with client(url, mode) as c:
            await call(c, "execute_code", args)
            while time.perf_counter() < stop:
                out = await call(c, "execute_code", args)
                assert out["exit_code"] == 0
                done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    return done / (time.perf_counter() - started)


async def bench_seq(url: str) -> tuple[float, int]:
    async with client(url) as c:
        t = time.perf_counter()
        out = await call(c, "execute_code_async", {"command": "seq 1 1000000"})
        execution_id = out["execution_id"]
        cursor, size = "0", 0
        while True:
            page = await call(
                c,
                "get_execution_output",
                {"execution_id": execution_id, "last_event_id": cursor, "wait": True},
            )
            for event in page["output"]:
                if event["type"] == "stdout":
                    size += len(event["data"])
            cursor = page["next_cursor"]
            if page["status"] != "running" and not page["has_more"]:
                break
        return time.perf_counter() - t, size


ECHO = ("execute_code", {"command": "echo hi"})
RUN_CODE = ("run_code", {"code": "print(1)"})
MODES = ("modern", "legacy")
PAUSE = 0.1  # between paced calls: an agent reading a result before its next call


async def measure(
    servers: dict[str, Server], calls: int, rounds: int
) -> tuple[dict[tuple[str, str], Any], dict[tuple[str, float], tuple[float, float]]]:
    """Every server, both eras, in alternating rounds: the figures of each (label, era)."""
    echo: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], float] = {}
    code: dict[tuple[str, str], list[float]] = {}
    paced: dict[tuple[str, str], list[float]] = {}
    sums: dict[tuple[str, str], dict[str, float]] = {}  # the server's own histograms
    same: dict[tuple[str, float], tuple[float, float]] = {}  # on the pool server: ahead, own
    per_round = max(1, calls // rounds)
    # On a server of its own: its sessions must not take the pool's places from the others'
    # (a full pool gives a new session's sandbox a place once another has waited 10 s).
    for mode in MODES:
        era = "auto" if mode == "modern" else "legacy"
        for pause in (0.0, PAUSE):
            ahead, own = await interleaved(servers["pool A/B"].url, era, calls // 4, pause)
            same[(mode, pause)] = (statistics.median(ahead) * 1000, statistics.median(own) * 1000)
    servers = {label: s for label, s in servers.items() if label != "pool A/B"}
    for _ in range(rounds):
        for label, server in servers.items():
            for mode in MODES:
                key = (label, mode)
                era = "auto" if mode == "modern" else "legacy"
                before = server_metrics(server)
                times, used = await sequential(
                    server.url, per_round, era, server.proc.pid, f"echo-{mode}", *ECHO
                )
                after = server_metrics(server)
                echo.setdefault(key, []).extend(times)
                cpu[key] = cpu.get(key, 0.0) + used
                for name, value in after.items():
                    sums.setdefault(key, {}).setdefault(name, 0.0)
                    sums[key][name] += value - before.get(name, 0.0)
                times, _ = await sequential(
                    server.url, per_round // 2, era, server.proc.pid, f"code-{mode}", *RUN_CODE
                )
                code.setdefault(key, []).extend(times)
                times, _ = await sequential(
                    server.url, per_round // 4, era, server.proc.pid, f"paced-{mode}", *ECHO,
                    pause=PAUSE,
                )  # fmt: skip
                paced.setdefault(key, []).extend(times)
    cps: dict[tuple[str, str], float] = {}
    for label, server in servers.items():
        for mode in MODES:
            era = "auto" if mode == "modern" else "legacy"
            cps[(label, mode)] = await concurrent(server.url, era, 10, 8.0)
    rows: dict[tuple[str, str], Any] = {}
    for key, times in echo.items():
        rows[key] = {
            "p50": statistics.median(times) * 1000,
            "p95": pct(times, 0.95) * 1000,
            "cpu": cpu[key] / len(times) * 1000,
            "code_p50": statistics.median(code[key]) * 1000,
            "paced_p50": statistics.median(paced[key]) * 1000,
            "spawn": sums[key]["srt_sandbox_spawn_seconds_sum"]
            / sums[key]["srt_sandbox_spawn_seconds_count"]
            * 1000,
            "duration": sums[key]["srt_execution_duration_seconds_sum"]
            / sums[key]["srt_sandbox_spawn_seconds_count"]
            * 1000,
            "cps": cps[key],
        }
    return rows, same


def new_client_table(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="srt-bench-") as tmp, ExitStack() as stack:
        os.chmod(tmp, 0o711)
        ours = Server(Path(tmp) / "n", None, "bench-n", args.quiet, pool=True)
        stack.callback(ours.stop)
        targets = {
            "ours": Target(ours.url, TOKEN, ECHO, ("list_executions", {})),
            "floor": stack.enter_context(floor_server(TOKEN)),
            "lowlevel": stack.enter_context(floor_server(TOKEN, lowlevel=True)),
        }
        if not args.no_earlier:
            work = Path(tmp) / "earlier"
            work.mkdir()
            targets["earlier"] = stack.enter_context(
                earlier_server(Path(args.earlier_venv), TOKEN, work)
            )
        rows = asyncio.run(measure_clients(targets, args.clients, args.rounds, args.churn_seconds))
    report(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300, help="sequential calls per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis", action="store_true", help="also a server mirroring to Redis")
    parser.add_argument("--quiet", action="store_true", help="servers at WARNING, no access log")
    parser.add_argument("--clients", type=int, default=15, help="new clients per server and era")
    parser.add_argument("--churn-seconds", type=float, default=6.0)
    parser.add_argument("--no-earlier", action="store_true", help="without srt-mcp-server 0.2")
    parser.add_argument(
        "--earlier-venv", default=str(Path(tempfile.gettempdir()) / "srt-compat-02" / "ref")
    )
    parser.add_argument("--clients-only", action="store_true", help="only the new-client table")
    args = parser.parse_args()
    new_client_table(args)
    if args.clients_only:
        return
    with tempfile.TemporaryDirectory(prefix="srt-bench-") as tmp:
        os.chmod(tmp, 0o711)
        redis_proc = None
        servers: dict[str, Server] = {}
        try:
            servers["pool"] = Server(Path(tmp) / "a", None, "bench-a", args.quiet, pool=True)
            servers["no pool"] = Server(Path(tmp) / "b", None, "bench-b", args.quiet, pool=False)
            servers["pool A/B"] = Server(Path(tmp) / "d", None, "bench-d", args.quiet, pool=True)
            if args.redis:
                port = free_port()
                redis_proc = subprocess.Popen(
                    [shutil.which("redis-server") or "redis-server", "--port", str(port),
                     "--save", "", "--appendonly", "no"],
                    stdout=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(0.3)
                url = f"redis://127.0.0.1:{port}/0"
                servers["pool+redis"] = Server(Path(tmp) / "c", url, "bench-c", args.quiet, True)
            rss_before = {
                label: rss_mb(s.proc.pid) for label, s in servers.items() if label != "pool A/B"
            }
            rows, same = asyncio.run(measure(servers, args.calls, args.rounds))
            seq = {label: asyncio.run(bench_seq(servers[label].url)) for label in rss_before}
            rss_after = {label: rss_mb(servers[label].proc.pid) for label in rss_before}
        finally:
            for server in servers.values():
                server.stop()
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait()
    expected = len("".join(f"{i}\n" for i in range(1, 1_000_001)))
    logging = "WARNING, no access log" if args.quiet else "default (INFO and access log)"
    print(f"\nexecute_code echo / run_code print(1), {args.calls} sequential calls per row "
          f"in {args.rounds} alternating rounds; logging {logging}")  # fmt: skip
    print(
        f"{'server':<11} {'era':<7} {'echo p50 ms':>11} {'p95':>6} {'server CPU ms/call':>18} "
        f"{'10 clients calls/s':>18} {'run_code p50 ms':>15} {'paced echo p50':>14} "
        f"{'start/exec ms':>13}"
    )
    for (label, mode), r in rows.items():
        print(
            f"{label:<11} {mode:<7} {r['p50']:>11.1f} {r['p95']:>6.1f} {r['cpu']:>18.2f} "
            f"{r['cps']:>18.0f} {r['code_p50']:>15.1f} {r['paced_p50']:>14.1f} "
            f"{r['spawn']:>6.2f}/{r['duration']:<6.2f}"
        )
    print(
        "\na third server (pool), one client alternating between a session whose calls find "
        "a sandbox started ahead and one whose calls start their own:"
    )
    for (mode, pause), (ahead, own) in same.items():
        print(
            f"  {mode:<7} {int(pause * 1000):>3} ms between calls: echo p50 {ahead:5.1f} ms "
            f"started ahead, {own:5.1f} ms own sandbox ({ahead / own:.2f})"
        )
    print(f"\n{'server':<11} {'seq 1e6 s':>9} {'RSS MB before -> after':>24}")
    for label in rss_before:
        seconds, size = seq[label]
        print(
            f"{label:<11} {seconds:>9.2f} {rss_before[label]:>12.1f} -> {rss_after[label]:<8.1f}"
            f"{'' if size == expected else ' SEQ OUTPUT WRONG'}"
        )
    pool = [rows[("pool", m)] for m in MODES]
    base = [rows[("no pool", m)] for m in MODES]

    def ratios(field: str) -> str:
        return ", ".join(f"{p[field] / b[field]:.2f}" for p, b in zip(pool, base, strict=True))

    print(
        f"\npool / no pool (modern, legacy): echo p50 {ratios('p50')}; server CPU per call "
        f"{ratios('cpu')}; paced echo p50 {ratios('paced_p50')}; sandbox start "
        f"{ratios('spawn')}; execution {ratios('duration')}"
    )
    worst = {
        "p50": max(p["p50"] for p in pool),
        "cps": min(p["cps"] for p in pool),
        "cpu": max(p["cpu"] for p in pool),
        "code": max(p["code_p50"] for p in pool),
    }
    print(
        "targets (2 cores, pool, both eras): echo p50 <= 10 ms "
        f"{'OK' if worst['p50'] <= 10 else 'MISS'}, >= 120 calls/s with 10 clients "
        f"{'OK' if worst['cps'] >= 120 else 'MISS'}, server CPU <= 4 ms/call "
        f"{'OK' if worst['cpu'] <= 4 else 'MISS'}, run_code p50 <= 6 ms "
        f"{'OK' if worst['code'] <= 6 else 'MISS'}"
    )


if __name__ == "__main__":
    main()
