"""What a sandbox is asked to be (SandboxSpec) under the backend's settings (BackendConfig),
and the checks of what a caller may ask for: the command, its environment, its directory."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.sandbox.egress_port import DeniedHandler
from sandbox_runtime.sandbox.host import WORKSPACE

MAX_COMMAND_BYTES = 120 * 1024  # the kernel refuses one argument over 128 KiB
MAX_ENV_BYTES = 64 * 1024
MAX_ENV_VARS = 256
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")  # fullmatch: no trailing newline


HOST_DIR = "/run/srt-host"  # the host's /usr appears at HOST_DIR/usr (environments, egress)


@dataclass(frozen=True)
class ImageRoot:
    """An environment's root filesystem as the backend sees it (the environments package
    turns an Environment into one): `root` a read-only directory tree bound, never copied,
    into every sandbox on it; `env`, `workdir`, `user` its image configuration."""

    name: str
    digest: str
    root: Path
    env: tuple[tuple[str, str], ...] = ()
    workdir: str = "/"
    user: str = "root"


@dataclass(frozen=True)
class ImageLayout:
    """What a sandbox on an environment is mounted from: `root_dir` (the root built here),
    `binds` ((host path, path inside) bound read-only after it), the variables it starts
    with and the directory it starts in when the caller names none."""

    root_dir: Path
    binds: tuple[tuple[str, str], ...]
    env: tuple[tuple[str, str], ...]
    cwd: str


@dataclass
class BackendConfig:
    """What the backend needs from the server's settings."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    # None: DEFAULT_SANDBOX_USER (created if missing) for a root server, else its own user.
    sandbox_user: str | None = None
    workspace_root: Path = Path("/var/lib/sandbox-runtime/workspaces")
    bwrap_path: str | None = None
    group_name: str = "srt"
    cgroup_favordynmods: bool = True
    cgroup_pool: int = 32  # idle execution cgroups kept for reuse
    # A runtime tree (bound read-only at RUNTIME in every sandbox); None: the host's /usr only.
    runtime_dir: Path | None = None


@dataclass
class SandboxSpec:
    """One sandbox to start."""

    argv: list[str]
    workspace: Path
    limits: SandboxLimits
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = WORKSPACE
    interactive: bool = False
    timeout: float | None = None
    # A host directory bound read-write at KERNEL_DIR (an interpreter's sockets and its
    # connection file); None for plain executions.
    kernel_dir: Path | None = None
    # AF_INET/AF_INET6 sockets allowed, inside the sandbox's own network namespace (loopback
    # only, no route out): Jupyter kernels need them. Plain executions: AF_UNIX only.
    loopback_inet: bool = False
    # A host directory bound read-only at SERVER_DIR (a hosted MCP server's install); None: none
    server_dir: Path | None = None
    # Code mode: a host directory (the bridge's socket, the mcp_servers library) bound
    # read-only at BRIDGE_DIR; None: none
    bridge_dir: Path | None = None
    # Egress through the host proxy under this policy (None, or one allowing nothing: none),
    # and who hears of its denials.
    egress: EgressPolicy | None = None
    on_denied: DeniedHandler | None = None
    # The environment's root the sandbox runs on; None: the default (the host's /usr and
    # the runtime).
    image: ImageRoot | None = None


def shell_argv(command: str) -> list[str]:
    """argv that runs `command` with /bin/sh -c inside the sandbox."""
    return ["/bin/sh", "-c", command]


def validate_command(argv: list[str]) -> None:
    """Raise InvalidRequestError for argv the kernel or bwrap would refuse."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidRequestError("command must be a non-empty string or list of strings")
    if not argv[0]:
        raise InvalidRequestError("command must not be empty")
    total = 0
    for arg in argv:
        if "\x00" in arg:
            raise InvalidRequestError("command must not contain NUL bytes")
        size = len(arg.encode("utf-8", "surrogatepass"))
        if size > MAX_COMMAND_BYTES:
            raise InvalidRequestError(
                f"command is {size} bytes; the maximum is {MAX_COMMAND_BYTES} bytes "
                "(write longer programs to a file in the workspace, or send them on stdin)"
            )
        total += size
    if total > 4 * MAX_COMMAND_BYTES:
        raise InvalidRequestError(
            f"command is {total} bytes in all; at most {4 * MAX_COMMAND_BYTES}"
        )


def validate_env(env: dict[str, str] | None) -> dict[str, str]:
    """The caller's environment, checked. Raises InvalidRequestError."""
    if not env:
        return {}
    if not isinstance(env, dict):
        raise InvalidRequestError("environment must be an object of names to strings")
    if len(env) > MAX_ENV_VARS:
        raise InvalidRequestError(f"environment has {len(env)} variables; at most {MAX_ENV_VARS}")
    size = 0
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key) or key.startswith("__srt"):
            raise InvalidRequestError(f"environment variable name {key!r} is not valid")
        if not isinstance(value, str) or "\x00" in value:
            raise InvalidRequestError(f"environment variable {key} must be a string without NUL")
        size += len(key) + len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_ENV_BYTES:
        raise InvalidRequestError(f"environment is {size} bytes; at most {MAX_ENV_BYTES}")
    return dict(env)


def sandbox_cwd(working_directory: str | None) -> str:
    """The directory inside the sandbox to start in; must lie in /workspace or /tmp."""
    if not working_directory:
        return WORKSPACE
    if not isinstance(working_directory, str) or "\x00" in working_directory:
        raise InvalidRequestError("working_directory must be a string without NUL")
    path = posixpath.normpath(posixpath.join(WORKSPACE, working_directory))
    for root in (WORKSPACE, "/tmp"):
        if path == root or path.startswith(root + "/"):
            return path
    raise InvalidRequestError(
        f"working_directory {working_directory!r} is outside the sandbox's /workspace and /tmp"
    )
