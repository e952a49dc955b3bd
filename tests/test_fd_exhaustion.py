"""A server that runs out of file descriptors refuses what it cannot start, clearly, gives
back every descriptor and cgroup it took, says so on /ready and /health, and recovers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import (
    Conn,
    ServerProcess,
    error_text,
    eventually,
    open_client,
    stop_all,
    stop_if_running,
)
from test_cgroup_instances import cgroup_dirs

from sandbox_runtime.sandbox.cgroups import POOL_FD_SHARE

pytestmark = pytest.mark.e2e

TOKEN = "fd-test-token-0123456789"
FD_LIMIT = 90
CLIENTS = 4
CALLS_PER_CLIENT = 6  # 24 at once
ROUNDS = 4


def server_groups(server: ServerProcess, parents: list[Path]) -> list[Path]:
    """The server's own cgroups (`<group>.<pid>.<start>.<pid namespace>`) under `parents`."""
    return [g for p in parents for g in p.glob(f"*.{server.pid}.*") if g.is_dir()]


async def burst(server: ServerProcess) -> list[Any]:
    """CLIENTS clients at once, each with CALLS_PER_CLIENT execute_code calls at once; the
    clients are closed after (their connections are the server's descriptors too). A client
    whose connection the server could not keep counts as one exception."""

    results: list[Any] = []

    async def one_client() -> None:
        async def one_call(conn: Conn) -> None:
            try:
                results.append(await conn.call("execute_code", command="echo hi; sleep 0.2"))
            except Exception as exc:  # (its connection was refused or cut: out of descriptors)
                results.append(exc)

        with contextlib.suppress(Exception):  # (the same, for the client's own streams)
            async with open_client(server.url, TOKEN, "auto") as conn:
                await asyncio.gather(*(one_call(conn) for _ in range(CALLS_PER_CLIENT)))

    await asyncio.gather(*(one_client() for _ in range(CLIENTS)))
    return results


def fd_targets(server: ServerProcess) -> Counter[str]:
    """What the server's descriptors point at (pipe:[…], socket:[…], paths), counted."""
    fd_dir = Path(f"/proc/{server.pid}/fd")
    out: Counter[str] = Counter()
    for name in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            out[re.sub(r"\[\d+\]", "", os.readlink(fd_dir / name))] += 1
    return out


POOLED_GROUP = re.compile(r"^/sys/fs/cgroup/.*/x-[0-9a-f]{32}/[^/]+$")


def pooled_fds(targets: Counter[str]) -> int:
    """How many of `targets` are files of execution cgroups (`x-<hex>`: after a burst, only
    pooled groups are left)."""
    return sum(n for target, n in targets.items() if POOLED_GROUP.match(target))


def ready(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    resp = httpx2.get(f"{server.base_url}/ready", timeout=5.0)
    body: dict[str, Any] = resp.json()
    return resp.status_code, body


def ready_now(server: ServerProcess) -> bool:
    """/ready answers 200; a connection cut while the burst's descriptors are being let go
    (the server refuses what it cannot take) is "not yet"."""
    try:
        return ready(server)[0] == 200
    except httpx2.TransportError:
        return False


async def test_running_out_of_descriptors_leaks_nothing_and_the_server_recovers(
    tmp_path: Path,
) -> None:
    server = ServerProcess(
        tmp_path / "srv",
        {
            "SANDBOX_AUTH_TOKEN": TOKEN,
            "SANDBOX_POOL_SIZE": "0",
            "SANDBOX_INTERPRETER_WARM": "",
            "SANDBOX_MAX_PER_SESSION": str(CLIENTS * CALLS_PER_CLIENT),
            "SANDBOX_MAX_CONCURRENT": str(CLIENTS * CALLS_PER_CLIENT),
        },
        max_fds=FD_LIMIT,
    )
    parents = list(cgroup_dirs(os.getpid()).values())  # where its groups are made
    try:
        server.start()
        await burst(server)  # fills what is bounded and kept (pooled cgroups)
        await eventually(lambda: ready_now(server), 10, "/ready before the bursts")
        idle, before = server.open_fds(), fd_targets(server)
        assert server_groups(server, parents), "the server has cgroups of its own"

        refusals: list[str] = []
        for _ in range(ROUNDS):
            results = await burst(server)
            for result in results:
                if isinstance(result, BaseException):
                    continue  # (a client whose connection the server could not accept)
                if result.is_error:
                    refusals.append(error_text(result))
                else:
                    assert result.structured_content["status"] == "completed", result
        assert refusals, "a burst this big runs out of descriptors under the limit"
        for text in refusals:
            assert "file descriptors" in text, text  # says why, not just "Errno 24"

        # Pooled execution groups keep their files open, bounded by a share of the limit;
        # how many are pooled when a burst ends depends on the order its groups came back
        # in (running out of descriptors empties the pool). Everything else must go.
        unpooled_idle = idle - pooled_fds(before)

        def settled() -> bool:
            targets = fd_targets(server)
            pooled = pooled_fds(targets)
            return (
                sum(targets.values()) - pooled <= unpooled_idle + 2
                and pooled <= FD_LIMIT // POOL_FD_SHARE
            )

        try:
            await eventually(settled, 15, "descriptors to go")
        except AssertionError:
            raise AssertionError(
                f"{server.open_fds()} descriptors open, {idle} before "
                f"({pooled_fds(fd_targets(server))} held by pooled groups, at most "
                f"{FD_LIMIT // POOL_FD_SHARE}); "
                f"new: {sorted((fd_targets(server) - before).items())}"
            ) from None
        async with open_client(server.url, TOKEN, "auto") as conn:
            after = await conn.ok("execute_code", command="echo again")
            assert after["status"] == "completed", after
            assert "".join(e.get("data", "") for e in after["output"]) == "again\n", after
        status, body = ready(server)
        assert status == 200, body
        health = server.health()
        assert health["status"] == "ok", health
        assert health["file_descriptors"]["limit"] == FD_LIMIT, health

        pid = server.pid
        server.stop()
        left = [g for p in parents for g in p.glob(f"*.{pid}.*") if g.is_dir()]
        assert not left, f"cgroups outlived SIGTERM: {left}"
    finally:
        stop_all(stop_if_running(server))


async def test_ready_says_unready_while_descriptors_are_nearly_spent(tmp_path: Path) -> None:
    """Lowering the running server's descriptor limit to just above what it holds makes
    /ready 503 and /health degraded, saying why; raising it again makes it ready."""
    server = ServerProcess(
        tmp_path / "srv",
        {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_POOL_SIZE": "0", "SANDBOX_INTERPRETER_WARM": ""},
        max_fds=1024,
    )
    try:
        server.start()
        assert ready(server)[0] == 200
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (server.open_fds() + 8, 1024))
        status, body = ready(server)
        assert status == 503, body
        assert any("file descriptors nearly exhausted" in r for r in body["reasons"]), body
        health = server.health()
        assert health["status"] == "degraded", health
        assert "nearly exhausted" in health["file_descriptors"]["problem"], health

        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (1024, 1024))
        status, body = ready(server)
        assert status == 200, body
        assert server.health()["file_descriptors"]["problem"] is None
    finally:
        stop_all(stop_if_running(server))
