"""Sandboxes with egress (DESIGN §10): their socket on the proxy, and their start with the
relay (egress/relay.pl) as init.

The relay reads its command on fd COMMAND_FD as the stub of a sandbox started ahead does: a
sandbox started for its call finds it there at once; one started ahead of need (the pool's)
waits, its port bound and its socket open under the policy it was started for, until a call
with exactly that policy takes it (`egress_fits`). Either way the sandbox has its own socket
on the proxy, closed when it ends: nothing of it is shared with another sandbox.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from sandbox_runtime.errors import SandboxSpawnError, SandboxUnavailableError
from sandbox_runtime.sandbox.ahead import StartedSandbox
from sandbox_runtime.sandbox.egress_port import EgressLease
from sandbox_runtime.sandbox.pipes import close_all, write_at_once
from sandbox_runtime.sandbox.process import SandboxProcess
from sandbox_runtime.sandbox.spawn_client import spawn_failure
from sandbox_runtime.sandbox.spec import SandboxSpec

if TYPE_CHECKING:
    from sandbox_runtime.sandbox.backend import BubblewrapBackend


async def egress_lease(backend: BubblewrapBackend, spec: SandboxSpec) -> EgressLease | None:
    """This sandbox's socket on the egress proxy, if its policy allows anything. Raises
    SandboxUnavailableError, SandboxSpawnError (fails closed: never a network unproxied)."""
    if spec.egress is None or not spec.egress.enabled:
        return None
    problem = backend.relay_problem
    if not problem and spec.image is not None and backend.images is not None:
        if not backend.images.stub_perl:
            problem = "the host's perl or its dynamic loader is missing from /usr"
    if problem:
        raise SandboxUnavailableError(f"egress unavailable: {problem}")
    if backend.egress is None:
        raise SandboxUnavailableError("egress unavailable: the egress proxy is not running")
    return await backend.egress.open(spec.egress, spec.on_denied)


async def spawn_relayed(
    backend: BubblewrapBackend, spec: SandboxSpec, lease: EgressLease, payload: bytes | None
) -> tuple[SandboxProcess, int | None]:
    """Start `spec`'s sandbox with `lease` (closed when it ends; at once if it does not
    start): its relay finds `payload` on its command fd, or (None: a sandbox started ahead)
    the pipe's write end is returned with it, for a call's command. Raises
    SandboxSpawnError, SandboxUnavailableError."""
    egress = backend.egress
    assert egress is not None
    command_w = -1
    try:
        try:
            command_r, command_w = os.pipe2(os.O_CLOEXEC)
            if payload is not None:
                write_at_once(command_w, payload)  # (the relay reads once it is all there)
                os.close(command_w)
                command_w = -1
        except OSError as exc:
            if command_w >= 0:
                close_all([command_r, command_w])
            raise SandboxSpawnError(
                spawn_failure("could not hand the relay its command", exc)
            ) from exc
        try:
            proc = await backend.spawn_with(spec, lease, command_r)
        except BaseException:
            if command_w >= 0:
                os.close(command_w)
            raise
    except BaseException:
        backend.track("egress lease close", egress.close_lease(lease))
        raise
    proc.add_closer(lambda: egress.close_lease(lease))
    return proc, (command_w if command_w >= 0 else None)


def egress_fits(backend: BubblewrapBackend, started: StartedSandbox, spec: SandboxSpec) -> bool:
    """Whether `started`'s network is `spec`'s: none for none; else its socket, opened under
    exactly `spec`'s policy for the same principal and secrets on the running proxy, which
    from now on reports to `spec`'s call (EgressGate.assign)."""
    wants = spec.egress is not None and spec.egress.enabled
    if started.lease is None or not wants:
        return started.lease is None and not wants
    assert spec.egress is not None
    return backend.egress is not None and backend.egress.assign(
        started.lease, spec.egress, spec.on_denied
    )
