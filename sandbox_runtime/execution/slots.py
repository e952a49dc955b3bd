"""Running slots: this replica's (SANDBOX_MAX_CONCURRENT), each session's
(SANDBOX_MAX_PER_SESSION) and, through the cluster, each principal's across all replicas.

The default session is every connection of a token that names no session (ten agents of one
token, each a transport session of its own): its limit is the token's
(SANDBOX_MAX_RUNNING_PER_PRINCIPAL), so they are not held to one session's share.

A slot is taken before the first await of a start (no lock is held across a spawn) and
`reserved` until the execution runs; the session's count is held until it has ended.
"""

from __future__ import annotations

from collections.abc import Callable

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.models import new_execution_id
from sandbox_runtime.domain.owner import DEFAULT_SESSION, Owner
from sandbox_runtime.errors import LimitExceededError
from sandbox_runtime.execution.cluster import Cluster
from sandbox_runtime.metrics import Metrics


class Slots:
    def __init__(
        self, settings: Settings, metrics: Metrics, cluster: Cluster, running: Callable[[], int]
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.cluster = cluster
        self.running = running  # executions running now
        self.reserved = 0  # slots taken by starts not yet running
        self._per_owner: dict[Owner, int] = {}

    async def take(self, owner: Owner) -> str:
        """Reserve a running slot (this replica's, the owner's, the principal's); a new id.

        Raises LimitExceededError.
        """
        settings = self.settings
        if self.running() + self.reserved >= settings.max_concurrent:
            self.metrics.rejections.labels("global").inc()
            raise LimitExceededError(
                f"the server is running its maximum of {settings.max_concurrent} "
                "executions; wait for one to finish or cancel one"
            )
        shared = owner.session_id == DEFAULT_SESSION
        limit = settings.max_running_per_principal if shared else settings.max_per_session
        if self._per_owner.get(owner, 0) >= limit:
            self.metrics.rejections.labels("session").inc()
            whose = (
                "this token's default session (every connection that names no session) is "
                if shared
                else "this session is "
            )
            raise LimitExceededError(
                f"{whose}running its maximum of {limit} executions; wait for one to finish "
                "or cancel one"
            )
        self.reserved += 1
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        execution_id = new_execution_id()
        try:
            await self.cluster.admit(owner, execution_id)
        except BaseException:
            self.give_back(owner)
            raise
        return execution_id

    def started(self) -> None:
        """The reserved slot's execution runs now (it counts as running)."""
        self.reserved -= 1

    def give_back(self, owner: Owner) -> None:
        """A start failed: its reserved slot and the owner's count are free again."""
        self.reserved -= 1
        self.ended(owner)

    def ended(self, owner: Owner) -> None:
        """An execution of `owner` has ended."""
        left = self._per_owner.get(owner, 0) - 1
        if left > 0:
            self._per_owner[owner] = left
        else:
            self._per_owner.pop(owner, None)
