"""Every Redis key this service uses, built in one place. The names are a public interface."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TTL_SECONDS = 3600
HEARTBEAT_TTL_SECONDS = 10
HEARTBEAT_INTERVAL_SECONDS = 3
RUNNING_LEASE_SECONDS = 30  # a running execution's slot in its principal's count, renewed


@dataclass(frozen=True)
class Keys:
    """Key builders; `prefix` (default empty) namespaces several deployments in one Redis."""

    prefix: str = ""

    def execution(self, execution_id: str) -> str:
        """string: the execution's metadata as JSON."""
        return f"{self.prefix}execution:{execution_id}"

    def output(self, execution_id: str) -> str:
        """list: the execution's output events as JSON, in seq order (index = seq - 1)."""
        return f"{self.prefix}execution:{execution_id}:output"

    def session(self, session_key: str) -> str:
        """set: execution ids of one session (`principal:session`)."""
        return f"{self.prefix}session:{session_key}:executions"

    def replica(self, replica_id: str) -> str:
        """string: a replica's heartbeat JSON; short TTL."""
        return f"{self.prefix}replica:{replica_id}"

    def replica_running(self, replica_id: str) -> str:
        """set: ids of the executions a replica's processes have mirrored as not finished
        (a restarted replica marks its previous incarnation's lost from it)."""
        return f"{self.prefix}replica:{replica_id}:running"

    def session_home(self, session_key: str) -> str:
        """string: a session's record as JSON (home replica, times, what it holds); TTL =
        retention, refreshed by every session-bound operation."""
        return f"{self.prefix}session:{session_key}:home"

    def replica_sessions(self, replica_id: str) -> str:
        """set: session keys homed on a replica (released when it stops)."""
        return f"{self.prefix}replica:{replica_id}:sessions"

    def principal_sessions(self, principal: str) -> str:
        """sorted set: a principal's live session keys, scored by when their record expires."""
        return f"{self.prefix}principal:{principal}:sessions"

    def principal_running(self, principal: str) -> str:
        """sorted set: a principal's running execution ids, scored by when their lease
        expires (renewed by the replica running them; a dead replica's lapse)."""
        return f"{self.prefix}principal:{principal}:running"

    def store_epoch(self) -> str:
        """hash: this store's epoch (`id`, `created_at` in the store's clock, `restarted`),
        made by the first replica that finds it missing: a new id means the store lost its
        data (Redis restarted empty) and the session records with it. No TTL."""
        return f"{self.prefix}store:epoch"

    def replicas(self) -> str:
        """sorted set: replica ids, scored by when their heartbeat expires."""
        return f"{self.prefix}replicas"


def session_key(principal: str, session_id: str) -> str:
    return f"{principal}:{session_id}"
