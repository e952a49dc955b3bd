"""Fencing: what a replica does when it learns that its heartbeat lapsed; and whether a
session's home is still its home (alive, or this replica).

A replica frozen (SIGSTOP, a stalled VM) or cut off from the store for longer than a heartbeat
TTL looks dead to the others: they mark its running executions `lost` and re-home its
sessions elsewhere. When it comes back its mirror holds every write (sessions/mirror.py) until
`Fence.check` has learnt, from the session records, which of its sessions now have another
home, and stopped here what ran for them: their executions (ended `lost`, final), their
interpreters and their hosted-server instances; and the sessions are remembered as homed
there, so this replica forwards to the new home. Executions the store refuses to take (it says
`lost`, or another incarnation's) are stopped the same way (`Fence.refused`). A replica whose
id another process holds now (`Fence.evicted`) stops everything it holds: it can never beat
again. Each says in the log what it dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from loguru import logger

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.sessions.operations import Parts
from sandbox_runtime.sessions.placements import Placements
from sandbox_runtime.sessions.store import SessionStore
from sandbox_runtime.state.keys import session_key
from sandbox_runtime.state.store import FENCED_MESSAGE

STOP_SECONDS = 10.0  # for an execution's process tree to be gone once killed
NO_HOME = ""  # remembered as the home of sessions this replica must not serve (evicted)
LOST_IN_STORE = (
    "the shared store marked this execution lost while this replica's heartbeat had lapsed; "
    "it was stopped and its later output is not kept"
)


class Fence:
    """Stops here what the cluster gave to another replica while this one looked dead."""

    def __init__(
        self,
        replica_id: str,
        sessions: SessionStore,
        placements: Placements,
        parts: Parts,
        record_ttl: int,
    ) -> None:
        self.replica_id = replica_id
        self.sessions = sessions
        self.placements = placements
        self.manager = parts.manager
        self.interpreters = parts.interpreters
        self.servers = parts.servers
        self.record_ttl = record_ttl
        self.supervisor = parts.manager.supervisor

    async def home_alive(self, owner: Owner, home: str) -> bool:
        """After `home` refused a connection: is it still the session's live, active home?"""
        with contextlib.suppress(Exception):
            key = session_key(owner.principal, owner.session_id)
            found = await self.sessions.lookup(key, self.replica_id, time.time(), self.record_ttl)
            record = found.record
            return (
                record is not None
                and record.home == home
                and record.state == "active"
                and found.home_heartbeat is not None
            )
        return True  # the store is down too: do not re-home on a guess

    async def is_home(self, owner: Owner) -> bool:
        """Whether this replica is still the active home of `owner`'s session in the shared
        store (an upload asks before it says it succeeded). Raises what the store raises."""
        key = session_key(owner.principal, owner.session_id)
        found = await self.sessions.lookup(key, self.replica_id, time.time(), self.record_ttl)
        return found.touched

    def _held_here(self) -> dict[str, Owner]:
        """Every session this replica holds something of: placed here, or running here."""
        held = dict(self.placements.homed_at(self.replica_id))
        for execution in self.manager.running():
            owner = execution.owner
            held.setdefault(session_key(owner.principal, owner.session_id), owner)
        return held

    async def check(self) -> int:
        """After this replica's heartbeat lapsed while the store kept its epoch (the mirror
        holds writes meanwhile): drop every session whose record now names another home.
        Returns how many. Raises what the store raises (the caller retries)."""
        dropped = 0
        for key, owner in self._held_here().items():
            found = await self.sessions.lookup(key, self.replica_id, time.time(), self.record_ttl)
            record = found.record
            if record is None or record.home == self.replica_id:
                continue  # still ours (or the store lost its record: published again)
            self.placements.remember(key, record.home, owner)
            await self.drop(owner, f"moved to replica {record.home}")
            dropped += 1
        logger.warning(
            "this replica's heartbeat had lapsed (the store kept its epoch): {} of its "
            "sessions had been taken over by other replicas and were dropped here",
            dropped,
        )
        return dropped

    async def drop(self, owner: Owner, why: str) -> None:
        """Stop everything this replica runs or keeps running for `owner`'s session."""
        running = [e for e in self.manager.running() if e.owner == owner]
        await asyncio.gather(*(self._stop(e, FENCED_MESSAGE) for e in running))
        languages = self.interpreters.forget_owner(owner, "rehomed")
        servers = await self.servers.stop_owner(owner, f"fenced: the session {why}")
        logger.warning(
            "fenced: session {} {} while this replica's heartbeat had lapsed; dropped here: "
            "{} executions ({}), interpreters {}, {} hosted server instances",
            owner.session_id,
            why,
            len(running),
            ", ".join(e.execution_id for e in running) or "none",
            ", ".join(languages) or "none",
            servers,
        )

    def refused(self, execution_ids: list[str]) -> None:
        """The store refused to take these executions (it says `lost`: final): they end
        `lost` here too, stopped if they still run."""
        wanted = set(execution_ids)
        found = [e for e in self.manager.known() if e.execution_id in wanted]

        async def stop_all() -> None:
            await asyncio.gather(*(self._stop(e, LOST_IN_STORE) for e in found))
            if found:
                logger.warning(
                    "fenced: {} executions the shared store says are lost were ended lost here: {}",
                    len(found),
                    ", ".join(e.execution_id for e in found),
                )

        with contextlib.suppress(RuntimeError):  # (closing)
            self.supervisor.spawn("fenced executions", stop_all())

    def evicted(self, why: str) -> None:
        """Another process holds this replica's id now: stop everything held here and serve
        none of its sessions again (their records name this id: the other process's)."""
        self.manager.draining = True  # (forwarded calls are refused as moved)
        held = self._held_here()
        for key, owner in held.items():
            self.placements.remember(key, NO_HOME, owner)

        async def drop_all() -> None:
            for owner in held.values():
                await self.drop(owner, "belongs to another process with this replica's id")

        logger.error("{}: dropping the {} sessions held here", why, len(held))
        with contextlib.suppress(RuntimeError):  # (closing)
            self.supervisor.spawn("evicted replica's sessions", drop_all())

    async def _stop(self, execution: Execution, message: str) -> None:
        """Kill `execution`'s process tree (bounded), then end it `lost`."""
        if not execution.status.finished:
            try:
                await asyncio.wait_for(self.manager.cancel_local(execution, True), STOP_SECONDS)
            except Exception as exc:  # (it is ended lost all the same)
                logger.error("fenced execution {} did not stop: {}", execution.execution_id, exc)
        execution.fence(message)
