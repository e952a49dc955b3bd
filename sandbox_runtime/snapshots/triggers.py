"""When snapshots are taken by themselves: after a session has been idle a while, and when
the replica stops (SIGTERM), before its sessions are released to other replicas.

A store that is down delays these snapshots (the next idle pass tries again); it never holds
up a call: they run beside the calls, each workspace held mounted only while it is read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from loguru import logger

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.snapshots.service import Snapshots

MAX_PER_PASS = 32  # idle snapshots per pass (the rest wait for the next)


class Triggers:
    def __init__(
        self,
        snapshots: Snapshots,
        sessions_here: Callable[[], list[Owner]],
        busy: Callable[[], set[str]],
        idle_seconds: float,
        drain_seconds: float,
    ) -> None:
        self.snapshots = snapshots
        self.sessions_here = sessions_here
        self.busy = busy  # workspaces a running execution uses (a kernel alone does not count)
        self.idle_seconds = idle_seconds
        self.drain_seconds = drain_seconds
        self._failing_since: float | None = None

    @property
    def interval(self) -> float:
        return max(1.0, min(30.0, self.idle_seconds / 4))

    def _due(self, idle_seconds: float) -> list[Owner]:
        busy = self.busy()
        seen: set[str] = set()
        due = []
        for owner in self.sessions_here():
            name = workspace_name(owner)
            if name in seen or name in busy or self.snapshots.replacing(owner):
                continue
            seen.add(name)
            if self.snapshots.changed_since_snapshot(owner, idle_seconds):
                due.append(owner)
        return due

    async def idle_pass(self) -> int:
        """Snapshot the sessions idle at least `idle_seconds` and changed since their last
        snapshot: how many were taken."""
        if not self.snapshots.enabled or self.idle_seconds <= 0:
            return 0
        taken = 0
        for owner in self._due(self.idle_seconds)[:MAX_PER_PASS]:
            try:
                await self.snapshots.take(owner, "idle")
                taken += 1
            except Exception as exc:  # (a store down, a full disk: tried again next pass)
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                    logger.warning("idle snapshot delayed: {}", exc)
                return taken
        if taken and self._failing_since is not None:
            logger.info("idle snapshots are taken again")
            self._failing_since = None
        return taken

    async def drain(self) -> int:
        """The replica is stopping: snapshot every session changed since its last snapshot,
        within `drain_seconds`: how many were taken."""
        if not self.snapshots.enabled or self.drain_seconds <= 0:
            return 0
        due = self._due(0.0)
        if not due:
            return 0
        logger.info("stopping: snapshotting {} sessions first", len(due))
        taken = 0
        try:
            async with asyncio.timeout(self.drain_seconds):
                for owner in due:
                    try:
                        await self.snapshots.take(owner, "drain")
                        taken += 1
                    except Exception as exc:  # (the others are still tried)
                        logger.warning("a session was not snapshotted before stopping: {}", exc)
        except TimeoutError:
            logger.warning(
                "stopping: {} of {} sessions snapshotted within {} s (SANDBOX_SNAPSHOT_DRAIN_"
                "SECONDS); the rest come back from their last snapshot",
                taken,
                len(due),
                self.drain_seconds,
            )
        return taken

    async def before_removal(self, owner: Owner) -> bool:
        """An idle workspace is to be removed (over a byte budget): snapshot it first if it
        changed since its last snapshot, or was not used this run. Whether its files are kept
        (True without a store: nothing to keep them in). Raises what a snapshot raises (it is
        then kept)."""
        if not self.snapshots.enabled:
            return True
        # (Not used this run: a previous run's changes since its last snapshot are unknown.)
        unknown = self.snapshots.workspaces.last_used(workspace_name(owner)) is None
        if unknown or self.snapshots.changed_since_snapshot(owner):
            await self.snapshots.take(owner, "retention")
        return not self.snapshots.changed_since_snapshot(owner)

    def kept(self, owner: Owner) -> bool:
        """Whether the owner's files are in its last snapshot (nothing changed since)."""
        return not self.snapshots.enabled or not self.snapshots.changed_since_snapshot(owner)
