"""The store's epochs: what a replica does when Redis restarts empty.

Redis has no memory of a restart: the store keeps an epoch id, and a new one means it began
anew. Each replica then publishes again the records of the sessions it holds and says so in
its heartbeat (`store_epoch`); a session without a record may start afresh only once every
live replica has, and a heartbeat TTL has passed since the store began anew (so a replica it
has not heard from yet cannot still hold it). The last epoch a replica published under is kept
in its state directory, so a process started after the store restarted says it knew another.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.errors import OwnerUnavailableError
from sandbox_runtime.execution.cluster import ExecutionsHere
from sandbox_runtime.sessions.mirror import Mirror
from sandbox_runtime.sessions.store import SessionStore
from sandbox_runtime.state.store import StateStore

SETTLE_MARGIN_SECONDS = 2.0  # beyond a heartbeat TTL, for records published again
SETTLE_POLL_SECONDS = 0.1

Reclaim = Callable[[], Awaitable[int]]  # publish again the sessions homed here; how many
Fence = Callable[[], Awaitable[int]]  # stop what was taken while the heartbeat lapsed


class EpochWatch:
    def __init__(
        self,
        settings: Settings,
        sessions: SessionStore,
        store: StateStore,
        mirror: Mirror,
        here: Callable[[], ExecutionsHere | None],
    ) -> None:
        self.settings = settings
        self.replica_id = settings.replica_id
        self.sessions = sessions
        self.store = store
        self.mirror = mirror
        self._here = here
        # Set when the mirror finds the store lost what this replica wrote (Redis restarted
        # empty) or is back after an outage: the records are published again at once.
        self.store_changed = asyncio.Event()
        # The store's epoch under which this replica has published the records of the
        # sessions it holds (in its heartbeat: a session with no record may start afresh only
        # once every live replica has).
        self.synced: str | None = None
        self._epoch_file = settings.state_dir / "store-epoch"
        self._known_epoch: str | None = None
        with contextlib.suppress(OSError, UnicodeDecodeError):
            self._known_epoch = self._epoch_file.read_text().strip()[:128] or None

    async def watch(self, reclaim: Reclaim, fence: Fence | None = None) -> None:
        """Publish again, where missing, the records of the sessions homed here whenever the
        store begins a new epoch (Redis restarted empty), so that their next calls, wherever
        they land, come here and find their workspaces; then say so in the heartbeat. Checked
        every heartbeat interval, and at once when the mirror finds the store lost data or is
        back after an outage (then the sessions that moved away meanwhile are learnt of too:
        this replica must not publish a stale home for them later).

        When the mirror holds writes because this replica's heartbeat was gone and the store
        kept its epoch (the heartbeat merely lapsed: a freeze, a partition), `fence` first
        learns which of its sessions other replicas took meanwhile and stops what ran for them
        here; then the writes go on. (A new epoch: the store lost its data, not a lapse: the
        records are published again as above.)"""
        mirror = self.mirror
        backoff = 0.2
        resync = False  # the mirror found the store lost data, or came back after an outage
        while True:
            resync = resync or self.store_changed.is_set()
            self.store_changed.clear()
            try:
                if mirror.evicted is not None:
                    return  # (another process holds this id: nothing more to publish)
                epoch = await self.sessions.epoch(self.synced or self._known_epoch)
                changed = epoch.epoch_id != self.synced
                if mirror.held is not None:
                    if not changed and fence is not None:
                        # The store kept its epoch: this replica's heartbeat merely lapsed, and
                        # others may have taken its sessions. (Beating first: while it lives
                        # nobody takes more.)
                        if not await mirror.beat():
                            raise ConnectionError(mirror.last_error or "the heartbeat failed")
                        await fence()
                    # (A new epoch: the store lost its data; published again below.)
                    mirror.release()
                    resync = True
                here = self._here()
                accepting = here is not None and here.accepting
                if (changed or resync) and accepting:
                    # First this replica's heartbeat (a record whose home has none would be
                    # taken over), then the records, then the heartbeat that says so.
                    if not await mirror.beat():
                        raise ConnectionError(mirror.last_error or "the heartbeat failed")
                    if changed:
                        mirror.release()  # (its heartbeat was lost with the rest)
                    restored = await reclaim()
                    resync = False
                    if changed and (self.synced is not None or restored):
                        logger.warning(
                            "the shared store began anew (epoch {}): published again the "
                            "records of {} sessions homed here",
                            epoch.epoch_id,
                            restored,
                        )
                    self.synced = epoch.epoch_id
                    self._remember_epoch(epoch.epoch_id)
                    await mirror.beat()
                backoff = 0.2
                wait = mirror.heartbeat_interval
            except Exception as exc:  # the store failed: retry with backoff
                if mirror.connected:
                    logger.warning("publishing again the records of sessions homed here: {}", exc)
                wait = backoff
                backoff = min(5.0, backoff * 2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.store_changed.wait(), wait)

    def _remember_epoch(self, epoch_id: str) -> None:
        if epoch_id == self._known_epoch:
            return
        self._known_epoch = epoch_id
        try:
            self._epoch_file.write_text(epoch_id)
        except OSError as exc:  # (then a restart after a store restart may not wait)
            logger.warning("could not keep the store's epoch in {}: {}", self._epoch_file, exc)

    async def await_records_published(self, key: str, record_ttl: int) -> str:
        """Return once a session without a record may start afresh here: the store's epoch
        is old enough that every replica alive before it began has heartbeat since (a
        heartbeat TTL), and every live replica has published the records of the sessions it
        holds under it; or at once if the session's record appears meanwhile. Returns that
        epoch (a claim is made only in it).

        Raises OwnerUnavailableError (the store is down, or the replicas did not publish in
        time: retry).
        """
        ttl = self.settings.heartbeat_ttl
        deadline = time.monotonic() + ttl + SETTLE_MARGIN_SECONDS
        logged = False
        while True:
            try:
                epoch, waiting = await self._unpublished()
                if not waiting:
                    return epoch
                found = await self.sessions.lookup(key, self.replica_id, time.time(), record_ttl)
            except Exception as exc:
                raise OwnerUnavailableError(
                    f"the shared store is unavailable ({type(exc).__name__}); retry shortly"
                ) from exc
            if found.record is not None:
                return epoch
            if not logged:
                logger.info("a session without a record waits for {}", ", ".join(waiting))
                logged = True
            if time.monotonic() >= deadline:
                raise OwnerUnavailableError(
                    "the shared store (Redis) lost its data moments ago and the replicas are "
                    "publishing again the sessions they hold; this session has no record yet "
                    f"(waiting for {', '.join(waiting)}): retry in a few seconds"
                )
            await asyncio.sleep(SETTLE_POLL_SECONDS)

    async def _unpublished(self) -> tuple[str, list[str]]:
        """The store's epoch, and what a session without a record waits for in it before it
        may start afresh (nothing: it may). Raises what the store raises."""
        epoch = await self.sessions.epoch(self.synced or self._known_epoch)
        waiting: list[str] = []
        grace = self.settings.heartbeat_ttl - epoch.age
        if epoch.restarted and grace > 0:
            waiting.append(f"replicas not heard from since ({grace:.1f} s more)")
        if self.synced != epoch.epoch_id:
            waiting.append(f"replica {self.replica_id}")
            self.store_changed.set()  # (publish now, not at the next heartbeat interval)
        # (Alive by the store's clock: its heartbeat key exists. The set's scores are each
        # writer's own clock, and a replica whose clock is behind would drop out of them.)
        peers = await self.store.replica_beats()
        peers.pop(self.replica_id, None)
        # (A heartbeat without the field is an older version's, which never waits.)
        waiting += [
            f"replica {peer}"
            for peer, beat in sorted(peers.items())
            if beat.get("store_epoch", epoch.epoch_id) != epoch.epoch_id
        ]
        return epoch.epoch_id, waiting
