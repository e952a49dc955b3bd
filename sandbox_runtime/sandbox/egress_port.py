"""What a sandbox with egress expects of the egress proxy, stated in the sandbox layer.

The proxy (egress/supervisor.py, a layer above) is handed to the backend by its owner; the
sandbox layer never imports it. It needs of it only this: where a sandbox's socket appears
inside (SOCKET_DIR/SOCKET_NAME, bound read-only from the lease's `host_dir`), the port the
relay listens on in the sandbox, and a proxy that opens and closes one socket per sandbox
and gives one opened ahead of need to the call it fits (`EgressGate`, which `EgressProxy`
satisfies structurally).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from sandbox_runtime.domain.egress import EgressPolicy

SOCKET_DIR = "/run/srt-egress"  # inside a sandbox
SOCKET_NAME = "proxy.sock"
TRUST_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # inside a sandbox
RELAY_PORT = 3128  # the relay's port on the sandbox's loopback (the proxy URL it is given)

# Who hears of a denied connection: host, port, reason.
DeniedHandler = Callable[[str, int, str], None]


class EgressLease(Protocol):
    """One sandbox's socket on the proxy."""

    @property
    def host_dir(self) -> Path:
        """The host directory holding the socket; bound at SOCKET_DIR in the sandbox."""
        ...

    @property
    def trust_bundle(self) -> Path | None:
        """A CA bundle (the host's CAs and the deployment's, for the proxy's TLS to hosts a
        secret rule binds) bound over TRUST_BUNDLE; None: the sandbox keeps the host's."""
        ...


LeaseT = TypeVar("LeaseT", bound=EgressLease)


class EgressGate(Protocol[LeaseT]):
    """The egress proxy, as the backend uses it."""

    @property
    def deaths(self) -> int:
        """How many times the proxy has died (a sandbox started before a death has lost its
        network: an interpreter reads this through the backend)."""
        ...

    async def open(self, policy: EgressPolicy, on_denied: DeniedHandler | None) -> LeaseT:
        """A socket for one sandbox under `policy`. Raises SandboxSpawnError."""
        ...

    def assign(self, lease: LeaseT, policy: EgressPolicy, on_denied: DeniedHandler | None) -> bool:
        """Give a socket opened ahead of need (a sandbox started ahead's) to a call under
        `policy`, if it was opened with exactly that policy for the same principal; False:
        it cannot serve that call."""
        ...

    async def close_lease(self, lease: LeaseT) -> None:
        """Stop one sandbox's socket and cut its connections."""
        ...
