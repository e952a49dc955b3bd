"""A state directory belongs to one live server (issue 41).

A second server on the same SANDBOX_STATE_DIR refuses to start with one line naming the other
(pid, host, since when) and what to do, exits non-zero, and touches nothing: the first's
mounts, blanks and warm slots stay, and its sessions go on. No process the server started
holds the lock. A killed server's directory is free at once, and its leftovers are cleaned at
start. Real server processes, real images.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest
from mcp_harness import ServerProcess, alive, open_client, release_disk, run_server_once

from sandbox_runtime.app.state_lock import LOCK_FILE
from sandbox_runtime.workspaces.images import mounts_under

pytestmark = pytest.mark.e2e

TOKEN = "state-lock-token-0123456789"
SETTINGS = {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_WORKSPACE_POOL": "1"}


def holders(path: Path) -> list[int]:
    """Processes with `path` open."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def state_of(state: Path) -> tuple[list[Path], list[str]]:
    """What a second server's start would have undone: mounts and workspace entries."""
    root = state / "workspaces"
    return sorted(mounts_under(root)), sorted(p.name for p in root.iterdir())


async def test_a_second_server_on_a_state_directory_refuses_and_touches_nothing(
    tmp_path: Path,
) -> None:
    s = f"lock-{uuid.uuid4().hex[:6]}"
    server = ServerProcess(tmp_path, dict(SETTINGS)).start()
    state = server.state_dir
    try:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="a.txt", content="first", session=s)
            await conn.ok("run_code", code="x = 1", session=s)
            before = state_of(state)
            assert before[0], "the first server has its workspaces mounted"

            code, stderr = run_server_once(state, **SETTINGS)
            assert code == 1, stderr
            lines = [line for line in stderr.splitlines() if line.strip()]
            assert len(lines) == 1, stderr
            line = lines[0]
            assert f"pid {server.pid} on host {socket.gethostname()}, since " in line, line
            assert "stop that server first" in line and "SANDBOX_STATE_DIR" in line, line
            assert state_of(state) == before  # nothing detached, nothing removed

            got = await conn.ok("read_file", path="a.txt", session=s)
            assert got["content"] == "first" and not got.get("session_reset"), got
            ran = await conn.ok("run_code", code="x + 1", session=s)
            assert not ran.get("state_reset"), ran
            ran = await conn.ok("execute_code", command="cat a.txt", session=s)
            assert ran["exit_code"] == 0, ran

        # Only the server holds the lock: none of its sandboxes, kernels or helpers.
        lock = state / LOCK_FILE
        assert holders(lock) == [server.pid]
        below = server.descendants()
        assert below, "the server has started processes (kernels, the spawner)"

        # Killed, it lets go at once; the next server cleans what it left and serves on.
        server.kill()
        for pid, start_time in below:
            if alive(pid, start_time):
                os.kill(pid, 9)
        assert mounts_under(state / "workspaces"), "a killed server leaves its mounts"
        server = ServerProcess(tmp_path, dict(SETTINGS)).start()
        assert "detached a workspace a previous server left mounted" in server.stderr_text()
        assert f'"pid": {server.pid}' in lock.read_text()
        async with open_client(server.url, TOKEN, "auto") as conn:
            got = await conn.ok("read_file", path="a.txt", session=s)
            assert got["content"] == "first", got
        server.stop()
        server = ServerProcess(tmp_path, dict(SETTINGS)).start()  # (a stopped one: free too)
    finally:
        server.close()
        release_disk(state)


def test_an_api_replica_takes_no_lock(tmp_path: Path) -> None:
    """An api replica runs no sandboxes and keeps nothing in its state directory that another
    could break: it does not lock it (and the CLI's other commands never do)."""
    from sandbox_runtime.app.state_lock import needs_lock

    assert not needs_lock("api")
    assert needs_lock("all") and needs_lock("worker")


async def test_a_killed_servers_leftovers_are_found_through_a_symlinked_state_directory(
    tmp_path: Path,
) -> None:
    """SANDBOX_STATE_DIR may be a symlink (the kernel lists mounts by their real path): a
    killed server's workspace mounts and kernel directories are still detached at the next
    start, and its session's image is mounted once, not a second time over the first."""
    real = tmp_path / "real-state"
    real.mkdir()
    (tmp_path / "state").symlink_to(real)
    s = f"lock-{uuid.uuid4().hex[:6]}"
    settings = {**SETTINGS, "SANDBOX_WORKSPACE_POOL": "0"}
    server = ServerProcess(tmp_path, dict(settings)).start()
    try:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="a.txt", content="first", session=s)
            await conn.ok("run_code", code="x = 1", session=s)
        below = server.descendants()
        server.kill()
        for pid, start_time in below:
            if alive(pid, start_time):
                os.kill(pid, 9)
        left = mounts_under(real / "kernels")
        assert mounts_under(real / "workspaces") and left

        server = ServerProcess(tmp_path, dict(settings)).start()
        assert "detached a workspace a previous server left mounted" in server.stderr_text()
        assert not set(left) & set(mounts_under(real / "kernels")), "kernel directories left"
        async with open_client(server.url, TOKEN, "auto") as conn:
            got = await conn.ok("read_file", path="a.txt", session=s)
            assert got["content"] == "first", got
        points = mounts_under(real / "workspaces")
        assert len(points) == len(set(points)), f"an image mounted twice: {points}"
    finally:
        server.close()
        release_disk(real)
