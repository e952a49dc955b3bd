"""A sandbox started ahead of need (`BubblewrapBackend.prestart`, pooled by pool.py): bwrap,
its limits, cgroup, seccomp filter and workspace in place, the stub (argv.STUB_PROGRAM), or
with egress the relay (egress/relay.pl) and its socket on the proxy, waiting for its command
on a pipe; handed one (`hand_over`), it serves that execution."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.errors import SandboxSpawnError
from sandbox_runtime.sandbox.argv import stub_command
from sandbox_runtime.sandbox.egress_port import EgressLease
from sandbox_runtime.sandbox.host import WORKSPACE
from sandbox_runtime.sandbox.image_root import start_dir
from sandbox_runtime.sandbox.pipes import write_at_once
from sandbox_runtime.sandbox.process import SandboxProcess
from sandbox_runtime.sandbox.spec import ImageRoot, SandboxSpec


@dataclass(eq=False)
class StartedSandbox:
    """A sandbox started ahead, the stub waiting for a command on the pipe whose write end is
    `command_fd`. Serves one execution (`BubblewrapBackend.launch`), or is discarded."""

    proc: SandboxProcess
    command_fd: int | None
    workspace: Path
    limits: SandboxLimits
    started_at: float = field(default_factory=time.monotonic)
    image: ImageRoot | None = None  # the environment it runs on (None: the default root)
    # With egress: its socket on the proxy (its init is then the relay, waiting for the
    # command as the stub does), the policy it was opened with and the proxy's deaths then
    # (a proxy that died since took the socket with it).
    lease: EgressLease | None = None
    egress: EgressPolicy | None = None
    deaths: int = 0

    @property
    def shape(self) -> tuple[Path, SandboxLimits, ImageRoot | None]:
        """What a call's spec must match to run here: workspace, limits, environment."""
        return self.workspace, self.limits, self.image

    @property
    def usable(self) -> bool:
        return self.command_fd is not None and self.proc.running

    def hand_over(self, spec: SandboxSpec) -> None:
        """Write `spec`'s command (checked already) to the stub, all of it at once: the stub
        reads only then. Raises SandboxSpawnError."""
        payload = command_payload(spec)
        fd = self.command_fd
        if fd is None or not self.proc.running:
            raise SandboxSpawnError("the sandbox started ahead has ended")
        try:
            write_at_once(fd, payload)
        except OSError as exc:  # (BlockingIOError: the pipe could not be made big enough)
            raise SandboxSpawnError(f"could not hand the sandbox its command: {exc}") from exc

    def close_command(self) -> None:
        if self.command_fd is not None:
            os.close(self.command_fd)
            self.command_fd = None


def command_payload(spec: SandboxSpec) -> bytes:
    """`spec`'s command as the stub (or the egress relay) reads it on its fd."""
    if spec.image is not None and spec.cwd == WORKSPACE:  # (as bwrap_args does)
        spec = replace(spec, cwd=start_dir(spec.image))
    return stub_command(spec)


def egress_shape(policy: EgressPolicy | None) -> tuple[object, ...] | None:
    """What a sandbox started ahead with egress must share with a call's policy to serve it
    (None: no network): the rules, whose secrets (principal, narrowing). The proxy checks
    again, with the secrets' values, when the call takes it (EgressGate.assign)."""
    if policy is None or not policy.enabled:
        return None
    grant = policy.grant
    return (
        tuple(map(str, policy.allow_rules)),
        tuple(map(str, policy.deny_rules)),
        tuple(map(str, policy.allow_cidrs)),
        tuple(sorted(map(str, policy.exact))),
        getattr(grant, "principal", None),
        getattr(grant, "names", None),
    )


def command_waits(started: StartedSandbox) -> bool:
    """Whether the sandbox is set up (its mounts made, the workspace bound) and its stub runs:
    bwrap's pid 1 in the sandbox (no --as-pid-1 in one started ahead) forks the command only
    after the set-up, and the command is the stub once it is no longer bwrap."""
    child = started.proc.child_pid
    if child is None:
        return False
    try:
        with open(f"/proc/{child}/task/{child}/children") as f:
            pids = f.read().split()
        for pid in [str(child), *pids]:  # (pid 1 itself: were there no init)
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != "bwrap":
                    return True
    except OSError:
        return False
    return False
