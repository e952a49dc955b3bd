"""Workspace files: inline through the tools, large through signed URLs, and what a fresh
workspace (an ext4 image: its quota) costs.

a) write_file / read_file of 1 MiB of random bytes inline (base64), p50/p95, through the
   official MCP client in both protocol eras (its SSE event limit raised: a 1 MiB read comes
   back as ~2.8 MB of JSON, base64 twice, structured and text).
b) a 200 MB file through create_file_url with curl: PUT (`curl -T`) and GET (to /dev/null,
   every byte counted), MB/s, and the growth of the server's RSS during each transfer.
c) a fresh workspace: `WorkspaceStore.ensure()` for new names in this process (mkfs.ext4 of a
   sparse image + loop mount; needs root), the mount alone of an existing image, and the first
   write_file of a new session minus a warm one on the server.

    .venv/bin/python bench/bench_files.py [--calls 50] [--rounds 5] [--workspaces 20]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp_harness import ServerProcess, running_server, sandbox_uid

from sandbox_runtime.config import Settings
from sandbox_runtime.workspaces.store import WorkspaceStore

TOKEN = "bench-files-token-0123456789"
MiB = 1024 * 1024
INLINE = MiB
BIG_MB = 200
SERVER_WORKSPACE_MB = 512
SETTINGS = {
    "SANDBOX_LOG_LEVEL": "WARNING",
    "SANDBOX_ACCESS_LOG": "false",
    "SANDBOX_WORKSPACE_MB": str(SERVER_WORKSPACE_MB),
}
MAX_EVENT = 16 * MiB
WARMUP = 3


class BenchFailure(Exception):
    """Something the benchmark relies on did not hold."""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.asynccontextmanager
async def big_client(url: str, mode: str) -> AsyncIterator[Client]:
    """The official client (as tests/mcp_harness.open_client) with a 16 MiB SSE event limit."""
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {TOKEN}"})
    async with http:
        transport = streamable_http_client(url, http_client=http, max_sse_event_size=MAX_EVENT)
        async with Client(transport, mode=mode) as client:
            await client.list_tools()
            yield client


async def ok(client: Client, tool: str, **arguments: object) -> dict:
    result = await client.call_tool(tool, arguments)
    if result.is_error or result.structured_content is None:
        text = "".join(getattr(b, "text", "") for b in result.content)
        raise BenchFailure(f"{tool} failed: {text[:500]}")
    return dict(result.structured_content)


# -- a) inline ----------------------------------------------------------------------------------


async def inline(server: ServerProcess, mode: str, calls: int) -> dict[str, list[float]]:
    session = f"inline-{mode}-{uuid.uuid4().hex[:6]}"
    data = os.urandom(INLINE)
    content = base64.b64encode(data).decode()
    times: dict[str, list[float]] = {"write": [], "read": []}
    async with big_client(server.url, mode) as client:
        for i in range(WARMUP + calls):
            started = time.perf_counter()
            wrote = await ok(
                client,
                "write_file",
                path="one.bin",
                content=content,
                encoding="base64",
                session=session,
            )
            middle = time.perf_counter()
            read = await ok(client, "read_file", path="one.bin", length=INLINE, session=session)
            ended = time.perf_counter()
            if wrote["size"] != INLINE or read["length"] != INLINE or not read["eof"]:
                raise BenchFailure(f"1 MiB did not go through: {wrote} / {read['length']}")
            if i == 0 and base64.b64decode(read["content"]) != data:
                raise BenchFailure("read_file returned other bytes than write_file wrote")
            if i >= WARMUP:
                times["write"].append((middle - started) * 1000)
                times["read"].append((ended - middle) * 1000)
    return times


# -- b) 200 MB through URLs ---------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class RssPeak:
    """The peak RSS of `pid` over the block minus its RSS before, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.before, self.peak = pid, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> RssPeak:
        self.before = self.peak = rss_bytes(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.before) / MiB


def curl(*args: str) -> tuple[int, int, float]:
    """(status, bytes moved, seconds) of one curl transfer, as curl measures them."""
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "--noproxy",
            "*",
            "-w",
            "%{http_code} %{size_upload} %{size_download} %{time_total}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    fields = done.stdout.split()[-4:]
    if len(fields) != 4:
        raise BenchFailure(f"curl {args}: {done.stderr.strip()}")
    status, up, down, seconds = fields
    return int(status), max(int(up), int(down)), float(seconds)


