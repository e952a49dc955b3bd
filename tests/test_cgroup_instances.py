"""Servers on one host never touch each other's cgroups, even with one replica id: each names
its parent group for its own process, and removes at start only groups whose process has
ended (a server killed with SIGKILL leaves its groups to the next start)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import started_backend
from mcp_harness import (
    Conn,
    ServerProcess,
    alive,
    eventually,
    open_client,
    proc_start_time,
    processes_with,
    stop_all,
    stop_if_running,
)

TOKEN = "cgroup-test-token-0123456789"
MIB = 1024 * 1024
SERVER_MEMORY_MB = 300


def settings(replica_id: str) -> dict[str, str]:
    return {
        "SANDBOX_AUTH_TOKEN": TOKEN,
        "SANDBOX_REPLICA_ID": replica_id,
        "SANDBOX_MEMORY_MB": str(SERVER_MEMORY_MB),
    }


def cgroup_mounts() -> dict[str, Path]:
    """Mount point of the unified hierarchy ("v2") and of each v1 controller."""
    found: dict[str, Path] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = right.split()[:3]
            point = Path(left.split()[4])
            if fstype == "cgroup2":
                found.setdefault("v2", point)
            elif fstype == "cgroup":
                for option in options.split(","):
                    found.setdefault(option, point)
    return found


def cgroup_dirs(pid: int) -> dict[str, Path]:
    """The cgroup directories of `pid`: "v2", and "memory" and "pids" on v1."""
    mounts = cgroup_mounts()
    dirs: dict[str, Path] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        keys = ["v2"] if hierarchy == "0" else controllers.split(",")
        for key in keys:
            if key in ("v2", "memory", "pids") and key in mounts:
                dirs[key] = mounts[key] / path.lstrip("/")
    return dirs


def execution_groups(pid: int) -> list[Path]:
    """The execution groups of sandboxed process `pid` (one per hierarchy it is limited in)."""
    return [d for d in cgroup_dirs(pid).values() if d.name.startswith("x-")]


def memory_limit(pid: int) -> int:
    dirs = cgroup_dirs(pid)
    if "memory" in dirs and (dirs["memory"] / "memory.limit_in_bytes").exists():
        return int((dirs["memory"] / "memory.limit_in_bytes").read_text())
    return int((dirs["v2"] / "memory.max").read_text())


async def start_sleeper(conn: Conn, marker: str, **options: Any) -> tuple[str, int, str]:
    """A running execution of `sleep`, found on the host: (execution id, pid, start time)."""
    started = await conn.ok(
        "execute_code_async",
        command=["/usr/bin/python3", "-c", "import time; time.sleep(120)", marker],
        **options,
    )

    def sleepers() -> list[tuple[int, str]]:  # (not bwrap, whose command line names it too)
        return [p for p in processes_with(marker) if p[1].startswith("/usr/bin/python3 ")]

    found = await eventually(sleepers, 10, f"{marker} to run")
    assert len(found) == 1, found
    pid = found[0][0]
    return started["execution_id"], pid, proc_start_time(pid) or ""


def parent_groups(pid: int) -> set[Path]:
    groups = execution_groups(pid)
    assert groups, f"process {pid} is in no execution cgroup: {cgroup_dirs(pid)}"
    return {g.parent for g in groups}


@pytest.mark.e2e
async def test_two_servers_with_one_replica_id_never_touch_each_others_cgroups(
    tmp_path: Path,
) -> None:
    replica_id = f"same-{uuid.uuid4().hex[:6]}"
    a = ServerProcess(tmp_path / "a", settings(replica_id))
    b = ServerProcess(tmp_path / "b", settings(replica_id))
    try:
        a.start()
        async with open_client(a.url, TOKEN, "auto") as on_a:
            first = await on_a.ok("execute_code", command="true")  # leaves A a pooled group
            assert first["status"] == "completed"
            b.start()  # its start-up cleanup must not take A's groups
            async with open_client(b.url, TOKEN, "auto") as on_b:
                marker_a, marker_b = (f"srt-cg-{uuid.uuid4().hex}" for _ in range(2))
                _, pid_a, start_a = await start_sleeper(on_a, marker_a)
                id_b, pid_b, start_b = await start_sleeper(on_b, marker_b)
                assert memory_limit(pid_a) == SERVER_MEMORY_MB * MIB
                assert memory_limit(pid_b) == SERVER_MEMORY_MB * MIB
                groups_a, groups_b = parent_groups(pid_a), parent_groups(pid_b)
                names_a, names_b = {g.name for g in groups_a}, {g.name for g in groups_b}
                assert names_a.isdisjoint(names_b), (names_a, names_b)
                for names, server in ((names_a, a), (names_b, b)):
                    for name in names:  # `srt-<replica>.<pid>.<start>.<pid namespace>`
                        assert name.startswith(f"srt-{replica_id}.{server.pid}."), name

                a.stop()  # SIGTERM: A ends its executions and removes its own groups
                assert not alive(pid_a, start_a)
                await eventually(
                    lambda: not any(g.exists() for g in groups_a), 5, "A's groups to go"
                )
                # B's execution runs on, in its group; its new executions still get limits.
                assert alive(pid_b, start_b)
                assert all(g.is_dir() for g in groups_b)
                status = await on_b.ok("get_execution_status", execution_id=id_b)
                assert status["status"] == "running"
                marker_c = f"srt-cg-{uuid.uuid4().hex}"
                _, pid_c, _ = await start_sleeper(on_b, marker_c, sandbox_config={"memory_mb": 200})
                assert memory_limit(pid_c) == 200 * MIB
                assert parent_groups(pid_c) == groups_b
                page = await on_b.ok("execute_code", command="echo still-limited")
                assert page["status"] == "completed"
                for execution in (await on_b.ok("list_executions", status="running"))["result"]:
                    await on_b.ok("cancel_execution", execution_id=execution["id"], force=True)
                assert alive(pid_b, start_b) is False
    finally:
        stop_all(stop_if_running(a), stop_if_running(b))


@pytest.mark.e2e
async def test_a_server_killed_with_sigkill_leaves_its_groups_to_the_next_start(
    tmp_path: Path,
) -> None:
    replica_id = f"kill-{uuid.uuid4().hex[:6]}"
    first = ServerProcess(tmp_path / "srv", settings(replica_id))
    second = ServerProcess(tmp_path / "srv", settings(replica_id))
    try:
        first.start()
        marker = f"srt-cg-{uuid.uuid4().hex}"
        async with open_client(first.url, TOKEN, "auto") as conn:
            _, pid, _ = await start_sleeper(conn, marker)
            groups = parent_groups(pid)
        first.kill()  # SIGKILL: no clean-up of its own
        assert all(g.is_dir() for g in groups), "a killed server leaves its groups"
        second.start()  # the same replica id and state directory, a new process
        assert not [g for g in groups if g.exists()], "the next start removes them"
        assert not processes_with(marker)
        async with open_client(second.url, TOKEN, "auto") as conn:
            marker = f"srt-cg-{uuid.uuid4().hex}"
            execution_id, pid, _ = await start_sleeper(conn, marker)
            assert memory_limit(pid) == SERVER_MEMORY_MB * MIB
            assert parent_groups(pid).isdisjoint(groups)
            await conn.ok("cancel_execution", execution_id=execution_id, force=True)
    finally:
        stop_all(first.kill, stop_if_running(second))


def _dead_process() -> tuple[int, int]:
    """(pid, start time) of a process that has ended."""
    proc = subprocess.Popen(["sleep", "30"])
    start = int(proc_start_time(proc.pid) or 0)
    proc.kill()
    proc.wait()
    return proc.pid, start


@pytest.mark.integration
async def test_start_removes_only_groups_whose_process_has_ended(tmp_path: Path) -> None:
    """A stale group is removed with what still runs in it; a live process's group, or one
    named in another pid namespace (whose pids mean nothing here), is kept."""
    parent = cgroup_dirs(os.getpid())["pids"]  # where a backend of this process makes its own
    namespace = os.stat("/proc/self/ns/pid").st_ino
    dead_pid, dead_start = _dead_process()
    tag = uuid.uuid4().hex[:6]
    stale = parent / f"srt-{tag}.{dead_pid}.{dead_start}.{namespace}"
    stale_leaf = parent / f"srt-{tag}.{dead_pid}.{dead_start}.{namespace}-server"
    live = parent / f"srt-{tag}.{os.getpid()}.{proc_start_time(os.getpid())}.{namespace}"
    elsewhere = parent / f"srt-{tag}.{dead_pid}.{dead_start}.{namespace + 1}"
    foreign = parent / f"other-{tag}.{dead_pid}.{dead_start}.{namespace}"
    made = [stale, stale_leaf, live, elsewhere, foreign]
    leftover = subprocess.Popen(["sleep", "60"])
    try:
        for group in made:
            group.mkdir()
        (stale / f"x-{tag}").mkdir()
        (stale / f"x-{tag}" / "cgroup.procs").write_text(str(leftover.pid))
        async with started_backend(tmp_path):
            assert not stale.exists() and not stale_leaf.exists()
            assert leftover.wait(5) == -9, "what ran in the stale group is killed"
            assert live.is_dir() and elsewhere.is_dir() and foreign.is_dir()
    finally:
        leftover.kill()
        leftover.wait()
        for group in [stale / f"x-{tag}", *made]:  # (children first)
            if group.exists():
                group.rmdir()
