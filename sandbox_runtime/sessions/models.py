"""What a session is: its owner, its home replica, its times and what it holds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from sandbox_runtime.state.keys import session_key


def _absent(value: object) -> bool:
    return value is None


class RestoredFrom(BaseModel):
    snapshot_id: str
    taken_at: float = Field(description="Unix time the snapshot was taken.")
    trigger: str | None = Field(None, description="on_demand, idle, drain or fork.")


class SessionReset(BaseModel):
    """Told to the caller whose operation found the session's state gone and started afresh."""

    reason: Literal[
        "home_lost",
        "home_stopped",
        "workspace_removed",
        "store_lost",
        "workspace_repaired",
        "workspace_quarantined",
    ] = Field(
        description="home_lost: the home replica stopped heart-beating (crashed, cut off); "
        "home_stopped: it was shut down and released its sessions; workspace_removed: the "
        "home kept the session but not its workspace (idle past the retention period, or "
        "the replica restarted without its state directory); store_lost: the shared store "
        "(Redis) lost the session's record and its home could not publish it again in time, "
        "so the session started afresh here (its files stay on previous_replica), or no "
        "replica held it any more (its home was stopped or lost) and it was restored from "
        "its newest snapshot (restored_from); "
        "workspace_repaired: the workspace's filesystem failed (an I/O error, a full host "
        "disk) and was repaired (e2fsck): files written around the failure may be missing or "
        "in lost+found; workspace_quarantined: it could not be repaired, was set aside for "
        "the operator, and the session starts with an empty workspace."
    )
    previous_replica: str = Field(description="The replica that held the session's state.")
    restored_from: RestoredFrom | None = Field(
        default=None,
        exclude_if=_absent,
        description="The snapshot the workspace was restored from (files and installed "
        "packages as they were then); absent: it starts empty.",
    )
    lost: str | None = Field(
        default=None, exclude_if=_absent, description="What a restore could not bring back."
    )
    restore_failed: str | None = Field(
        default=None,
        exclude_if=_absent,
        description="Why the session's snapshot could not be restored (it starts empty).",
    )
    newest_failed: str | None = Field(
        default=None,
        exclude_if=_absent,
        description="Why the session's newest snapshot (and any others tried) could not be "
        "restored, when an older one (restored_from) was restored instead.",
    )


class SessionRecord(BaseModel):
    """A session's record in the shared store: where its state lives.

    Stored as a Redis hash (`redis-cli hgetall session:PRINCIPAL:SESSION:home`); `generation`
    grows with every change of home, so a re-homing is a compare-and-set on it.
    """

    principal: str
    session_id: str
    home: str
    home_started_at: float
    created_at: float
    last_used_at: float
    generation: int = 1
    state: Literal["active", "released"] = "active"
    released_reason: str | None = None
    holds: str = "workspace"  # comma-separated kinds of state kept on the home
    # Set when the home published the record again after the store lost it (a session that
    # goes on, not a fresh start).
    published_again_at: float | None = None
    # A reset the home owes the session's next call (the session started afresh there while
    # another replica still held its state): taken by the home's next lookup.
    reset_reason: str | None = None
    reset_from: str | None = None

    @property
    def key(self) -> str:
        return session_key(self.principal, self.session_id)

    def owed_reset(self) -> SessionReset | None:
        """The reset this record says the session's next call is owed (None: none)."""
        if self.reset_reason != "store_lost" or not self.reset_from:
            return None
        return SessionReset(reason="store_lost", previous_replica=self.reset_from)

    def fields(self) -> dict[str, str]:
        """The record as hash fields (strings; None fields left out)."""
        return {k: str(v) for k, v in self.model_dump().items() if v is not None}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> SessionRecord:
        return cls.model_validate(fields)
