"""Sessions on an environment vs on `default` (issue 46, the using half), one real server.

a) the first call of a new session (`execute_code true`, a session name never used: a new
   workspace and its first sandbox), on `default` and on a built environment, interleaved;
   p50/p95 of each and the ratio (target: within 1.3x).
b) disk: what ten new sessions on the environment add to the state filesystem (workspaces,
   the server's private files) against ten on `default`, and the environment's own size
   (counted once: its tree is bound, never copied).

The environment is the tests' `test-base` (tests/environments_harness.py: Debian bookworm
minbase), built once per machine (the first run takes a minute or two).

    .venv/bin/python bench/bench_environments_use.py [--rounds 30] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from environments_harness import build_all, environments_dir
from mcp_harness import Conn, open_client, running_server, traversable_by_others

ENV = "test-base"
TARGET_RATIO = 1.3


class BenchFailure(Exception):
    """Something the benchmark relies on did not hold (not a missed target)."""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def first_call(conn: Conn, image: str | None) -> float:
    """ms of `execute_code true` in a new session (on `image`, or default)."""
    args = {"command": "true", "session": f"b-{uuid.uuid4().hex[:10]}"}
    if image is not None:
        args["image"] = image
    started = time.perf_counter()
    out = await conn.ok("execute_code", **args)
    elapsed = (time.perf_counter() - started) * 1000
    if out.get("exit_code") != 0:
        raise BenchFailure(f"execute_code on {image or 'default'} returned {out}")
    return elapsed


def used_bytes(path: Path) -> int:
    """Bytes allocated under `path` (du: what the disk holds, sparse files as allocated)."""
    done = subprocess.run(["du", "-sxB1", str(path)], capture_output=True, text=True, check=False)
    return int(done.stdout.split()[0]) if done.stdout else 0


async def disk_of_ten(conn: Conn, image: str | None, places: list[Path]) -> int:
    before = sum(used_bytes(p) for p in places)
    for _ in range(10):
        await first_call(conn, image)
    await asyncio.sleep(0.5)
    return sum(used_bytes(p) for p in places) - before


async def run(rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="srt-bench-envs-"))
    traversable_by_others(work)
    built = build_all(environments_dir(), work / "builds", ("test-base",))
    env = built.get(ENV)
    tmp = work / "tmp"
    tmp.mkdir()
    traversable_by_others(tmp)
    settings = {"SANDBOX_ENVIRONMENTS_DIR": str(built.base), "SANDBOX_LOG_LEVEL": "WARNING",
                "SANDBOX_ACCESS_LOG": "false", "TMPDIR": str(tmp)}  # fmt: skip
    with running_server(work / "server", **settings) as server:
        async with open_client(server.url, None) as conn:
            for _ in range(3):  # (the environment's root is built on its first sandbox)
                await first_call(conn, ENV)
                await first_call(conn, None)
            default_ms: list[float] = []
            env_ms: list[float] = []
            for _ in range(rounds):
                default_ms.append(await first_call(conn, None))
                env_ms.append(await first_call(conn, ENV))
            p50_d, p50_e = statistics.median(default_ms), statistics.median(env_ms)
            print(f"first call of a new session, {rounds} each, interleaved:")
            print(f"  default      p50 {p50_d:6.1f} ms  p95 {pct(default_ms, 0.95):6.1f} ms")
            print(f"  {ENV:<12} p50 {p50_e:6.1f} ms  p95 {pct(env_ms, 0.95):6.1f} ms")
            ratio = p50_e / p50_d
            verdict = "ok" if ratio <= TARGET_RATIO else "MISSED"
            print(f"  ratio {ratio:.2f}x (target <= {TARGET_RATIO}x): {verdict}")
            places = [server.state_dir, tmp]
            d_default = await disk_of_ten(conn, None, places)
            d_env = await disk_of_ten(conn, ENV, places)
            print("disk added by ten new sessions (state dir + the server's private files):")
            print(f"  default {d_default / 2**20:7.2f} MiB   {ENV} {d_env / 2**20:7.2f} MiB")
            print(f"  the environment itself: {env.size_bytes / 2**20:.0f} MiB, once "
                  f"({used_bytes(env.root) / 2**20:.0f} MiB on disk), not per session")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="10 rounds")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (sandboxes with cgroups, as deployed)")
    asyncio.run(run(10 if args.quick else args.rounds))


if __name__ == "__main__":
    main()
