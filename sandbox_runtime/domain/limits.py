"""Sandbox limits: the server's ceilings and a caller's tightening of them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from sandbox_runtime.errors import PolicyViolationError

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits applied to one sandboxed process tree.

    The server's settings build one of these: it is both the default for every execution and the
    ceiling no caller may exceed. `tighten` derives a per-execution copy from a caller's request.
    """

    memory_mb: int = 512
    """Memory (RSS + page cache) of the whole tree; the kernel OOM-kills inside it past this."""
    pids: int = 128
    """Processes and threads alive at once in the tree (fork bombs stop here)."""
    cpu_cores: float = 1.0
    """CPU bandwidth: at most this many cores' worth of time for the tree (throttled)."""
    cpu_time_seconds: int = 600
    """CPU seconds any one process may burn (RLIMIT_CPU): SIGXCPU, then SIGKILL one second later."""
    file_size_mb: int = 256
    """Largest file any process may write (RLIMIT_FSIZE)."""
    tmp_size_mb: int = 64
    """Size of the private tmpfs mounted at /tmp. /dev/shm is in it, or, where bwrap builds
    /dev, a tmpfs of its own of this size."""
    open_files: int = 1024
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = 10 * MIB
    """stdout+stderr kept per execution; past this output is dropped and a `truncated` event says
    how much."""
    network: bool = False
    """Network egress through the host's allowlist proxy: on when the server's egress policy
    allows anything (SANDBOX_EGRESS_*). A caller may turn it off or narrow the names
    (`sandbox_config.network`: false or a list), never widen it."""
    network_allow: tuple[str, ...] | None = None
    """A caller's narrowing of the egress policy (`sandbox_config.network` as a list): egress
    rules and CIDRs, each within the server's; None: the server's policy as it is."""
    secrets: tuple[str, ...] | None = None
    """A caller's narrowing of the secret rules its sandbox gets (`sandbox_config.secrets`: rule
    or secret names, or false for none); None: every rule the principal has."""
    pseudo_terminals: bool = False
    """Pseudo-terminals (a private /dev/pts) in the sandbox. Off unless the server allows them:
    they open the kernel's tty layer to the sandbox, and the /dev that has them costs bwrap
    ~1.5 ms more per start. Where the server allows them a caller may turn them off."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tighten(self, request: dict[str, Any] | None) -> SandboxLimits:
        """A copy with the caller's requested limits, each at most this policy's value.

        Raises PolicyViolationError naming every unknown key, bad value or attempt to loosen.
        """
        if not request:
            return self
        if not isinstance(request, dict):
            raise PolicyViolationError("sandbox_config must be an object of limit names to values")
        known = {f.name for f in fields(self)} - {"network_allow"}
        if "secrets" in request:
            # Names within the principal's rules (checked when the sandbox's socket opens:
            # domain/secrets.narrow); false or [] for none. Never a widening.
            value = request["secrets"]
            if value is False or value == []:
                request = {**request, "secrets": ()}
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                request = {**request, "secrets": tuple(value)}
            elif value is not True:
                raise PolicyViolationError(
                    "sandbox_config.secrets must be false or a list of names"
                )
        problems: list[str] = []
        changes: dict[str, Any] = {}
        for key, value in request.items():
            key = _ALIASES.get(key, key)
            if key not in known:
                problems.append(
                    f"unknown sandbox_config key {key!r} (known: {', '.join(sorted(known))})"
                )
                continue
            ceiling = getattr(self, key)
            if key == "secrets":
                if value is not True:
                    changes[key] = value
                continue
            if key == "network":
                # False, true (the server's egress policy) or a list of names within it: the
                # list itself is checked against the policy by EgressPolicy.narrow.
                if value is False or value == []:
                    changes[key] = False
                    changes["network_allow"] = None
                elif not ceiling:
                    problems.append(
                        "sandbox_config.network: this server allows no network egress "
                        "(a caller may only tighten the sandbox)"
                    )
                elif isinstance(value, str) or (
                    isinstance(value, list) and all(isinstance(v, str) for v in value)
                ):
                    entries = [value] if isinstance(value, str) else value
                    changes["network_allow"] = tuple(e for e in entries if e.strip())
                elif value is not True:
                    problems.append("sandbox_config.network must be false, true or a list of names")
                continue
            if isinstance(ceiling, bool):
                if not isinstance(value, bool):
                    problems.append(f"sandbox_config.{key} must be true or false")
                elif value and not ceiling:
                    problems.append(
                        f"sandbox_config.{key}: this server does not allow them "
                        "(a caller may only tighten the sandbox)"
                    )
                else:
                    changes[key] = value
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                problems.append(
                    f"sandbox_config.{key} must be a number, got {type(value).__name__}"
                )
                continue
            if not math.isfinite(value) or value <= 0:
                problems.append(f"sandbox_config.{key} must be a positive number, got {value}")
                continue
            if isinstance(ceiling, int) and not float(value).is_integer():
                problems.append(f"sandbox_config.{key} must be a whole number, got {value}")
                continue
            if value > ceiling:
                problems.append(
                    f"sandbox_config.{key}={value} exceeds the server's maximum of {ceiling}; "
                    "a caller may only tighten the sandbox"
                )
                continue
            changes[key] = type(ceiling)(value)
        if problems:
            raise PolicyViolationError("; ".join(problems))
        return replace(self, **changes)


# Names an earlier server's clients may send.
_ALIASES = {
    "memory_limit_mb": "memory_mb",
    "max_memory_mb": "memory_mb",
    "max_processes": "pids",
    "max_pids": "pids",
    "cpu_time": "cpu_time_seconds",
    "max_file_size_mb": "file_size_mb",
    "max_output_bytes": "output_bytes",
    "network_access": "network",
    "allow_network": "network",
    "pty": "pseudo_terminals",
}
