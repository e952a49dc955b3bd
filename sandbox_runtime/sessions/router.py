"""The Router: where a session's operations run, here or on the session's home replica (every
path a session-bound call can take, homing, forwarding, re-homing and restoring, in one
place so that none is missed, hence its length).

Session-bound operations run on the session's home: here, or forwarded over the cluster
channel. A session without a live home gets this replica (an api replica's: a worker, through
the placement queue); a re-homed one says so (`session_reset`, with its snapshot restored).
Reads and control of executions, wherever they run, are `Router.executions`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import (
    InvalidRequestError,
    LimitExceededError,
    OwnerUnavailableError,
    SandboxRuntimeError,
    SandboxSpawnError,
)
from sandbox_runtime.sessions.channel import (
    ChannelClient,
    HomeMovedError,
    HomeUnreachableError,
)
from sandbox_runtime.sessions.cluster import LocalCluster
from sandbox_runtime.sessions.executions import ExecutionAccess
from sandbox_runtime.sessions.fence import Fence
from sandbox_runtime.sessions.models import SessionRecord, SessionReset
from sandbox_runtime.sessions.operations import OPERATIONS, Parts, Progress, wait_bound
from sandbox_runtime.sessions.placements import Placement, Placements, RecentHomes
from sandbox_runtime.state.keys import session_key

# A session's record lives twice the retention period past its last use: it outlives the
# workspace (removed after one period of disuse), so a call after that learns of the loss.
RECORD_LIFE_FACTOR = 2
PLACEMENT_ATTEMPTS = 4  # lookups per operation (a home may move or stop meanwhile)
RECLAIM_SESSION_LIMIT = 2**31


class Router:
    """Routes session-bound operations to their home and serves reads from anywhere."""

    def __init__(self, settings: Settings, parts: Parts, cluster: LocalCluster, queue: Any = None):
        self.settings = settings
        self.parts = parts
        self.manager = manager = parts.manager
        self.cluster = cluster
        self.replica_id = manager.replica_id
        self.metrics = manager.metrics
        self.sessions = cluster.sessions
        self.signer = cluster.signer
        if self.signer is not None:  # (proofs for this process name the heartbeat's incarnation)
            self.signer.incarnation = manager.incarnation
        self.channel = ChannelClient(self.signer) if self.signer is not None else None
        self.executions = ExecutionAccess(
            settings, manager, cluster.elsewhere(manager, self.channel)
        )
        self.control = self.executions.elsewhere.control_channel
        self._record_ttl = (
            max(settings.retention_seconds, settings.workspace_retention_seconds)
            * RECORD_LIFE_FACTOR
        )
        self._owed: dict[str, SessionReset] = {}  # resets not yet told to a caller
        # Sessions claimed here whose workspace a mount cap kept from being made: its first
        # making is no reset.
        self._unmade: set[str] = set()
        self.placements = Placements()
        self.recent_homes = RecentHomes()  # (where this replica's forwarded calls went)
        self.queue = queue  # an api replica's PlacementQueue: workers home its sessions
        # (What it stops when this replica comes back from a lapsed heartbeat: fence.py.)
        self.fence = Fence(self.replica_id, self.sessions, self.placements, parts, self._record_ttl)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.cluster.watch(
            self.manager.running,
            self._record_ttl,
            self._reclaim_all,
            self.executions.mark_previous_incarnations_lost,
            self.fence,
        )

    async def aclose(self) -> None:
        if self.channel is not None:
            await self.channel.aclose()

    # -- placement ---------------------------------------------------------------------------

    async def place(self, owner: Owner) -> Placement:
        """Where `owner`'s session-bound operations run now; claims or re-homes as needed.

        Raises LimitExceededError (too many sessions), OwnerUnavailableError (store down and
        the home unknown), SandboxSpawnError (this replica is stopping).
        """
        key = session_key(owner.principal, owner.session_id)
        if self.cluster.evicted is not None:
            raise OwnerUnavailableError(f"this replica serves no sessions: {self.cluster.evicted}")
        epoch: str | None = None  # the store's epoch in which a fresh start may be claimed
        for _ in range(PLACEMENT_ATTEMPTS):
            now = time.time()
            try:
                found = await self.sessions.lookup(
                    key, self.replica_id, now, self._record_ttl, take=True
                )
            except Exception as exc:  # the store is down: fall back to the last known home
                return self._place_without_store(key, exc)
            record = found.record
            if found.touched and record is not None:
                self.placements.remember(key, record.home, owner)
                reset = await self._check_workspace(owner)
                return Placement(True, self.replica_id, reset=record.owed_reset() or reset)
            if record is None and epoch is None:
                # No record: a new session, or one the store forgot (restarted empty) whose
                # home has not published it again yet. Wait until every replica has.
                epoch = await self.cluster.await_records_published(key, self._record_ttl)
                continue
            if record is None:
                placement = await self._claim(owner, None, epoch=epoch)
                if placement is None:
                    epoch = None  # (the store began anew meanwhile: wait again)
            elif record.state == "released":
                reason = "home_stopped" if record.released_reason == "home_stopped" else "home_lost"
                placement = await self._claim(owner, record, reason)
            elif found.home_heartbeat is None:
                # Its executions end `lost` first (final): the home, should it come back,
                # writes nothing over them (state/redis_store.py).
                await self.executions.elsewhere.listed(owner, set())
                placement = await self._claim(owner, record, "home_lost")
            else:
                address = str(found.home_heartbeat.get("cluster_address") or "")
                if not address:
                    raise OwnerUnavailableError(
                        f"this session lives on replica {record.home}, which has no cluster "
                        "listener (it runs without SANDBOX_CLUSTER_SECRET?)"
                    )
                incarnation = str(found.home_heartbeat.get("incarnation") or "")
                placement = Placement(False, record.home, address, incarnation=incarnation)
            if placement is not None:
                self.placements.remember(key, placement.home, owner)
                return placement
        raise OwnerUnavailableError("this session's home kept changing; retry shortly")

    async def _reclaim_all(self) -> int:
        """Claim again every session homed here that the store has no record of."""
        restored = 0
        for key, owner in self.placements.homed_at(self.replica_id):
            if not self.manager.accepting:
                break  # (stopping: its sessions are being released)
            restored += await self._reclaim(key, owner)
        return restored

    async def _reclaim(self, key: str, owner: Owner) -> bool:
        """Claim `owner`'s session here if the store has none of it (else learn its home)."""
        still_here = self.placements.get(key) == (self.replica_id, owner)
        if not still_here or not self.manager.workspaces.exists(workspace_name(owner)):
            return False  # placed elsewhere meanwhile, or its workspace is gone
        now = time.time()
        record = self._record_here(owner, None, now)
        record.published_again_at = now  # (no fresh start: the session goes on)
        # (Not a new session: the per-principal limit does not refuse it.)
        outcome = await self.sessions.claim(record, None, RECLAIM_SESSION_LIMIT, self._record_ttl)
        if outcome == "claimed":
            return True
        found = await self.sessions.lookup(key, self.replica_id, now, self._record_ttl)
        if found.record is not None and found.record.home != self.replica_id:
            self.placements.remember(key, found.record.home, owner)  # not ours any more
            # It started afresh there (this replica could not publish its record in time):
            # its next call must say so; the files here are the old session's.
            if await self.sessions.owe_reset(key, found.record.home, "store_lost", self.replica_id):
                logger.warning(
                    "session {} started afresh on replica {} while its workspace was here "
                    "(the shared store lost its record)",
                    owner.session_id,
                    found.record.home,
                )
            # What still runs here for it would make two live homes: stopped (fence.py).
            await self.fence.drop(owner, f"moved to replica {found.record.home} (store lost)")
        return False

    async def _check_workspace(self, owner: Owner) -> SessionReset | None:
        """For a session homed here: a reset if its workspace is gone (removed after the
        retention period, or this replica came back without its state directory)."""
        snapshots, key = self.parts.snapshots, session_key(owner.principal, owner.session_id)
        await snapshots.settled(owner)  # (a restore under way here: after it)
        workspaces, name = self.manager.workspaces, workspace_name(owner)
        restored: dict[str, Any] = {}
        if workspaces.is_ready(name) or workspaces.exists(name):
            existed = await self._ensure_workspace(owner)
        else:  # gone: made again, and its newest snapshot restored, before anything runs
            async with snapshots.gate(owner):
                existed = await self._ensure_workspace(owner)
                if existed is False and key not in self._unmade:
                    workspaces.take_removed(name)  # (told here: its record lived on)
                    restored = await snapshots.take_over(owner)
        if existed is None:
            return None  # (not mounted now: no verdict yet)
        if existed or key in self._unmade:
            self._unmade.discard(key)
            return None
        self.metrics.sessions.labels("workspace_removed").inc()
        return SessionReset(
            reason="workspace_removed", previous_replica=self.replica_id, **restored
        )

    def _place_without_store(self, key: str, exc: Exception) -> Placement:
        # (Only the sessions it last saw homed here, while its heartbeat lives: see Placements.)
        self.placements.serve_without_store(
            key, self.replica_id, exc, self.cluster.last_contact, self.settings.heartbeat_ttl
        )
        return Placement(True, self.replica_id)

    def _record_here(
        self, owner: Owner, previous: SessionRecord | None, now: float
    ) -> SessionRecord:
        """A record homing `owner`'s session on this replica, following `previous` if any."""
        return SessionRecord(
            principal=owner.principal,
            session_id=owner.session_id,
            home=self.replica_id,
            home_started_at=self.manager.started_at,
            created_at=previous.created_at if previous else now,
            last_used_at=now,
            generation=previous.generation + 1 if previous else 1,
        )

    async def _claim(
        self,
        owner: Owner,
        previous: SessionRecord | None,
        reason: str = "",
        epoch: str | None = None,
    ) -> Placement | None:
        """Make this replica the session's home (None: someone else changed it first, or the
        store is no longer in `epoch`)."""
        if not self.manager.accepting:
            raise SandboxSpawnError("this replica is shutting down; retry on another replica")
        if self.queue is not None:  # (a worker claims it: found by the next lookup)
            await self.queue.place(owner)
            return None
        async with self.parts.snapshots.gate(owner):  # (its calls wait for its restore)
            return await self._claim_now(owner, previous, reason, epoch)

    async def _claim_now(
        self, owner: Owner, previous: SessionRecord | None, reason: str, epoch: str | None
    ) -> Placement | None:
        now = time.time()
        record = self._record_here(owner, previous, now)
        try:
            outcome = await self.sessions.claim(
                record,
                previous.generation if previous else None,
                self.settings.max_sessions_per_principal,
                self._record_ttl,
                previous.home if previous else None,
                epoch or None,
                # (Taken from a home without a heartbeat: one back meanwhile keeps it.)
                previous_dead=previous is not None and previous.state == "active",
            )
        except Exception as exc:  # the store failed between lookup and claim
            raise OwnerUnavailableError(
                f"the shared store is unavailable ({type(exc).__name__}); retry shortly"
            ) from exc
        if outcome == "session_limit":
            self.metrics.rejections.labels("principal_sessions").inc()
            raise LimitExceededError(
                f"this token has its maximum of {self.settings.max_sessions_per_principal} "
                "live sessions on this service (SANDBOX_MAX_SESSIONS_PER_PRINCIPAL); reuse "
                "one (the `session` argument) or wait for an idle one to expire "
                f"({self.settings.retention_seconds} s after its last use)"
            )
        if outcome != "claimed":
            return None
        if previous is None:
            if (made := await self._ensure_workspace(owner)) is None:
                if len(self._unmade) > 100_000:  # (forgetting one costs a false reset)
                    self._unmade.clear()
                self._unmade.add(session_key(owner.principal, owner.session_id))
            lost = await self._lost_record(owner) if made is False else None
            if made is False and self.manager.workspaces.take_removed(workspace_name(owner)):
                # Removed over an idle budget after this replica forgot the session (it
                # restarted): its newest snapshot, if any, and the session is told.
                self.metrics.sessions.labels("workspace_removed").inc()
                restored = await self.parts.snapshots.take_over(owner)
                lost = SessionReset(
                    reason="workspace_removed", previous_replica=self.replica_id, **restored
                )
            else:
                self.metrics.sessions.labels("created").inc()
            return Placement(True, self.replica_id, reset=lost)
        # A fresh workspace: whatever this replica kept from an earlier stay is stale.
        workspaces = self.manager.workspaces
        if workspaces.exists(workspace_name(owner)):
            with contextlib.suppress(OSError, SandboxRuntimeError):
                await workspaces.remove(workspace_name(owner))
        if self.manager.images is not None:  # (and its environment then: a snapshot
            self.manager.images.forget(owner)  # restored now brings the one it has)
        await self._ensure_workspace(owner)
        self.metrics.sessions.labels(reason).inc()
        logger.warning(
            "session re-homed here from replica {} ({})", previous.home, reason.replace("_", " ")
        )
        reset = SessionReset(reason=reason, previous_replica=previous.home)  # type: ignore[arg-type]
        self.owe(owner, reset)  # (told even if this caller gives up during the restore)
        restored = await self.parts.snapshots.take_over(owner)
        reset = SessionReset.model_validate({**reset.model_dump(), **restored})
        self.owe(owner, reset)
        return Placement(True, self.replica_id, reset=reset)

    async def _lost_record(self, owner: Owner) -> SessionReset | None:
        """A session claimed as new, its workspace empty: if the store lost its record (it
        restarted empty after the session's home let it go), its newest snapshot."""
        if not self.parts.snapshots.enabled:
            return None
        try:
            epoch = await self.sessions.epoch(None)
        except Exception:  # (the claim just went through: a store failing now is rare)
            return None
        began = time.time() - epoch.age
        restored = await self.parts.snapshots.lost_record(
            owner, epoch.epoch_id, began, self._record_ttl
        )
        if restored is None:
            return None
        reset = SessionReset.model_validate({"reason": "store_lost", **restored})
        self.owe(owner, reset)  # (a worker placing it for an api replica: told to its call)
        return reset

    async def _ensure_workspace(self, owner: Owner) -> bool | None:
        """Whether the owner's workspace was already there (it is now, if it can be); None
        when a mount cap keeps it from being mounted now."""
        name = workspace_name(owner)
        if self.manager.backend.unavailable_reason is not None:
            return self.manager.workspaces.exists(name)
        workspaces = self.manager.workspaces
        try:
            existed = (await workspaces.ensure(name, owner.principal, ahead=True))[1]
            workspaces.record_owner(name, owner)  # (whose it is, for the idle budgets)
            return existed
        except LimitExceededError:  # (a mount cap: the operation itself says so)
            return None
        except SandboxRuntimeError:  # the operation itself says why
            return self.manager.workspaces.exists(name)

    # -- session-bound operations ------------------------------------------------------------

    async def run(
        self, owner: Owner, op: str, args: dict[str, Any], progress: Progress | None = None
    ) -> dict[str, Any]:
        """Run operation `op` on the session's home; its result (with `session_reset` when
        the session started afresh). Raises the operation's domain errors and
        OwnerUnavailableError."""
        if op not in OPERATIONS:
            raise InvalidRequestError(f"unknown operation {op!r}")
        last_error: Exception | None = None
        key = session_key(owner.principal, owner.session_id)
        for _ in range(PLACEMENT_ATTEMPTS):
            recent, found_at = self.recent_homes.get(key), time.monotonic()
            placement = recent or await self.place(owner)
            if placement.local:
                return await self._run_here(owner, op, args, progress, placement.reset)
            assert self.channel is not None  # a remote home implies a secret (see place)
            call = {
                "op": op,
                "principal": owner.principal,
                "session_id": owner.session_id,
                "args": args,
            }
            started = time.perf_counter()
            try:
                with self.recent_homes.trying(key, placement, None if recent else found_at):
                    result = await self.channel.call(
                        placement.home,
                        placement.address,
                        placement.incarnation,
                        call,
                        progress,
                        wait_bound(args, self.settings.max_timeout),
                    )
            except HomeMovedError as exc:
                self.metrics.forwarded.labels(op, "moved").inc()
                last_error = exc
                continue
            except HomeUnreachableError as exc:
                self.metrics.forwarded.labels(op, "unreachable").inc()
                last_error = exc
                if await self.fence.home_alive(owner, placement.home):
                    raise OwnerUnavailableError(
                        f"{exc}; its sessions move to another replica once its heartbeat "
                        f"expires (within {self.settings.heartbeat_ttl} s): retry then"
                    ) from None
                continue
            self.metrics.forwarded.labels(op, "ok").inc()
            self.metrics.forward_seconds.observe(time.perf_counter() - started)
            return result
        raise OwnerUnavailableError(
            f"could not reach this session's home replica ({last_error}); retry shortly"
        )

    async def _run_here(
        self,
        owner: Owner,
        op: str,
        args: dict[str, Any],
        progress: Progress | None,
        reset: SessionReset | None,
    ) -> dict[str, Any]:
        """Run an operation of a session homed here. A reset is owed to the caller until an
        operation succeeds: one that fails first (a bad argument, a full limit) must not
        swallow the news that the session started afresh."""
        key = session_key(owner.principal, owner.session_id)
        if reset is not None:
            self.owe(owner, reset)
        await self.parts.snapshots.settled(owner)  # (placed without the store: not yet waited)
        result = await OPERATIONS[op](self.parts, owner, args, progress)
        owed = self._owed.pop(key, None)
        checked = self.manager.workspaces.take_reset(workspace_name(owner))
        if checked is not None and owed is None:  # (repaired or set aside: see workspaces)
            owed = SessionReset(reason=checked, previous_replica=self.replica_id)  # type: ignore[arg-type]
        if owed is not None:
            result["session_reset"] = owed.model_dump(exclude_none=True)
            if "state_reset" in result:  # the interpreter was lost with the session
                result["state_reset"] = {"reason": "rehomed"}
        return result

    def owe(self, owner: Owner, reset: SessionReset) -> None:
        """Tell the owner's next successful call that the session started afresh (a placement
        made outside an operation, e.g. for a file URL, found it so)."""
        self._owed[session_key(owner.principal, owner.session_id)] = reset
        if len(self._owed) > 100_000:
            self._owed.pop(next(iter(self._owed)))

    async def serve_forwarded(
        self, call: dict[str, Any], progress: Progress | None
    ) -> dict[str, Any]:
        """Run an operation another replica forwarded here (the cluster listener's handler).

        Raises HomeMovedError when this replica is not the session's active home.
        """
        op = call.get("op")
        principal, session_id = call.get("principal"), call.get("session_id")
        args = call.get("args")
        if (
            op not in OPERATIONS
            or not isinstance(principal, str)
            or not isinstance(session_id, str)
            or not isinstance(args, dict)
        ):
            raise InvalidRequestError("malformed forwarded call")
        if not self.manager.accepting or self.manager.draining:
            raise HomeMovedError(f"replica {self.replica_id} is shutting down")
        owner = Owner(principal, session_id)
        try:
            found = await self.sessions.lookup(
                session_key(principal, session_id),
                self.replica_id,
                time.time(),
                self._record_ttl,
                take=True,
            )
        except Exception as exc:  # (the caller skipped its own lookup: see RecentHomes)
            raise OwnerUnavailableError(
                f"the shared store is unavailable ({type(exc).__name__}); retry shortly"
            ) from exc
        if not found.touched or found.record is None:
            raise HomeMovedError(f"replica {self.replica_id} is not this session's home")
        self.placements.remember(session_key(principal, session_id), self.replica_id, owner)
        self.metrics.forwarded_served.labels(op).inc()
        self.metrics.forwarded_serving.inc()
        try:
            reset = await self._check_workspace(owner)
            reset = found.record.owed_reset() or reset
            return await self._run_here(owner, op, args, progress, reset)
        finally:
            self.metrics.forwarded_serving.dec()
