"""What a workspace costs in each mode: one table per mode this host has (issue 41).

Modes: `project` (directories with a filesystem quota: here a btrfs loop filesystem with
quotas, made by the bench; ext4/XFS project quotas where the kernel has them), `image` (an
ext4 image per workspace, on an ext4 loop filesystem) and `directory` (no quota). Per mode, a
real server whose state directory is on that filesystem, the official client:

1) disk used by --sessions sessions that each wrote 10 KB (write_file; the filesystem's used
   blocks after a sync, before and after; target < 100 MB),
2) a new session's first call (execute_code `true`: workspace made, sandbox started), p50/p95,
3) write_file of 1 KiB and of 1 MiB into one session, p50/p95,
4) sessions on one replica until something refuses (one write_file each; bounded by --max
   sessions or --seconds), and what refused.

    SRT_TEST_RUNTIME_DIR=/work/main/.runtime .venv/bin/python bench/bench_workspaces.py
        [--sessions 1000] [--max 10000] [--seconds 300] [--fs-mb 8192] [--modes project,image]

Needs root (loop mounts, sandboxes) and btrfs-progs. Everything it makes (filesystems, loop
devices, temp dirs) is given back at the end, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from loopfs_harness import disk_used, loop_filesystem
from mcp_harness import Conn, open_client, running_server

TOKEN = "bench-workspaces-token-0123"
MIB = 1024 * 1024
CLIENTS = 4
MODES = {
    # mode: (filesystem, SANDBOX_WORKSPACE_QUOTA, extra settings)
    "project": ("btrfs", "project", {}),
    # (thin, the default: allocated images would need 1,000 x SANDBOX_WORKSPACE_MB)
    "image": ("ext4", "image", {}),
    "directory": ("ext4", "none", {}),
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(values: list[float]) -> str:
    return f"{pct(values, 0.5) * 1000:.1f} / {pct(values, 0.95) * 1000:.1f} ms"


async def timed(conn: Conn, tool: str, **arguments: Any) -> float:
    started = time.perf_counter()
    await conn.ok(tool, **arguments)
    return time.perf_counter() - started


async def sessions_writing(url: str, prefix: str, count: int, size: int) -> float:
    """`count` new sessions each writing `size` bytes, in CLIENTS clients: seconds taken."""
    content = base64.b64encode(os.urandom(size)).decode()
    started = time.perf_counter()

    async def client(k: int) -> None:
        async with open_client(url, TOKEN, "auto") as conn:
            for i in range(k, count, CLIENTS):
                await conn.ok("write_file", path="data.bin", content=content,
                              encoding="base64", session=f"{prefix}-{i}")  # fmt: skip

    await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    return time.perf_counter() - started


async def until_refused(url: str, most: int, seconds: float) -> tuple[int, str]:
    """New sessions (one write_file each) until one is refused, `most` or `seconds`."""
    made, refused = 0, ""
    deadline = time.monotonic() + seconds
    stop = asyncio.Event()

    async def client(k: int) -> None:
        nonlocal made, refused
        async with open_client(url, TOKEN, "auto") as conn:
            i = k
            while not stop.is_set():
                if made >= most or time.monotonic() > deadline:
                    stop.set()
                    return
                result = await conn.call("write_file", path="x", content="x", session=f"u-{i}")
                if result.is_error:
                    refused = "".join(getattr(c, "text", "") for c in result.content)
                    stop.set()
                    return
                made += 1
                i += CLIENTS

    await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    if not refused:
        refused = f"nothing refused: stopped at {'--max' if made >= most else '--seconds'}"
    return made, refused


async def bench_mode(mode: str, args: argparse.Namespace, base: Path) -> list[tuple[str, str]]:
    fs, quota, extra = MODES[mode]
    rows: list[tuple[str, str]] = []
    with loop_filesystem(base / mode, fs, args.fs_mb) as point:
        settings = {
            "SANDBOX_AUTH_TOKEN": TOKEN,
            "SANDBOX_LOG_LEVEL": "WARNING",
            "SANDBOX_ACCESS_LOG": "false",
            "SANDBOX_WORKSPACE_MB": "1024",
            "SANDBOX_WORKSPACE_QUOTA": quota,
            "SANDBOX_INTERPRETER_WARM": "python=0",
            "SANDBOX_MIN_FREE_DISK_MB": "64",
            **extra,
        }
        with running_server(point / "w", **settings) as server:
            health = server.health()["workspaces"]
            rows.append(("mode (/health)", f"{health['mode']}, quota {health.get('quota')}"))
            before = disk_used(point)
            took = await sessions_writing(server.url, "d", args.sessions, 10_000)
            used = disk_used(point) - before
            rows.append((f"disk used by {args.sessions} sessions x 10 KB", f"{used / MIB:.1f} MiB"))
            rows.append((f"time for those {args.sessions} (4 clients)", f"{took:.1f} s"))
            async with open_client(server.url, TOKEN, "auto") as conn:
                first = [
                    await timed(conn, "execute_code", command="true", session=f"f-{i}")
                    for i in range(20)
                ]
                rows.append(("new session's first call (execute_code), p50/p95", ms(first)))
                for label, size in (("1 KiB", 1024), ("1 MiB", MIB)):
                    content = base64.b64encode(os.urandom(size)).decode()
                    times = [
                        await timed(
                            conn,
                            "write_file",
                            path=f"w{i}",
                            content=content,
                            encoding="base64",
                            session="w",
                        )
                        for i in range(30)
                    ]
                    rows.append((f"write_file {label}, p50/p95", ms(times)))
            started = time.monotonic()
            made, refused = await until_refused(server.url, args.max, args.seconds)
            rows.append(
                (
                    "more sessions until refused",
                    f"{made} in {time.monotonic() - started:.0f} s; disk "
                    f"{disk_used(point) / MIB:.0f} MiB of {args.fs_mb}",
                )
            )
            rows.append(("what refused", refused[:160]))
            rows.append(("server health after", server.health()["status"]))
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--max", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--fs-mb", type=int, default=8192)
    parser.add_argument("--modes", default="project,image,directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="srt-bench-ws-") as tmp:
        os.chmod(tmp, 0o755)
        for mode in args.modes.split(","):
            try:
                rows = await bench_mode(mode, args, Path(tmp))
            except Exception as exc:  # (a mode this host lacks: say so, go on)
                print(f"\n## {mode}: not measured: {type(exc).__name__}: {exc}"[:600])
                continue
            print(f"\n## {mode} (state filesystem: {MODES[mode][0]}, {args.fs_mb} MiB)\n")
            print("| measure | value |\n|---|---|")
            for name, value in rows:
                print(f"| {name} | {value} |")
            sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
