"""Run in the E2B SDK's venv by bench/bench_e2b.py: Sandbox.create() -> commands.run("echo
hi") -> kill(), timed end to end, `--sequential` times one after another and `--bursts` bursts
of `--width` at once (threads). Prints one JSON object of the samples (seconds)."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from e2b import Sandbox


def cycle() -> float:
    started = time.perf_counter()
    sandbox = Sandbox.create()
    result = sandbox.commands.run("echo hi")
    sandbox.kill()
    elapsed = time.perf_counter() - started
    assert result.stdout == "hi\n", result
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sequential", type=int, default=100)
    p.add_argument("--bursts", type=int, default=10)
    p.add_argument("--width", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    for _ in range(args.warmup):
        cycle()
    sequential = [cycle() for _ in range(args.sequential)]
    burst: list[float] = []
    with ThreadPoolExecutor(args.width) as pool:
        for _ in range(args.bursts):
            burst += list(pool.map(lambda _: cycle(), range(args.width)))
    print(json.dumps({"sequential": sequential, "burst": burst}))


if __name__ == "__main__":
    main()
