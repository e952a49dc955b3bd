"""A kernel that ends while it starts: the caller gets a clear error naming the interpreter
and what the kernel printed, and nothing of it is left (its sandbox, its directories)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from conftest import SANDBOX_TEST_LIMITS, new_sandbox_backend

from sandbox_runtime.errors import SandboxSpawnError
from sandbox_runtime.interpreters.kernel import SandboxedKernel
from sandbox_runtime.interpreters.runtime import KernelSpec
from sandbox_runtime.sandbox import BubblewrapBackend
from sandbox_runtime.sandbox.spec import BackendConfig

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("tcp", [False, True], ids=["ipc", "tcp"])
async def test_a_kernel_that_dies_starting_is_a_clear_spawn_error(
    tmp_path: Path, sandbox_runtime_installed: Path, tcp: bool
) -> None:
    base = new_sandbox_backend(tmp_path)
    backend = BubblewrapBackend(
        BackendConfig(
            workspace_root=base.config.workspace_root,
            limits=SANDBOX_TEST_LIMITS,
            group_name=f"srt-test-{uuid.uuid4().hex[:12]}",
            runtime_dir=sandbox_runtime_installed,
        )
    )
    backend.start()
    assert backend.unavailable_reason is None, backend.unavailable_reason
    try:
        workspace = backend.create_workspace("ws")
        spec = KernelSpec(
            language="doomed",
            kernel="doomed",
            argv=["/bin/sh", "-c", "echo the-kernel-could-not-bind >&2; exit 3"],
            tcp=tcp,
        )
        kernels = tmp_path / "kernels"
        kernel = SandboxedKernel(backend, spec, workspace, SANDBOX_TEST_LIMITS, kernels)
        with pytest.raises(SandboxSpawnError) as raised:
            await kernel.start()
        message = str(raised.value)
        assert "the doomed interpreter ended while starting" in message
        assert "the-kernel-could-not-bind" in message
        assert kernel.process is None and not kernel.alive
        assert list(kernels.iterdir()) == []  # its connection and bridge directories are gone
    finally:
        await backend.aclose()
