"""What read-your-writes costs a call: `execute_code echo hi` answered once the execution is in
Redis (sessions/written.py) against the same server with that wait taken out.

Three real servers in one run, alternating rounds, one client each (the official SDK, modern
era, one session): alone (no Redis), mirroring to Redis as shipped, and mirroring to Redis
with `RedisCluster.written` replaced in its process by a mark for the mirror and no wait (the
behaviour before the fix). Each Redis server has a database of its own on one redis-server.
Prints p50/p95 per server and the difference the wait makes.

    .venv/bin/python bench/bench_written.py [--calls 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_mcp import Server, pct, sequential
from redis_harness import RedisServer

# The server's own entry point, with the wait for the store's write taken out (the mirror
# still writes everything behind the call, as before read-your-writes).
NO_WAIT = """
from sandbox_runtime.sessions.cluster import RedisCluster

async def written(self, execution, within):
    self.mirror.mark(execution)

RedisCluster.written = written
from sandbox_runtime.cli import main
raise SystemExit(main())
"""


async def measure(servers: dict[str, Server], calls: int, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {label: [] for label in servers}
    for r in range(rounds):
        for label, server in servers.items():
            got, _ = await sequential(
                server.url, calls, "auto", server.proc.pid, f"w{r}", "execute_code",
                {"command": "echo hi"},
            )  # fmt: skip
            times[label] += got
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200, help="sequential calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="srt-bench-written-") as tmp:
        os.chmod(tmp, 0o711)  # (the sandbox user reaches the workspaces under it)
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        db = f"redis://127.0.0.1:{redis.port}"
        servers: dict[str, Server] = {}
        try:
            base = Path(tmp)
            servers["alone"] = Server(base / "a", None, "bw-a", True, pool=True)
            servers["redis"] = Server(base / "b", f"{db}/0", "bw-b", True, pool=True)
            servers["redis, no wait"] = Server(
                base / "c", f"{db}/1", "bw-c", True, pool=True,
                argv=[sys.executable, "-c", NO_WAIT],
            )  # fmt: skip
            times = asyncio.run(measure(servers, args.calls, args.rounds))
        finally:
            for server in servers.values():
                server.stop()
            redis.stop()
    print(f"\nexecute_code echo hi, {args.calls} sequential calls x {args.rounds} rounds each")
    print(f"{'server':<16} {'p50 ms':>7} {'p95 ms':>7}")
    p50 = {}
    for label, got in times.items():
        p50[label] = pct(got, 0.5) * 1000
        print(f"{label:<16} {p50[label]:>7.2f} {pct(got, 0.95) * 1000:>7.2f}")
    wait = p50["redis"] - p50["redis, no wait"]
    print(f"\nthe wait for the store's write: {wait:+.2f} ms p50 "
          f"({p50['redis'] / p50['redis, no wait']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
