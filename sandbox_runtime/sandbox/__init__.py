"""The OS-level sandbox: bubblewrap + cgroups + seccomp, run as an unprivileged uid."""

from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.sandbox.backend import BubblewrapBackend
from sandbox_runtime.sandbox.host import WORKSPACE
from sandbox_runtime.sandbox.process import SandboxOutcome, SandboxProcess
from sandbox_runtime.sandbox.spec import (
    BackendConfig,
    SandboxSpec,
    sandbox_cwd,
    shell_argv,
    validate_command,
    validate_env,
)

__all__ = [
    "WORKSPACE",
    "BackendConfig",
    "BubblewrapBackend",
    "SandboxLimits",
    "SandboxOutcome",
    "SandboxProcess",
    "SandboxSpec",
    "sandbox_cwd",
    "shell_argv",
    "validate_command",
    "validate_env",
]
