"""Sandboxes started ahead of need (sandbox/pool.py), with real bwrap: each serves one call,
is what that call's own sandbox would be, and nothing of them outlives the pool.

The isolation tests of tests/test_sandbox.py run against sandboxes started ahead as well (the
`started-ahead` parameter of the `sandbox_backend` fixture)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import started_backend
from test_sandbox import (
    busy_execution_cgroups,
    collect,
    sandbox_uid_processes,
    wait_until,
    with_marker,
)

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.errors import (
    InvalidRequestError,
    SandboxSpawnError,
    SandboxUnavailableError,
)
from sandbox_runtime.sandbox import BubblewrapBackend, SandboxLimits, SandboxSpec, shell_argv
from sandbox_runtime.sandbox.backend import StartedSandbox
from sandbox_runtime.sandbox.pool import (
    MISS_BUSY,
    MISS_EMPTY,
    MISS_LIMITS,
    MISS_UNPOOLABLE,
    SandboxPool,
)

pytestmark = pytest.mark.integration


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[BubblewrapBackend]:
    async with started_backend(tmp_path) as backend:
        yield backend


def new_pool(backend: BubblewrapBackend, size: int = 4, idle_seconds: float = 60) -> SandboxPool:
    """A started pool under the backend's limits."""
    pool = SandboxPool(backend, backend.config.limits, size=size, idle_seconds=idle_seconds)
    pool.cpus = 64  # (refills are skipped on a machine without spare CPU: not here)
    pool.start()
    return pool


@pytest.fixture
async def pool(backend: BubblewrapBackend) -> AsyncIterator[SandboxPool]:
    pool = new_pool(backend)
    try:
        yield pool
    finally:
        await pool.aclose()


def spec(
    backend: BubblewrapBackend, workspace: Path, command: str | list[str], **kw: object
) -> SandboxSpec:
    argv = shell_argv(command) if isinstance(command, str) else command
    fields: dict[str, object] = {"limits": backend.config.limits, "timeout": 20.0, **kw}
    return SandboxSpec(argv=argv, workspace=workspace, **fields)  # type: ignore[arg-type]


async def ready(pool: SandboxPool, count: int = 1) -> None:
    await wait_until(lambda: pool.ready_count >= count, what=f"{count} sandboxes started ahead")


async def after_one_call(
    backend: BubblewrapBackend, pool: SandboxPool
) -> tuple[Path, StartedSandbox]:
    """A workspace after one call, and the sandbox now started ahead for its next."""
    workspace = backend.create_workspace("ws")
    await collect(await pool.spawn(spec(backend, workspace, "true")))
    await ready(pool)
    return workspace, next(iter(pool._ready.values()))


