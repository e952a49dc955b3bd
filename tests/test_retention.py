"""Retention of finished executions and workspaces, with a real manager and real sandboxes."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import traversable_by_others

from sandbox_runtime.app.services import build
from sandbox_runtime.config import Settings
from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import ExecutionNotFoundError
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.execution.requests import ExecuteRequest

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def started_manager(tmp_path: Path, **settings: Any) -> AsyncIterator[ExecutionManager]:
    """A started manager of its own state dir (600 s retentions unless `settings` say)."""
    traversable_by_others(tmp_path)
    config = Settings(
        state_dir=tmp_path / "state",
        replica_id=f"ret-{uuid.uuid4().hex[:6]}",
        **{"retention_seconds": 600, "workspace_retention_seconds": 600, **settings},
        _env_file=None,  # type: ignore[call-arg]
    )
    async with build(config) as services:
        mgr = services.manager
        assert mgr.backend.unavailable_reason is None, mgr.backend.unavailable_reason
        yield mgr


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[ExecutionManager]:
    async with started_manager(tmp_path, max_retained=5) as mgr:
        yield mgr


async def run(mgr: ExecutionManager, owner: Owner, command: str) -> str:
    execution = await mgr.start_execution(owner, ExecuteRequest(command=command))
    await execution.finished.wait()
    return execution.execution_id


async def test_one_principal_flooding_the_cap_does_not_evict_another(
    manager: ExecutionManager,
) -> None:
    bob = Owner("bob", "s:notes")
    alice = Owner("alice", "default")
    kept = await run(manager, bob, "echo important > notes.txt")
    for _ in range(8):
        await run(manager, alice, "true")
    manager.evict()
    await manager.workspaces.sweep()
    assert (await manager.status(bob, kept)).status == "completed"
    workspace = manager.backend.config.workspace_root / workspace_name(bob)
    assert (workspace / "notes.txt").read_text() == "important\n"
    alice_left = await manager.list(alice)
    assert len(alice_left) == 4, "alice's own oldest went first"


async def test_idle_workspace_is_removed_only_after_the_retention(
    manager: ExecutionManager,
) -> None:
    owner = Owner("carol", "s:tmp")
    execution_id = await run(manager, owner, "echo x > f")
    name = workspace_name(owner)
    workspaces = manager.workspaces
    later = time.time() + 601
    assert manager.evict(now=later) >= 1
    with pytest.raises(ExecutionNotFoundError):
        await manager.status(owner, execution_id)
    assert name in workspaces.idle(now=later)
    assert name not in workspaces.idle(), "used moments ago: not idle yet"
    handle = workspaces.image(name) if workspaces.mode == "image" else workspaces.path(name)
    os.utime(handle, (time.time() - 700, time.time() - 700))
    await workspaces.sweep()
    assert not workspaces.path(name).exists() and not workspaces.image(name).exists()


async def test_retained_output_is_bounded_in_bytes_and_per_principal(tmp_path: Path) -> None:
    """Finished executions that each keep their full output limit cannot add up past
    SANDBOX_RETAINED_OUTPUT_MB; a principal keeps at most half of it, oldest evicted first."""
    async with started_manager(tmp_path, retained_output_mb=4) as mgr:
        bob, alice = Owner("bob", "default"), Owner("alice", "default")
        big = "head -c 1500000 /dev/zero | tr '\\0' x"
        kept = await run(mgr, bob, big)
        alices = [await run(mgr, alice, big) for _ in range(5)]
        mgr.evict()
        assert (await mgr.status(bob, kept)).status == "completed"
        assert (await mgr.status(alice, alices[-1])).status == "completed"
        for old in alices[:-1]:
            with pytest.raises(ExecutionNotFoundError):
                await mgr.status(alice, old)
        held = sum(e.retained_bytes for e in mgr._executions.values())
        assert 3_000_000 <= held <= 4 * 1024 * 1024
