"""Redis mirror lag: 10 executions printing steadily, event produced -> visible in Redis.

Runs an ExecutionManager in this process against a real redis-server on a free port; a
watcher polls Redis (LLEN per output list, every 2 ms) and records when each event's seq first
becomes visible there. Prints p50/p99 of that lag, and the mirror's own write-completion lag.

    .venv/bin/python bench/bench_mirror.py [--executions 10] [--lines 300]
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

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_harness import RedisServer

from sandbox_runtime.app.services import Services, build
from sandbox_runtime.config import Settings
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.requests import ExecuteRequest
from sandbox_runtime.sessions.cluster import RedisCluster


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(executions: int, lines: int, workdir: Path, redis_url: str) -> None:
    settings = Settings(
        state_dir=workdir / "state",
        redis_url=redis_url,
        replica_id="bench-mirror",
        max_concurrent=64,
        max_per_session=64,
        _env_file=None,  # type: ignore[call-arg]
    )
    async with build(settings) as services:
        await measure(services, executions, lines, redis_url)


async def measure(services: Services, executions: int, lines: int, redis_url: str) -> None:
    manager = services.manager
    cluster = services.cluster
    assert isinstance(cluster, RedisCluster)
    produced: dict[tuple[str, int], float] = {}

    def on_events(execution: Execution, events: list) -> None:  # type: ignore[type-arg]
        for event in events:
            produced[(execution.execution_id, event.seq)] = time.monotonic()

    # (Timed before the mirror hears of them: every execution tells the cluster it changed.)
    mark = cluster.changed

    def changed(execution: Execution, events: list | None = None) -> None:  # type: ignore[type-arg]
        on_events(execution, events or [])
        mark(execution, events)

    cluster.changed = changed  # type: ignore[method-assign]
    client = aioredis.Redis.from_url(redis_url)
    visible_lag: list[float] = []
    seen: dict[str, int] = {}
    stop = asyncio.Event()

    async def watch(ids: list[str]) -> None:
        while not stop.is_set():
            async with client.pipeline(transaction=False) as pipe:
                for execution_id in ids:
                    pipe.llen(f"execution:{execution_id}:output")
                lengths = await pipe.execute()
            now = time.monotonic()
            for execution_id, length in zip(ids, lengths, strict=True):
                for seq in range(seen.get(execution_id, 0) + 1, int(length) + 1):
                    at = produced.get((execution_id, seq))
                    if at is not None:
                        visible_lag.append(now - at)
                seen[execution_id] = max(seen.get(execution_id, 0), int(length))
            await asyncio.sleep(0.002)

    command = f"for i in $(seq 1 {lines}); do echo line $i; sleep 0.01; done"
    started = [
        await manager.start_execution(Owner("bench", f"s{i}"), ExecuteRequest(command=command))
        for i in range(executions)
    ]
    watcher = asyncio.create_task(watch([e.execution_id for e in started]))
    await asyncio.gather(*(e.finished.wait() for e in started))
    await asyncio.sleep(0.5)
    stop.set()
    await watcher
    written = list(cluster.mirror.lag_samples)
    await client.aclose()
    print()
    print(f"{executions} executions x {lines} lines, one line every 10 ms each")
    print(f"{'measure':<38} {'n':>6} {'p50 ms':>8} {'p99 ms':>8}")
    print(
        f"{'produced -> visible in Redis (LLEN)':<38} {len(visible_lag):>6} "
        f"{statistics.median(visible_lag) * 1000:>8.1f} {pct(visible_lag, 0.99) * 1000:>8.1f}"
    )
    print(
        f"{'produced -> mirror write completed':<38} {len(written):>6} "
        f"{statistics.median(written) * 1000:>8.1f} {pct(written, 0.99) * 1000:>8.1f}"
    )
    verdict = "OK" if pct(visible_lag, 0.99) <= 0.050 else "MISS"
    print(f"\ntarget: lag p99 <= 50 ms -> {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--executions", type=int, default=10)
    parser.add_argument("--lines", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="srt-bench-mirror-") as tmp:
        os.chmod(tmp, 0o711)
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        try:
            asyncio.run(run(args.executions, args.lines, Path(tmp), redis.url))
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
