"""What the execution manager needs of the cluster it runs in (sessions/cluster.py builds it).

One replica alone (`LocalCluster`) or one of several sharing Redis (`RedisCluster`): the
manager does not ask which. It asks the cluster to admit an execution against its principal's
running limit (cluster-wide), tells it when one has finished and whenever one changed (the
Redis mirror writes it out; alone, nothing happens), and when one is forgotten.
"""

from __future__ import annotations

from typing import Any, Protocol

from sandbox_runtime.domain.models import OutputEvent
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.execution.execution import Execution


class ExecutionsHere(Protocol):
    """What the cluster reads of this replica's executions (the manager)."""

    replica_id: str
    incarnation: str

    @property
    def accepting(self) -> bool:
        """False once shutdown began."""
        ...

    def known(self) -> list[Execution]:
        """Every execution this replica holds."""
        ...

    def heartbeat(self) -> dict[str, Any]:
        """This replica's part of its heartbeat."""
        ...


class Cluster(Protocol):
    async def admit(self, owner: Owner, execution_id: str) -> None:
        """Count an execution against its principal's running limit, cluster-wide.

        Raises LimitExceededError."""
        ...

    def finished(self, execution: Execution) -> None:
        """An execution admitted here ended (or never started): its slot is free."""
        ...

    def changed(self, execution: Execution, events: list[OutputEvent] | None = None) -> None:
        """An execution's state or output changed (new `events`, if any)."""
        ...

    def forgotten(self, execution_id: str) -> None:
        """An execution was dropped here after its retention."""
        ...

    async def written(self, execution: Execution, within: float) -> None:
        """Until what `execution` is now is in the shared store, so that another replica
        reads it so (alone, or the store unreachable: at once; at most `within` seconds)."""
        ...
