"""The supervisor of background loops, and the composition root that owns it: one policy for
every loop, and nothing left running once the parts are closed."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from loguru import logger
from mcp_harness import traversable_by_others

from sandbox_runtime.app.services import build
from sandbox_runtime.config import Settings
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.execution.requests import ExecuteRequest
from sandbox_runtime.supervisor import Supervisor


def _logged() -> tuple[list[str], int]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    return lines, sink


@pytest.mark.unit
async def test_a_failing_step_is_logged_once_retried_and_its_recovery_said() -> None:
    supervisor = Supervisor()
    calls: list[int] = []
    seven = asyncio.Event()

    def step() -> None:
        calls.append(1)
        if len(calls) == 7:
            seven.set()
        if 2 <= len(calls) <= 4:
            raise ValueError("broken for a while")

    lines, sink = _logged()
    try:
        supervisor.every("sweep", 0.01, step)
        await asyncio.wait_for(seven.wait(), 10)
        await supervisor.aclose()
    finally:
        logger.remove(sink)
    assert supervisor.names == []
    failures = [line for line in lines if "sweep failed" in line]
    assert len(failures) == 1 and "broken for a while" in failures[0]
    assert sum("sweep works again" in line for line in lines) == 1


@pytest.mark.unit
async def test_spawned_work_is_kept_its_failure_logged_once_and_cancelled_on_close() -> None:
    supervisor = Supervisor()
    done = asyncio.Event()

    async def fails() -> None:
        raise ValueError("lease release broke")

    async def finishes() -> int:
        done.set()
        return 7

    lines, sink = _logged()
    try:
        failing = supervisor.spawn("release lease", fails())
        finishing = supervisor.spawn("finish", finishes())
        assert await finishing == 7
        await asyncio.wait([failing])
        await asyncio.sleep(0)
        hanging = supervisor.spawn("hang", asyncio.sleep(3600))
        assert supervisor.spawned == 1
        await supervisor.aclose()
    finally:
        logger.remove(sink)
    assert hanging.cancelled() and supervisor.spawned == 0
    failures = [line for line in lines if "release lease failed" in line]
    assert len(failures) == 1 and "lease release broke" in failures[0]
    with pytest.raises(RuntimeError, match="closed"):
        supervisor.spawn("late", asyncio.sleep(0))


@pytest.mark.unit
async def test_a_loop_that_raises_or_returns_is_restarted_with_a_growing_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sandbox_runtime.supervisor.RESTART_PAUSE", 0.01)
    supervisor = Supervisor()
    runs: list[int] = []
    third = asyncio.Event()

    async def loop() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("first run fails")
        if len(runs) == 2:
            return  # ends by itself: also restarted
        third.set()
        await asyncio.Event().wait()

    supervisor.run("serve", loop)
    await asyncio.wait_for(third.wait(), 10)
    assert supervisor.names == ["serve"]
    with pytest.raises(RuntimeError, match="already running"):
        supervisor.run("serve", loop)
    await supervisor.stop("serve")
    assert supervisor.names == []


@pytest.mark.unit
async def test_closing_ends_every_loop_newest_first_and_refuses_new_ones() -> None:
    supervisor = Supervisor()
    ended: list[str] = []

    def forever(name: str) -> object:
        async def loop() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                ended.append(name)

        return loop

    for name in ("first", "second", "third"):
        supervisor.run(name, forever(name))  # type: ignore[arg-type]
    done = asyncio.Event()

    async def job() -> None:
        done.set()

    supervisor.once("job", job)
    await done.wait()
    await asyncio.sleep(0)
    await supervisor.aclose()
    assert ended == ["third", "second", "first"]
    with pytest.raises(RuntimeError, match="closed"):
        supervisor.every("late", 1, lambda: None)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


def _children() -> set[int]:
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids |= {int(p) for p in f.read().split()}
    return pids


@pytest.mark.integration
async def test_the_composition_root_leaves_no_task_and_no_process_behind(tmp_path: Path) -> None:
    traversable_by_others(tmp_path)
    settings = Settings(
        state_dir=tmp_path / "state",
        replica_id=f"root-{uuid.uuid4().hex[:6]}",
        _env_file=None,  # type: ignore[call-arg]
    )
    before_tasks = set(asyncio.all_tasks())
    before_children = _children()
    async with build(settings) as services:
        assert services.manager.backend.unavailable_reason is None
        names = services.supervisor.names
        assert {"orphan reaping", "eviction", "lease renewal", "interpreter reaping"} <= set(
            names
        ), names
        execution = await services.manager.start_execution(
            Owner("alice", "default"), ExecuteRequest(command="echo hi; sleep 30")
        )
        await asyncio.sleep(0.2)  # running when the parts close
        assert _children() - before_children, "no spawner or sandbox was started"
    assert execution.finished.is_set()
    assert services.supervisor.names == []
    left = [t for t in asyncio.all_tasks() - before_tasks if t is not asyncio.current_task()]
    assert left == [], left
    assert _children() - before_children == set()


@pytest.mark.unit
async def test_the_parts_close_once_newest_first_and_one_failing_close_stops_none() -> None:
    from sandbox_runtime.app.services import Closing

    supervisor = Supervisor()
    closing = Closing(supervisor)
    closed: list[str] = []

    def close(name: str, fail: bool = False) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            await asyncio.sleep(0.01)
            closed.append(name)
            if fail:
                raise OSError(f"{name} would not close")

        return run

    for name, fail in [("cluster", False), ("workspaces", True), ("backend", False)]:
        closing.add(close(name, fail))
    lines, sink = _logged()
    try:
        # The signal handler's stop and the lifespan's end at once: the closes run once.
        await asyncio.gather(closing.run(), closing.run())
        await closing.run()
    finally:
        logger.remove(sink)
        await supervisor.aclose()
    assert closed == ["backend", "workspaces", "cluster"]
    assert sum("workspaces would not close" in line for line in lines) == 1
