"""An execution's network: the egress policy its sandbox gets, and where denials go."""

from __future__ import annotations

from loguru import logger

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.domain.models import EventType
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.domain.secrets import SecretsGrant
from sandbox_runtime.egress.supervisor import DeniedHandler
from sandbox_runtime.execution.execution import Execution


def egress_of(server: EgressPolicy, limits: SandboxLimits) -> EgressPolicy | None:
    """The egress policy of a sandbox under `limits`: the server's, narrowed as the caller
    asked (None: no network). Raises InvalidRequestError, PolicyViolationError (asking for
    more)."""
    if not server.enabled or not limits.network:
        return None
    if limits.network_allow is None:
        return server
    narrowed = server.narrow(list(limits.network_allow))
    return narrowed if narrowed.enabled else None


def denied_to(execution: Execution) -> DeniedHandler:
    """Where the proxy's denials for `execution`'s sandbox go: an event, and a log line."""

    def denied(host: str, port: int, reason: str) -> None:
        with logger.contextualize(execution_id=execution.execution_id):
            logger.info("network denied host={} port={} reason={}", host, port, reason)
        if not execution.status.finished:
            execution.emit(
                EventType.NETWORK_DENIED,
                host=host,
                port=port,
                reason=reason,
                message=f"egress denied: {reason} ({host}:{port})",
            )

    return denied


def granted(
    policy: EgressPolicy | None,
    owner: Owner | None,
    limits: SandboxLimits,
    execution: Execution | None,
) -> EgressPolicy | None:
    """`policy` for `owner`'s sandbox, with the secret rules its principal has (narrowed by
    `sandbox_config.secrets`); their uses become `network_secret` events of `execution`.
    No owner: `policy` as it is (no secret)."""
    if policy is None or owner is None:
        return policy

    def used(rule: str, host: str, port: int) -> None:
        if execution is not None and not execution.status.finished:
            execution.emit(
                EventType.NETWORK_SECRET,
                name=rule,
                host=host,
                port=port,
                message=f"secret rule {rule} applied ({host}:{port})",
            )

    grant = SecretsGrant(
        owner.principal,
        owner.session_id,
        execution.execution_id if execution is not None else "",
        limits.secrets,
        used,
    )
    return policy.granting(grant)