def make_file(path: Path, size_mb: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(size_mb):
            chunk = os.urandom(MiB)
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


async def transfers(server: ServerProcess, tmp: Path, rounds: int) -> dict[str, list[float]]:
    """MB/s of each PUT and GET of a 200 MB file, and the RSS growth (MB) of each."""
    source = tmp / "big.bin"
    digest = await asyncio.to_thread(make_file, source, BIG_MB)
    size = BIG_MB * MiB
    out: dict[str, list[float]] = {"put": [], "get": [], "put_rss": [], "get_rss": []}
    session = f"big-{uuid.uuid4().hex[:6]}"
    async with big_client(server.url, "auto") as client:
        await ok(client, "write_file", path="warm", content="x", session=session)
        for _ in range(rounds):
            put = (
                await ok(client, "create_file_url", path="big.bin", method="PUT", session=session)
            )["url"]
            with RssPeak(server.pid) as rss:
                status, moved, seconds = await asyncio.to_thread(
                    curl, "-o", "/dev/null", "-T", str(source), put
                )
            if status != 201 or moved != size:
                raise BenchFailure(f"PUT answered {status} after {moved} bytes")
            out["put"].append(size / seconds / 1e6)
            out["put_rss"].append(rss.growth_mb)
            get = (await ok(client, "create_file_url", path="big.bin", session=session))["url"]
            with RssPeak(server.pid) as rss:
                status, moved, seconds = await asyncio.to_thread(curl, "-o", "/dev/null", get)
            if status != 200 or moved != size:
                raise BenchFailure(f"GET answered {status} with {moved} bytes")
            out["get"].append(size / seconds / 1e6)
            out["get_rss"].append(rss.growth_mb)
        run = await ok(client, "execute_code", command="sha256sum big.bin", session=session)
        stdout = "".join(e.get("data") or "" for e in run["output"] if e["type"] == "stdout")
        if stdout.split()[:1] != [digest]:
            raise BenchFailure(f"the uploaded file's sha256 differs: {stdout!r}")
    return out


# -- c) fresh workspaces ------------------------------------------------------------------------


async def ensure_costs(tmp: Path, size_mb: int, inodes: int, count: int) -> dict[str, list[float]]:
    """ms of `ensure()` of new names (make + mount) and of existing unmounted ones (mount)."""
    uid = sandbox_uid()
    gid = pwd.getpwuid(uid).pw_gid
    root = tmp / f"ws-{size_mb}"
    times: dict[str, list[float]] = {"new": [], "mount": []}
    store = WorkspaceStore(
        root, size_mb=size_mb, inodes=inodes, quota="image", retention_seconds=86400
    )
    store.start(uid, gid)  # (raises without root, loop devices or mkfs.ext4)
    names = [f"bench-{uuid.uuid4().hex[:12]}" for _ in range(count)]
    try:
        for name in names:
            started = time.perf_counter()
            _, existed = await store.ensure(name)
            times["new"].append((time.perf_counter() - started) * 1000)
            if existed or store.usage(name)["bytes_limit"] is None:
                raise BenchFailure(f"workspace {name} was not a new image")
        await store.aclose()  # unmounts them all
        again = WorkspaceStore(
            root, size_mb=size_mb, inodes=inodes, quota="image", retention_seconds=86400
        )
        again.start(uid, gid)
        for name in names:
            started = time.perf_counter()
            _, existed = await again.ensure(name)
            times["mount"].append((time.perf_counter() - started) * 1000)
            if not existed:
                raise BenchFailure(f"workspace {name} was made again")
        store = again
    finally:
        for name in names:
            with contextlib.suppress(Exception):
                await store.remove(name)
        await store.aclose()
        shutil.rmtree(root, ignore_errors=True)
    return times


async def first_writes(server: ServerProcess, count: int) -> dict[str, list[float]]:
    """ms of the first write_file of new sessions, and of the second (warm) one of each."""
    times: dict[str, list[float]] = {"first": [], "warm": []}
    async with big_client(server.url, "auto") as client:
        await ok(client, "write_file", path="f", content="x", session="warm-up")
        for _ in range(count):
            session = f"fresh-{uuid.uuid4().hex[:8]}"
            for kind in ("first", "warm"):
                started = time.perf_counter()
                await ok(client, "write_file", path="f", content="x", session=session)
                times[kind].append((time.perf_counter() - started) * 1000)
    return times


# -- main ---------------------------------------------------------------------------------------


def row(name: str, values: list[float], unit: str = "ms") -> str:
    return (
        f"{name:<52}{len(values):>4}{statistics.median(values):>10.1f}"
        f"{pct(values, 0.95):>10.1f}  {unit}"
    )


async def run(args: argparse.Namespace, tmp: Path) -> None:
    defaults = Settings.model_fields
    default_mb = int(defaults["workspace_mb"].default)

    def inodes(size_mb: int) -> int:
        """The server's inode count for a workspace of `size_mb` (by default none is set)."""
        return Settings.model_construct(workspace_mb=size_mb).workspace_inode_count()

    with running_server(tmp / "server", SANDBOX_AUTH_TOKEN=TOKEN, **SETTINGS) as server:
        print(f"  a) 1 MiB inline, {args.calls} calls each way per era ...", flush=True)
        inline_rows = {mode: await inline(server, mode, args.calls) for mode in ("auto", "legacy")}
        print(f"  b) {BIG_MB} MB through URLs, {args.rounds} rounds ...", flush=True)
        moved = await transfers(server, tmp, args.rounds)
        print(f"  c) {args.workspaces} fresh workspaces ...", flush=True)
        writes = await first_writes(server, args.workspaces)
    ensured = {
        size: await ensure_costs(tmp, size, inodes(size), args.workspaces)
        for size in dict.fromkeys((default_mb, SERVER_WORKSPACE_MB))
    }

    era = {"auto": "2026-07-28", "legacy": "2025-11-25"}
    print()
    print(f"{'a) inline, 1 MiB of random bytes (base64)':<52}{'n':>4}{'p50':>10}{'p95':>10}")
    print("-" * 80)
    for mode, times in inline_rows.items():
        print(row(f"write_file ({era[mode]})", times["write"]))
        print(row(f"read_file length=1048576 ({era[mode]})", times["read"]))
    print()
    print(
        f"{f'b) {BIG_MB} MB via a file URL, curl':<52}{'n':>4}{'median':>10}{'worst':>10}"
        f"{'best':>10}{'RSS growth max':>20}"
    )
    print("-" * 106)
    for kind, what in (("put", "PUT (curl -T)"), ("get", "GET (curl -o /dev/null)")):
        speeds = moved[kind]
        print(
            f"{what:<52}{len(speeds):>4}{statistics.median(speeds):>10.0f}{min(speeds):>10.0f}"
            f"{max(speeds):>10.0f}  MB/s{max(moved[kind + '_rss']):>14.1f} MB"
        )
    print("(MB = 10^6 bytes; curl's own time_total; each PUT replaces the previous upload)")
    print()
    print(f"{'c) a fresh workspace (ext4 image = its quota)':<52}{'n':>4}{'p50':>10}{'p95':>10}")
    print("-" * 80)
    for size, times in ensured.items():
        print(row(f"ensure() new name, {size} MiB / {inodes(size)} inodes", times["new"]))
        print(row(f"ensure() existing image (mount only), {size} MiB", times["mount"]))
    first, warm = statistics.median(writes["first"]), statistics.median(writes["warm"])
    print(row(f"first write_file of a new session ({SERVER_WORKSPACE_MB} MiB)", writes["first"]))
    print(row("second write_file of that session (warm)", writes["warm"]))
    print(f"{'first minus warm, p50':<52}{'':>4}{first - warm:>10.1f}{'':>10}  ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50, help="timed inline calls each way")
    parser.add_argument("--rounds", type=int, default=5, help="200 MB transfers each way")
    parser.add_argument("--workspaces", type=int, default=20, help="fresh workspaces timed")
    args = parser.parse_args()
    if min(args.calls, args.rounds, args.workspaces) < 1:
        parser.error("--calls, --rounds and --workspaces must be positive")
    if os.geteuid() != 0:
        print("bench_files needs root (workspace images are loop-mounted)", file=sys.stderr)
        return 2
    print(
        f"bench_files: one server (SANDBOX_WORKSPACE_MB={SERVER_WORKSPACE_MB}, logging at "
        f"WARNING, no access log), official MCP client, curl; {os.cpu_count()} cores"
    )
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="srt-bench-files-") as tmp:
            os.chmod(tmp, 0o711)
            asyncio.run(run(args, Path(tmp)))
    except BenchFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"(whole run {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
