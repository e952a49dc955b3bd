"""Shared test fixtures."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandbox_runtime.sandbox import BackendConfig, BubblewrapBackend, SandboxLimits

# ---------------------------------------------------------------------------------------------
# Sandbox fixtures (real bubblewrap; see tests/test_sandbox.py)
# ---------------------------------------------------------------------------------------------

# The server's policy in sandbox tests: small enough that limit tests finish fast.
SANDBOX_TEST_LIMITS = SandboxLimits(
    memory_mb=256, pids=64, cpu_cores=1.0, cpu_time_seconds=30, file_size_mb=64
)


def _traversable_by_others(path: Path) -> None:
    """Let the unprivileged sandbox uid reach `path`: pytest makes its tmp dirs 0700."""
    for p in (path, *path.parents):
        if p == Path(p.anchor):
            break
        mode = p.stat().st_mode
        if not mode & 0o001:
            os.chmod(p, (mode & 0o7777) | 0o001)


@pytest.fixture
async def sandbox_backend(tmp_path: Path) -> AsyncIterator[BubblewrapBackend]:
    """A started backend with its workspaces under tmp_path and a cgroup group of its own."""
    _traversable_by_others(tmp_path)
    backend = BubblewrapBackend(
        BackendConfig(
            workspace_root=tmp_path / "workspaces",
            limits=SANDBOX_TEST_LIMITS,
            group_name=f"srt-test-{uuid.uuid4().hex[:12]}",
        )
    )
    backend.start()
    if backend.unavailable_reason is not None:
        pytest.fail(f"sandbox unavailable: {backend.unavailable_reason}")
    try:
        yield backend
    finally:
        await backend.close()
        layout = backend.cgroups
        for base in [*layout.v1_bases.values(), *([layout.v2_base] if layout.v2_base else [])]:
            with contextlib.suppress(OSError):
                base.rmdir()


@pytest.fixture
def sandbox_workspace(sandbox_backend: BubblewrapBackend) -> Path:
    """A fresh workspace of `sandbox_backend`."""
    return sandbox_backend.create_workspace("ws")


# --- end of sandbox fixtures -----------------------------------------------------------------
