"""`execute_code echo` through nginx (the shipped config) with 1 and with 3 replicas + Redis.

Prints calls/s with 10 concurrent sessionless clients and p50/p95 of sequential calls.

    .venv/bin/python bench/bench_nginx.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mcp_harness import ServerProcess, free_port, open_client
from nginx_harness import Nginx
from redis_harness import RedisServer

TOKEN = "bench-nginx-token-1234"


async def sequential(url: str, calls: int) -> tuple[float, float]:
    times = []
    async with open_client(url, TOKEN, "auto") as conn:
        for _ in range(5):
            await conn.ok("execute_code", command="echo hi")
        for _ in range(calls):
            t = time.perf_counter()
            await conn.ok("execute_code", command="echo hi")
            times.append(time.perf_counter() - t)
    times.sort()
    return statistics.median(times) * 1000, times[int(0.95 * (len(times) - 1))] * 1000


async def concurrent(url: str, clients: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        async with open_client(url, TOKEN, "auto") as conn:
            while time.perf_counter() < stop:
                await conn.ok("execute_code", command="echo hi")
                done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return done / (time.perf_counter() - started)


def run(count: int, workdir: Path, calls: int, seconds: float) -> tuple[float, float, float]:
    redis = RedisServer(workdir / "redis")
    redis.start()
    replicas = [
        ServerProcess(
            workdir / f"r{i}",
            {
                "SANDBOX_AUTH_TOKEN": TOKEN,
                "REDIS_URL": redis.url,
                "SANDBOX_REPLICA_ID": f"b{i}",
                "SANDBOX_LOG_LEVEL": "WARNING",
                "SANDBOX_MAX_CONCURRENT": "64",
                "SANDBOX_MAX_PER_SESSION": "64",
            },
        )
        for i in range(count)
    ]
    nginx = None
    try:
        for r in replicas:
            r.start()
        nginx = Nginx(
            workdir / "nginx",
            free_port(),
            [f"b{i}=127.0.0.1:{r.port}" for i, r in enumerate(replicas)],
        ).start()
        p50, p95 = asyncio.run(sequential(nginx.url, calls))
        cps = asyncio.run(concurrent(nginx.url, 10, seconds))
        return p50, p95, cps
    finally:
        if nginx is not None:
            nginx.stop()
        for r in replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.stop()
        redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    rows = []
    for count in (1, 3):
        with tempfile.TemporaryDirectory(prefix="srt-bench-nginx-") as tmp:
            os.chmod(tmp, 0o711)
            rows.append((count, *run(count, Path(tmp), args.calls, args.seconds)))
    print()
    print(f"{'replicas':>8} {'echo p50 ms':>11} {'p95 ms':>7} {'10 clients calls/s':>19}")
    for count, p50, p95, cps in rows:
        print(f"{count:>8} {p50:>11.1f} {p95:>7.1f} {cps:>19.1f}")
    print(f"\n3 replicas / 1 replica throughput: {rows[1][3] / rows[0][3]:.2f}x (2 cores shared)")


if __name__ == "__main__":
    main()
