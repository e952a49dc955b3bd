"""What restoring a snapshot on takeover adds to a session's first call after its home dies.

Two replicas + redis-server (each its own state dir) sharing a directory snapshot store.
Sessions are homed on replica A, each with a workspace of --mb MB in --files files; half of
them are snapshotted (snapshot_session), half not. A is killed (SIGKILL); then each session's
first call on B is timed (alternating: with a snapshot to restore, and without, which starts
empty). The difference of the medians is what the restore adds.

    .venv/bin/python bench/bench_takeover.py [--sessions 3] [--mb 100] [--files 1000]
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

from mcp_harness import Conn, open_client
from topology_harness import TOKEN, running_topology

from sandbox_runtime.workspaces.images import mounts_under, umount

FILL = (
    "import os; os.makedirs('data', exist_ok=True)\n"
    "for i in range({files}):\n"
    "    open(f'data/f{{i:05}}', 'wb').write(os.urandom({size}))\n"
)


async def first_call(conn: Conn, session: str) -> tuple[float, dict]:
    """The first call of a session whose home died: retried until the home's heartbeat has
    expired (those attempts are not timed); (seconds, result)."""
    while True:
        started = time.perf_counter()
        result = await conn.call("execute_code", command="ls data | wc -l", session=session)
        elapsed = time.perf_counter() - started
        if not result.is_error:
            return elapsed, dict(result.structured_content or {})
        await asyncio.sleep(0.2)


async def run(args: argparse.Namespace, tmp: Path) -> None:
    settings = {
        "SANDBOX_SNAPSHOT_STORE": str(tmp / "store"),
        "SANDBOX_SNAPSHOT_IDLE_SECONDS": "0",
        "SANDBOX_WORKSPACE_MB": str(max(64, args.mb * 2)),
        "SANDBOX_LOG_LEVEL": "WARNING",
    }
    with running_topology(tmp, count=2, **settings) as topo:
        (a_id, a), (_, b) = list(topo.replicas.items())
        snapped = [f"snap-{uuid.uuid4().hex[:6]}" for _ in range(args.sessions)]
        plain = [f"plain-{uuid.uuid4().hex[:6]}" for _ in range(args.sessions)]
        size = args.mb * 1024 * 1024 // args.files
        snapshot_seconds = []
        async with open_client(a.url, TOKEN, "auto") as on_a:
            for session in snapped + plain:
                code = FILL.format(files=args.files, size=size)
                await on_a.ok("execute_code", command=["python3", "-c", code], session=session,
                              timeout_seconds=300)  # fmt: skip
                if session in snapped:
                    started = time.perf_counter()
                    await on_a.ok("snapshot_session", session=session)
                    snapshot_seconds.append(time.perf_counter() - started)
        a.kill()
        restored, fresh = [], []
        async with open_client(b.url, TOKEN, "auto") as on_b:
            for with_snapshot, without in zip(snapped, plain, strict=True):
                seconds, result = await first_call(on_b, with_snapshot)
                reset = result.get("session_reset") or {}
                assert "restored_from" in reset, reset
                restored.append(seconds)
                seconds, result = await first_call(on_b, without)
                assert "restored_from" not in (result.get("session_reset") or {}), result
                fresh.append(seconds)
        print(f"snapshot_session of {args.mb} MB ({args.files} files) on A, median: "
              f"{statistics.median(snapshot_seconds):.3f} s")  # fmt: skip
        print(f"first call on B after A's death (killed replica {a_id}), median of "
              f"{args.sessions}:")  # fmt: skip
        print(f"  with a snapshot to restore  {statistics.median(restored) * 1000:8.1f} ms")
        print(f"  without (starts empty)      {statistics.median(fresh) * 1000:8.1f} ms")
        added = statistics.median(restored) - statistics.median(fresh)
        print(f"  added by the restore        {added * 1000:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--files", type=int, default=1000)
    args = parser.parse_args()
    print(f"bench_takeover: 2 replicas + redis-server, {os.cpu_count()} cores shared by all")
    with tempfile.TemporaryDirectory(prefix="srt-bench-takeover-") as tmp:
        os.chmod(tmp, 0o711)
        try:
            asyncio.run(run(args, Path(tmp)))
        finally:  # (the killed replica's workspaces stay mounted)
            for point in mounts_under(Path(tmp)):
                umount(point)


if __name__ == "__main__":
    main()
