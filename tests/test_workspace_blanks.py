"""Workspaces made ahead of need: a new session's first call takes an empty, mounted one
instead of making its image; the server keeps SANDBOX_WORKSPACE_POOL of them, yields them
first to the mount cap, and leaves none behind (at its end, or a previous server's at start).

A real server with workspace images (root, loop devices) and the official client.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from mcp_harness import ServerProcess, Servers, open_client

pytestmark = pytest.mark.e2e

TOKEN = "blanks-token-1"


def blanks(server: ServerProcess) -> list[Path]:
    return sorted((server.state_dir / "workspaces").glob("blank-*.img"))


def images(server: ServerProcess) -> list[Path]:
    return sorted((server.state_dir / "workspaces").glob("*.img"))


def wait_for(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    # (A pool that does not grow with demand: test_workspace_bursts.py has the growing one.)
    started = serve(
        "blanks",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_WORKSPACE_MB="64",
        SANDBOX_WORKSPACE_POOL_MAX="2",
    )
    wait_for(lambda: len(blanks(started)) == 2)
    return started


async def test_a_new_session_takes_a_blank_and_the_pool_fills_again(server: ServerProcess) -> None:
    before = set(blanks(server))
    session = f"fresh-{uuid.uuid4().hex[:8]}"
    async with open_client(server.url, TOKEN, "legacy") as conn:
        wrote = await conn.ok("execute_code", command="echo kept > f; ls -A", session=session)
        assert wrote["exit_code"] == 0
        assert wrote["output"][1]["data"] == "f\n"  # (empty before: no lost+found, no leftovers)
        read = await conn.ok("execute_code", command="cat f; df -m . | tail -1", session=session)
        text = "".join(e["data"] for e in read["output"] if e["type"] == "stdout")
        assert text.startswith("kept\n")
        assert int(text.split()[2]) <= 64  # its own 64 MiB filesystem
    taken = before - set(blanks(server))
    assert len(taken) == 1  # this session's image was one of them
    wait_for(lambda: len(blanks(server)) == 2)


async def test_concurrent_new_sessions_each_get_their_own(server: ServerProcess) -> None:
    async with open_client(server.url, TOKEN, "auto") as conn:
        names = [f"many-{uuid.uuid4().hex[:8]}" for _ in range(5)]
        results = await asyncio.gather(
            *(conn.ok("execute_code", command=f"echo {n} > mine; ls -A", session=n) for n in names)
        )
        assert all(r["output"][1]["data"] == "mine\n" for r in results)
        for name in names:
            read = await conn.ok("execute_code", command="cat mine", session=name)
            assert read["output"][1]["data"] == f"{name}\n"
    wait_for(lambda: len(blanks(server)) == 2)


async def test_blanks_yield_to_sessions_at_the_mount_cap(serve: Servers) -> None:
    capped = serve(
        "blanks-capped",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_WORKSPACE_MB="64",
        SANDBOX_MAX_MOUNTED_WORKSPACES="3",
        SANDBOX_POOL_SIZE="0",
    )
    wait_for(lambda: len(blanks(capped)) == 2)
    async with open_client(capped.url, TOKEN, "legacy") as conn:
        for i in range(3):
            done = await conn.ok("execute_code", command="true", session=f"cap-{i}")
            assert done["exit_code"] == 0
    # Sessions took the mounts (a warm interpreter's slot holds one too): no blank is left,
    # removed rather than left on disk.
    wait_for(lambda: blanks(capped) == [])
    assert len([p for p in images(capped) if p.name.startswith("ws-")]) == 3


def test_none_outlives_its_server_and_a_previous_servers_are_removed(serve: Servers) -> None:
    first = serve("blanks-end", SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_WORKSPACE_MB="64")
    wait_for(lambda: len(blanks(first)) == 2)
    first.stop()  # (asserts a clean exit)
    assert blanks(first) == []
    # A server killed leaves its blanks; the next one on the state dir removes them.
    leftover = first.state_dir / "workspaces" / "blank-0123456789abcdef0123.img"
    leftover.write_bytes(b"\0" * 4096)
    again = serve.add(ServerProcess(first.workdir, first.settings))
    wait_for(lambda: len(blanks(again)) == 2)
    assert leftover not in blanks(again)


def test_none_made_when_turned_off(serve: Servers) -> None:
    off = serve(
        "blanks-off",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_WORKSPACE_MB="64",
        SANDBOX_WORKSPACE_POOL="0",
    )
    time.sleep(1.5)
    assert blanks(off) == []
