"""run_code through the official MCP client against a real server: warm calls, first calls of
new sessions with and without the warm pool, and the host memory of an idle interpreter.

    .venv/bin/python bench/bench_interpreters.py [--calls 200] [--sessions 10]

Targets (2 cores): warm `print(1)` p50 <= 10 ms; a new session's first call <= 300 ms with
the pool.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mcp_harness import ServerProcess, open_client, proc_cmdline, process_tree, running_server

TOKEN = "bench-interpreters-token"
SETTINGS = {"SANDBOX_LOG_LEVEL": "WARNING", "SANDBOX_ACCESS_LOG": "false"}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def warm_calls(server: ServerProcess, calls: int, mode: str) -> list[float]:
    session = f"warm-{uuid.uuid4().hex[:6]}"
    async with open_client(server.url, TOKEN, mode) as conn:  # type: ignore[arg-type]
        for _ in range(5):
            await conn.ok("run_code", code="print(1)", session=session)
        out = []
        for _ in range(calls):
            started = time.perf_counter()
            result = await conn.ok("run_code", code="print(1)", session=session)
            out.append((time.perf_counter() - started) * 1000)
            text = "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")
            assert text == "1\n", result
    return out


async def first_calls(server: ServerProcess, sessions: int, pause: float) -> list[float]:
    out = []
    async with open_client(server.url, TOKEN, "auto") as conn:
        for _ in range(sessions):
            await asyncio.sleep(pause)  # the pool refills between sessions (~0.5 s a kernel)
            started = time.perf_counter()
            result = await conn.ok("run_code", code="print(1)", session=uuid.uuid4().hex)
            out.append((time.perf_counter() - started) * 1000)
            assert result["state_reset"] == {"reason": "first_call"}, result
    return out


def kernel_rss_mb(server: ServerProcess) -> list[float]:
    """Resident memory of each ipykernel process below the server (one per interpreter)."""
    sizes = []
    for pid in process_tree(server.pid):
        cmdline = proc_cmdline(pid) or ""
        if not cmdline.startswith("/opt/srt-runtime/bin/python -m ipykernel_launcher"):
            continue  # (bwrap's own processes carry the same words further on)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                sizes.append(int(line.split()[1]) / 1024)
    return sizes


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=10)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-interp-") as tmp:
        os.chmod(tmp, 0o711)
        with running_server(
            Path(tmp) / "pool",
            SANDBOX_AUTH_TOKEN=TOKEN,
            SANDBOX_INTERPRETER_WARM="python=2",
            SANDBOX_MAX_INTERPRETERS_PER_PRINCIPAL="64",
            SANDBOX_MAX_INTERPRETERS="64",
            **SETTINGS,
        ) as server:
            await asyncio.sleep(3)  # the pool fills
            for mode in ("auto", "legacy"):
                warm = await warm_calls(server, args.calls, mode)
                rows.append((f"warm run_code print(1), {mode}", warm))
            pooled = await first_calls(server, args.sessions, 1.5)
            rows.append(("first call of a new session, warm pool", pooled))
            rss = kernel_rss_mb(server)
        with running_server(
            Path(tmp) / "nopool",
            SANDBOX_AUTH_TOKEN=TOKEN,
            SANDBOX_INTERPRETER_WARM="python=0",
            SANDBOX_MAX_INTERPRETERS_PER_PRINCIPAL="64",
            SANDBOX_MAX_INTERPRETERS="64",
            **SETTINGS,
        ) as server:
            cold = await first_calls(server, args.sessions, 0)
            rows.append(("first call of a new session, no pool", cold))
    print("bench_interpreters: one server, official MCP client, logging at WARNING, 2 cores")
    print(f"{'what':<44}{'n':>5}{'p50 ms':>10}{'p95 ms':>10}")
    print("-" * 69)
    for name, values in rows:
        p50, p95 = statistics.median(values), pct(values, 0.95)
        print(f"{name:<44}{len(values):>5}{p50:>10.1f}{p95:>10.1f}")
    idle = statistics.median(rss) if rss else float("nan")
    print(f"\nhost memory (RSS) per idle Python interpreter: {idle:.0f} MB (median of {len(rss)})")
    warm_p50 = min(statistics.median(v) for n, v in rows if n.startswith("warm"))
    pooled_p50 = statistics.median(pooled)
    print(f"target: warm p50 <= 10 ms -> {'PASS' if warm_p50 <= 10 else 'MISS'} ({warm_p50:.1f})")
    print(
        f"target: first call with the pool <= 300 ms -> "
        f"{'PASS' if pooled_p50 <= 300 else 'MISS'} ({pooled_p50:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
