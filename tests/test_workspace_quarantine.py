"""A workspace set aside or repaired leaves its session usable (issue 41).

The reproduction: a server killed (-9) leaves its workspaces mounted; the next server on the
state directory detaches them at start. A session whose image can no longer be mounted (its
superblock gone) is checked, set aside (.quarantine/) and made afresh: its next call says
`session_reset: workspace_quarantined` once, and every later call of every tool works
(execute_code, run_code in an interpreter, write_file, read_file, list_files), whichever tool
comes first. A repaired image (e2fsck fixed it) works on too. Real servers, real images, the
official client.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import (
    Conn,
    ServerProcess,
    alive,
    eventually,
    open_client,
    release_disk,
    running_server,
)

from sandbox_runtime.workspaces.repair import loop_attached

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("mkfs.ext4") is None,
        reason="needs root and mkfs.ext4 for workspace images",
    ),
]

TOKEN = "quarantine-token-0123456789"
SETTINGS = {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_WORKSPACE_MB": "16"}


def images(state: Path) -> set[Path]:
    return set((state / "workspaces").glob("ws-*.img"))


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def break_superblock(image: Path) -> None:
    with open(image, "r+b") as f:
        f.write(b"\0" * 8192)  # the primary superblock (e2fsck -p does not look for backups)


def kill_hard(server: ServerProcess) -> None:
    """kill -9 the server and whatever it started (its sandboxes, kernels): its mounts stay."""
    below = server.descendants()
    server.kill()
    for pid, start_time in below:
        if alive(pid, start_time):
            os.kill(pid, signal.SIGKILL)


def out(ran: dict[str, Any]) -> str:
    return "".join(e.get("data") or "" for e in ran["output"] if e.get("type") != "stderr")


async def every_tool_works(conn: Conn, s: str, first: str) -> list[str]:
    """Call each tool on session `s` twice, `first` first: the session_reset reasons seen."""
    order = ["execute_code", "run_code", "write_file", "read_file", "list_files"]
    order.remove(first)
    resets: list[str] = []
    for round_ in range(2):
        for tool in [first, *order]:
            if tool == "execute_code":
                got = await conn.ok(
                    "execute_code", command=f"echo ok{round_} > e.txt; pwd", session=s
                )
                assert out(got).strip() == "/workspace", got
            elif tool == "run_code":
                got = await conn.ok(
                    "run_code", code=f"open('r.txt','w').write('r{round_}')", session=s
                )
                assert not got.get("error"), got
            elif tool == "write_file":
                got = await conn.ok("write_file", path="w.txt", content=f"w{round_}", session=s)
            elif tool == "read_file":
                wrote = await conn.ok("write_file", path="rd.txt", content="read me", session=s)
                if wrote.get("session_reset"):
                    resets.append(wrote["session_reset"]["reason"])
                got = await conn.ok("read_file", path="rd.txt", session=s)
                assert got["content"] == "read me", got
            else:
                got = await conn.ok("list_files", session=s)
                assert isinstance(got["entries"], list), got
            if got.get("session_reset"):
                resets.append(got["session_reset"]["reason"])
    listed = await conn.ok("list_files", session=s)
    names = {e["path"] for e in listed["entries"]}
    assert {"e.txt", "r.txt", "w.txt", "rd.txt"} <= names, listed
    return resets


async def test_a_quarantined_workspace_leaves_its_session_usable(tmp_path: Path) -> None:
    """kill -9 leaves mounts; the next server detaches them; sessions whose images are broken
    get a fresh workspace, told once, and every tool works on them from then on."""
    state = tmp_path / "state"
    first_tools = ["write_file", "run_code", "execute_code", "list_files", "read_file"]
    sessions = {tool: f"q-{tool}-{uuid.uuid4().hex[:6]}" for tool in first_tools}
    kept = f"kept-{uuid.uuid4().hex[:6]}"
    made: dict[str, Path] = {}
    server = ServerProcess(tmp_path, dict(SETTINGS)).start()
    try:
        async with open_client(server.url, TOKEN, "auto") as conn:
            for s in [*sessions.values(), kept]:
                before = images(state)
                await conn.ok("write_file", path="old.txt", content="old", session=s)
                await conn.ok("run_code", code="x = 1", session=s)
                await conn.ok("execute_code", command="echo hi", session=s)
                (made[s],) = images(state) - before
        kill_hard(server)
        for s in sessions.values():  # (broken after the kill: a mount of it stays till then)
            sh("umount", str(made[s].with_suffix("")))
            # (The kernel writes the superblock when it lets the filesystem go: after that.)
            await eventually(lambda i=made[s]: not loop_attached(i), 10, "the loop detached")
            break_superblock(made[s])
        server = ServerProcess(tmp_path, dict(SETTINGS)).start()
        assert "detached a workspace a previous server left mounted" in server.stderr_text()
        async with open_client(server.url, TOKEN, "auto") as conn:
            for tool, s in sessions.items():
                resets = await every_tool_works(conn, s, tool)
                assert resets == ["workspace_quarantined"], (tool, resets)
                listed = await conn.ok("list_files", session=s)
                assert "old.txt" not in {e["path"] for e in listed["entries"]}
            # The one left mounted and detached at start kept its files.
            got = await conn.ok("read_file", path="old.txt", session=kept)
            assert got["content"] == "old" and not got.get("session_reset"), got
            assert await every_tool_works(conn, kept, "run_code") == []
        quarantined = list((state / "workspaces" / ".quarantine").iterdir())
        assert len(quarantined) == len(sessions), quarantined
    finally:
        server.close()
        release_disk(state)


async def test_a_repaired_workspace_works_on(tmp_path: Path) -> None:
    """An image whose filesystem records an error is checked (e2fsck -p) before it is
    mounted again: repaired or clean, its files are kept and every tool works on."""
    state, s = tmp_path / "state", f"rep-{uuid.uuid4().hex[:6]}"
    with running_server(tmp_path, **SETTINGS) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="old.txt", content="old", session=s)
            await conn.ok("run_code", code="x = 1", session=s)
    (image,) = images(state)
    # Mark it as the kernel does after an error (s_state's error bit), and break a block
    # bitmap's count the way e2fsck -p repairs.
    sh("debugfs", "-w", "-R", "ssv state 3", str(image))
    sh("debugfs", "-w", "-R", "ssv free_blocks_count 1", str(image))
    try:
        with running_server(tmp_path, **SETTINGS) as server:
            async with open_client(server.url, TOKEN, "auto") as conn:
                got = await conn.ok("read_file", path="old.txt", session=s)
                assert got["content"] == "old", got
                assert got.get("session_reset", {}).get("reason") == "workspace_repaired", got
                assert await every_tool_works(conn, s, "run_code") == []
    finally:
        release_disk(state)


async def test_a_workspace_that_fails_under_its_interpreter_is_checked_at_once(
    tmp_path: Path,
) -> None:
    """A workspace whose filesystem fails while the session's interpreter idles in it (the
    kernel remounts it read-only) is not held up by that interpreter: the next call stops it,
    checks the image and serves the session again; every tool works after."""
    state, s = tmp_path / "state", f"ro-{uuid.uuid4().hex[:6]}"
    try:
        with running_server(tmp_path, **SETTINGS) as server:
            async with open_client(server.url, TOKEN, "auto") as conn:
                before = images(state)
                await conn.ok("write_file", path="old.txt", content="old", session=s)
                await conn.ok("run_code", code="x = 41", session=s)
                (image,) = images(state) - before
                point = image.with_suffix("")
                sh("mount", "-o", "remount,ro", str(point))
                got = await conn.ok("read_file", path="old.txt", session=s)
                assert got["content"] == "old", got
                ran = await conn.ok("run_code", code="1", session=s)
                assert ran.get("state_reset", {}).get("reason") == "workspace_failed", ran
                assert await every_tool_works(conn, s, "write_file") == []
    finally:
        release_disk(state)


async def test_a_mount_lost_under_the_server_is_mounted_again(tmp_path: Path) -> None:
    """A session's workspace unmounted behind the server's back (what a second server on the
    same state directory did at its start) is not served as the empty mount point it leaves:
    the next call finds it gone, checks the image and mounts it again, files kept."""
    state, s = tmp_path / "state", f"lost-{uuid.uuid4().hex[:6]}"
    try:
        with running_server(tmp_path, **SETTINGS) as server:
            async with open_client(server.url, TOKEN, "auto") as conn:
                before = images(state)
                await conn.ok("write_file", path="old.txt", content="old", session=s)
                await conn.ok("run_code", code="x = 41", session=s)
                await conn.ok("execute_code", command="true", session=s)
                (image,) = images(state) - before
                sh("umount", "-l", str(image.with_suffix("")))
                for tool in ["execute_code", "list_files", "read_file"]:
                    if tool == "execute_code":
                        ran = await conn.ok("execute_code", command="cat old.txt", session=s)
                        assert out(ran) == "old", ran
                    elif tool == "list_files":
                        listed = await conn.ok("list_files", session=s)
                        assert "old.txt" in {e["path"] for e in listed["entries"]}, listed
                    else:
                        got = await conn.ok("read_file", path="old.txt", session=s)
                        assert got["content"] == "old", got
                assert await every_tool_works(conn, s, "run_code") == []
    finally:
        release_disk(state)