async def test_the_second_call_of_a_workspace_runs_in_a_sandbox_started_ahead(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    first = await collect(await pool.spawn(spec(backend, workspace, "echo first")))
    assert (first.stdout, pool.hits, pool.misses) == ("first\n", 0, {MISS_EMPTY: 1})
    await ready(pool)
    waiting = next(iter(pool._ready.values()))
    assert backend.running_count == 0  # a sandbox waiting for a command runs none
    second = await collect(await pool.spawn(spec(backend, workspace, "echo second")))
    assert (second.stdout, second.outcome.exit_code, pool.hits) == ("second\n", 0, 1)
    assert not waiting.usable  # used once: its command pipe is gone
    with pytest.raises(SandboxSpawnError):
        backend.launch(waiting, spec(backend, workspace, "echo third"))


async def test_a_sandbox_started_ahead_serves_one_call_and_leaves_nothing_to_the_next(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    await collect(await pool.spawn(spec(backend, workspace, "true")))
    # Each call: the previous call's /tmp file and background process must be gone.
    probe = (
        "ls -A /tmp | wc -l; cat /proc/[0-9]*/comm 2>/dev/null | grep -c sleep; "
        "echo left > /tmp/left; (sleep 60 &); sleep 60 & echo started"
    )
    for _ in range(6):
        await ready(pool)
        run = await collect(await pool.spawn(spec(backend, workspace, probe)))
        assert run.stdout.split() == ["0", "0", "started"], run
    assert pool.hits == 6
    assert not with_marker("sleep 60")  # (ended with their sandboxes)


async def test_environment_directory_and_stdin_are_the_calls_as_without_the_pool(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    (workspace / "sub").mkdir()
    os.chown(workspace / "sub", backend.sandbox_uid, backend.sandbox_gid)
    probe = (
        "env | LC_ALL=C sort; pwd; readlink /proc/self/fd/0; cat /proc/self/status | "
        "grep -E '^(Uid|Gid|Groups|NoNewPrivs|Seccomp|CapEff|CapBnd):'; ulimit -a; "
        "cat /proc/self/cgroup | sed 's/x-[0-9a-f]*/GROUP/'"
    )
    call = spec(
        backend, workspace, probe, env={"A": "1", "WEIRD": "x'y\"z\n$HOME"}, cwd="/workspace/sub"
    )
    direct = await collect(await backend.spawn(replace(call)))
    await collect(await pool.spawn(spec(backend, workspace, "true")))
    await ready(pool)
    pooled = await collect(await pool.spawn(replace(call)))
    assert pool.hits == 1
    assert pooled.stdout == direct.stdout and pooled.stderr == direct.stderr == ""
    assert "WEIRD=x'y\"z\n" in pooled.stdout and "/workspace/sub\n/dev/null\n" in pooled.stdout
    # Without a shell (which sets PWD itself): PWD is the directory, whatever the caller set.
    env_only = spec(backend, workspace, ["/usr/bin/env"], env={"PWD": "/elsewhere"}, cwd="/tmp")
    direct = await collect(await backend.spawn(replace(env_only)))
    await ready(pool)
    pooled = await collect(await pool.spawn(replace(env_only)))
    assert sorted(pooled.stdout.splitlines()) == sorted(direct.stdout.splitlines())
    assert "PWD=/tmp" in pooled.stdout.splitlines()
    # Typed input reaches an interactive call, as without the pool.
    await ready(pool)
    proc = await pool.spawn(spec(backend, workspace, ["cat"], interactive=True))
    assert proc.stdin is not None
    proc.stdin.write(b"typed\n")
    await proc.stdin.drain()
    proc.stdin.close()
    assert (await collect(proc)).stdout == "typed\n"
    assert pool.hits == 3


async def test_errors_of_a_missing_program_or_directory_are_bwraps_own(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    calls = [
        spec(backend, workspace, ["no-such-program", "x"]),
        spec(backend, workspace, ["/etc/passwd"]),
        spec(backend, workspace, "true", cwd="/workspace/missing"),
    ]
    await collect(await pool.spawn(spec(backend, workspace, "true")))
    for call in calls:
        direct = await collect(await backend.spawn(replace(call)))
        await ready(pool)
        hits = pool.hits
        pooled = await collect(await pool.spawn(replace(call)))
        assert pool.hits == hits + 1
        assert (pooled.outcome.exit_code, pooled.stderr) == (
            direct.outcome.exit_code,
            direct.stderr,
        ), call.argv
        assert direct.outcome.exit_code == 1 and direct.stderr.startswith("bwrap: ")


async def test_tighter_limits_and_egress_start_a_sandbox_of_their_own(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace, _ = await after_one_call(backend, pool)
    tight = backend.config.limits.tighten({"memory_mb": 32})
    hog = "python3 -c 'a = bytearray(200 * 2**20); a[::4096] = b\"1\" * (len(a) // 4096)'"
    run = await collect(await pool.spawn(spec(backend, workspace, hog, limits=tight)))
    assert run.outcome.reason == "memory"  # the tighter limit held
    assert pool.misses.get(MISS_LIMITS) == 1 and pool.hits == 0
    assert pool.ready_count == 1  # the waiting one is still there, for calls it fits
    egress = EgressPolicy("example.test")
    assert not backend.can_prestart(spec(backend, workspace, "true", egress=egress))
    with pytest.raises(SandboxUnavailableError):  # (no proxy in this test: refused, not pooled)
        await pool.spawn(spec(backend, workspace, "true", egress=egress))
    assert pool.misses.get(MISS_UNPOOLABLE) == 1


async def test_the_wall_clock_timeout_and_duration_count_from_the_call(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace, _ = await after_one_call(backend, pool)
    await asyncio.sleep(1.5)  # waiting longer than the call's timeout
    started = time.monotonic()
    run = await collect(await pool.spawn(spec(backend, workspace, "sleep 30", timeout=0.8)))
    assert pool.hits == 1
    assert run.outcome.reason == "timeout"
    assert 0.7 < run.outcome.duration_s < 3.0
    assert time.monotonic() - started < 4.0
    assert run.outcome.cpu_seconds is not None and run.outcome.cpu_seconds < 0.5


async def test_bounded_per_replica_idle_ones_end_and_a_removed_workspace_loses_its_own(
    backend: BubblewrapBackend,
) -> None:
    pool = new_pool(backend, size=2, idle_seconds=1.0)
    try:
        spaces = [backend.create_workspace(f"ws{i}") for i in range(4)]
        for workspace in spaces:
            await collect(await pool.spawn(spec(backend, workspace, "true")))
        await ready(pool, 2)
        await asyncio.sleep(0.3)
        assert pool.ready_count + pool.starting_count == 2  # never more than the size
        assert len(pool.workspaces()) == 2
        marker = "stub-of-a-removed-workspace"
        await pool.discard_workspace(spaces[0])
        await pool.discard_workspace(spaces[1])
        assert pool.workspaces() <= {s.name for s in spaces[2:]}
        await collect(await pool.spawn(spec(backend, spaces[2], f"echo {marker}")))
        await ready(pool)
        # Unused for idle_seconds: ended; nothing of it is left.
        await wait_until(lambda: pool.ready_count == 0, within=6, what="idle ones ended")
        await wait_until(lambda: not busy_execution_cgroups(backend), what="cgroups empty")
        await wait_until(lambda: not sandbox_uid_processes(backend), what="no sandbox processes")
        assert not with_marker(marker)
    finally:
        await pool.aclose()


async def test_close_ends_every_sandbox_waiting_or_starting(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    spaces = [backend.create_workspace(f"ws{i}") for i in range(3)]
    for workspace in spaces:
        await collect(await pool.spawn(spec(backend, workspace, "true")))
    await ready(pool, 2)  # (the third may still be starting: close() must end it too)
    assert sandbox_uid_processes(backend)
    await pool.aclose()
    assert pool.ready_count == 0 and pool.starting_count == 0
    await wait_until(lambda: not sandbox_uid_processes(backend), what="no sandbox processes")
    await wait_until(lambda: not busy_execution_cgroups(backend), what="cgroups empty")
    assert backend.running_count == 0
    # A closed pool starts nothing more: calls get sandboxes of their own.
    run = await collect(await pool.spawn(spec(backend, spaces[0], "echo after")))
    assert run.stdout == "after\n"
    await asyncio.sleep(0.2)
    assert pool.ready_count == 0 and not pool.workspaces()


async def test_a_sandbox_started_ahead_that_died_is_not_used(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace, waiting = await after_one_call(backend, pool)
    waiting.proc.kill()
    await waiting.proc.wait()
    run = await collect(await pool.spawn(spec(backend, workspace, "echo fine")))
    assert run.stdout == "fine\n" and pool.hits == 0 and pool.misses.get("ended") == 1


async def test_the_stub_ends_when_its_command_pipe_closes_without_a_command(
    backend: BubblewrapBackend,
) -> None:
    workspace = backend.create_workspace("ws")
    started = await backend.prestart(workspace, backend.config.limits)
    started.close_command()
    outcome = await asyncio.wait_for(started.proc.wait(), 10)
    await started.proc.aclose()
    assert outcome.exit_code == 125  # the stub's own: it never ran anything
    assert not started.usable


def test_limits_that_shape_a_sandbox_decide_a_hit() -> None:
    from sandbox_runtime.sandbox.pool import _sandbox_part

    base = SandboxLimits()
    assert _sandbox_part(replace(base, output_bytes=1)) == _sandbox_part(base)
    assert _sandbox_part(replace(base, memory_mb=64)) != _sandbox_part(base)


async def test_a_command_cut_short_runs_nothing(backend: BubblewrapBackend) -> None:
    workspace = backend.create_workspace("ws")
    started = await backend.prestart(workspace, backend.config.limits)
    fields = ["/workspace", "n", "0", "3", "/bin/sh", "-c", "touch /workspace/ran"]
    payload = b"".join(f.encode() + b"\0" for f in fields)
    assert started.command_fd is not None
    os.write(started.command_fd, payload[:-4])  # the last argument cut short
    started.close_command()
    outcome = await asyncio.wait_for(started.proc.wait(), 10)
    await started.proc.aclose()
    assert outcome.exit_code == 125
    assert not (workspace / "ran").exists()


async def test_a_refused_command_ends_the_sandbox_it_would_have_used(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace, _ = await after_one_call(backend, pool)
    with pytest.raises(InvalidRequestError):
        await pool.spawn(spec(backend, workspace, "true", env={"__srt_cmd": "id"}))
    with pytest.raises(InvalidRequestError):
        await pool.spawn(spec(backend, workspace, ["true\0"]))
    await wait_until(lambda: not sandbox_uid_processes(backend), what="no sandbox uid")
    assert backend.running_count == 0 and pool.ready_count == 0


async def test_a_sandbox_that_ends_while_starting_is_not_counted_as_running(
    backend: BubblewrapBackend, tmp_path: Path
) -> None:
    missing = tmp_path / "workspaces" / "never-made"  # bwrap cannot bind it: it ends at once
    for _ in range(5):
        started = await backend.prestart(missing, backend.config.limits)
        await started.proc.wait()
        await backend.discard(started)
        assert not started.usable
    assert backend.running_count == 0


async def test_a_full_pool_does_not_evict_sandboxes_that_just_started(
    backend: BubblewrapBackend,
) -> None:
    pool = new_pool(backend, size=1, idle_seconds=60)
    try:
        first, second = backend.create_workspace("a"), backend.create_workspace("b")
        await collect(await pool.spawn(spec(backend, first, "true")))
        await ready(pool)
        await collect(await pool.spawn(spec(backend, second, "true")))
        await asyncio.sleep(0.3)
        assert pool.workspaces() == {first.name}  # the first's still waits
        await collect(await pool.spawn(spec(backend, second, "true")))
        assert pool.misses == {MISS_EMPTY: 2, MISS_BUSY: 1}
        await collect(await pool.spawn(spec(backend, first, "true")))
        assert pool.hits == 1
    finally:
        await pool.aclose()


async def test_discarding_a_workspaces_sandbox_waits_until_it_is_gone(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace, waiting = await after_one_call(backend, pool)
    pool.idle_seconds = 0  # the sweep ends it in the background...
    assert pool.sweep() == 1
    assert waiting.proc.running
    await pool.discard_workspace(workspace)  # ...and this waits for that
    assert not waiting.proc.running and not pool._discarding
    await wait_until(lambda: not sandbox_uid_processes(backend), what="no sandbox uid")
    await wait_until(lambda: not busy_execution_cgroups(backend), what="cgroups empty")
