"""Snapshots of sessions' workspaces: taking them, restoring them, listing and pruning them
(the one facade over capture, apply, the store and retention, each of which is a module of its
own; what is left here is their order and their bounds, hence its length).

A snapshot is, under the principal's prefix `v1/<hash of principal>/` of the store:

    packs/<id>          new chunks (content-addressed, SHA-256), appended; shared by every
                        snapshot of the principal that needs them
    manifests/<sid>.z   the manifest (manifest.py), zlib-compressed JSON
    meta/<sid>.json     what list_snapshots shows, and the packs it needs; written last:
                        a snapshot exists once its meta does
    latest/<ws>.json    the newest snapshot of a session: what a takeover restores. Every
                        operation that changes what the session holds moves it: a snapshot,
                        and a restore, a fork into it or a takeover from an older snapshot,
                        each of which gives the session a snapshot of its own (a copy of the
                        restored one's meta and manifest: its packs are shared), so retention
                        of the source never takes the session's newest away

Snapshot ids are 128 random bits; every look-up is under the caller's own prefix, so another
principal can neither list, restore nor fork them. Retention and what no snapshot needs:
retention.py (a snapshot being written names the packs it needs in `pending/<sid>.json`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import re
import secrets
import shutil
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger
from prometheus_client import CollectorRegistry

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import InvalidRequestError, SandboxRuntimeError
from sandbox_runtime.snapshots.apply import Applied, apply, packs_of
from sandbox_runtime.snapshots.capture import PACK_TARGET, Captured, capture
from sandbox_runtime.snapshots.gates import FairSlots, Gates
from sandbox_runtime.snapshots.manifest import (
    MAX_STORED_CHUNK,
    Bounds,
    ManifestError,
    max_manifest_bytes,
)
from sandbox_runtime.snapshots.records import (
    MANIFEST_MAX,
    SnapshotMetrics,
    loads,
    meta_of,
    packs_needed,
    public,
)
from sandbox_runtime.snapshots.retention import prune
from sandbox_runtime.snapshots.room import usable_bytes
from sandbox_runtime.snapshots.stores import ObjectMissingError, ObjectStore, StoreUnavailableError
from sandbox_runtime.snapshots.takeover import lost_record, own, take_over
from sandbox_runtime.supervisor import Supervisor
from sandbox_runtime.workspaces.store import WorkspaceStore

SNAPSHOT_ID = re.compile(r"snap-[0-9a-f]{32}")
META_MAX = 64 * 1024
PACK_MAX = PACK_TARGET + MAX_STORED_CHUNK
CACHED_MANIFESTS = 8
SLOTS = 3  # captures and restores running at once
PRINCIPAL_SLOTS = 2  # of them, one principal's (another always finds a slot)
POINTER_MAX = 4096
T = TypeVar("T")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]


async def _home_here(owner: Owner) -> bool:
    return True  # (alone: every session's home)


class Snapshots:
    """Takes and restores snapshots of this replica's sessions' workspaces."""

    def __init__(
        self,
        store: ObjectStore | None,
        workspaces: WorkspaceStore,
        staging: Path,
        registry: CollectorRegistry,
        *,
        keep: int = 5,
        ttl_seconds: float = 7 * 86400,
        quota_bytes: int = 10 * 1024**3,
        max_per_principal: int = 100,
        restore_seconds: float = 120.0,
        supervisor: Supervisor | None = None,
        replica_id: str = "",
        store_epoch: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store = store
        self.workspaces = workspaces
        self.staging = staging
        shutil.rmtree(staging, ignore_errors=True)  # (what a killed server was writing)
        self.metrics = SnapshotMetrics(registry)
        self.keep, self.ttl, self.quota = keep, ttl_seconds, quota_bytes
        self.max_per_principal = max_per_principal
        self._locks: dict[str, asyncio.Lock] = {}
        self.gates = Gates()
        self._taken: dict[str, float] = {}  # workspace -> when its last snapshot ended
        self._manifests: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Captures and restores at once (each a thread reading or writing a whole workspace).
        self._slots = FairSlots(SLOTS, PRINCIPAL_SLOTS)
        self.restore_seconds = restore_seconds
        self.supervisor = supervisor
        self.replica_id = replica_id
        # The shared store's epoch this replica's session records are in (None: no store, or
        # not known yet): in each pointer, so a record lost with the store can be told from
        # one that expired (takeover.lost_record).
        self.store_epoch = store_epoch
        # Whether this replica is still the session's home (the composition root sets it: a
        # shared store's record and this replica's heartbeat). A replica back from a freeze
        # mid-upload must not move a session taken over meanwhile back to its stale snapshot.
        self.still_home: Callable[[Owner], Awaitable[bool]] = _home_here
        # The session's environment ({name, digest}: execution/images.py): recorded in each
        # snapshot, and adopted by the session a snapshot is restored into, so a session
        # restored on another replica goes on on the same one (set by the composition root).
        self.environment_of: Callable[[Owner], dict[str, str] | None] = lambda owner: None
        self.adopt_environment: Callable[[Owner, Any], None] = lambda owner, record: None

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def _bounds(self, path: Path | None = None, empty: bool = False) -> Bounds:
        """The workspace's bounds: its quota, and the usable size of its filesystem at
        `path` (see usable_bytes) when it has one."""
        quota = self.workspaces.size_mb * 1024 * 1024
        usable = None
        if path is not None:
            with contextlib.suppress(OSError):
                usable = usable_bytes(path, empty)
        limit = quota if usable is None else max(0, min(quota, usable))
        return Bounds(limit, max(1, self.workspaces.inodes))

    def deadline(self) -> float:
        """The event loop's time by which a restore (or a wait for a slot) must be done."""
        return asyncio.get_running_loop().time() + self.restore_seconds

    def prefix_of(self, principal: str) -> str:
        return f"v1/{_digest('principal', principal)}"

    def need_store(self) -> ObjectStore:
        if self.store is None:
            raise InvalidRequestError("snapshots are turned off (SANDBOX_SNAPSHOT_STORE=none)")
        return self.store

    def _lock(self, name: str) -> asyncio.Lock:
        if len(self._locks) > 10_000:
            self._locks = {n: lk for n, lk in self._locks.items() if lk.locked()}
        return self._locks.setdefault(name, asyncio.Lock())

    # -- a session's calls wait for its restore (gates.py) ----------------------------------

    def gate(self, owner: Owner) -> contextlib.AbstractAsyncContextManager[None]:
        return self.gates.hold(workspace_name(owner))

    async def settled(self, owner: Owner) -> None:
        await self.gates.settled(workspace_name(owner))

    def replacing(self, owner: Owner) -> bool:
        return self.gates.is_open(workspace_name(owner))

    # -- taking ------------------------------------------------------------------------------

    def changed_since_snapshot(self, owner: Owner, idle_seconds: float = 0.0) -> bool:
        """Whether the owner's workspace was used this run after its last snapshot (and has
        been idle `idle_seconds` since)."""
        name = workspace_name(owner)
        last = self.workspaces.last_used(name)
        if last is None or time.monotonic() - last < idle_seconds:
            return False
        return last > self._taken.get(name, -math.inf)

    async def take(self, owner: Owner, trigger: str) -> dict[str, Any]:
        """Snapshot the owner's workspace now: its meta (id, size, ...). Raises
        StoreUnavailableError, ManifestError (over bounds), SandboxRuntimeError."""
        store = self.need_store()
        name = workspace_name(owner)
        started = time.perf_counter()
        outcome = "failed"
        try:
            async with self._lock(name):
                await self.settled(owner)  # (before a slot: the restore it waits for needs one)
                async with self._slots.hold(owner.principal, self.deadline()):
                    meta = await self._take(store, owner, name, trigger)
            outcome = "ok"
            return meta
        except StoreUnavailableError:
            outcome = "store_unavailable"
            raise
        finally:
            self.metrics.taken.labels(trigger, outcome).inc()
            self.metrics.seconds.observe(time.perf_counter() - started)

    async def _take(self, store: ObjectStore, owner: Owner, name: str, trigger: str) -> dict:
        prefix = self.prefix_of(owner.principal)
        replaced = self.gates.replaced(name)
        used_at = self._used_at(name)  # (before the capture, which uses it too)
        previous = await self._previous(store, owner)
        snapshot_id = f"snap-{secrets.token_hex(16)}"
        pending = f"{prefix}/pending/{snapshot_id}.json"
        try:
            captured = await self._capture_and_upload(store, owner, name, prefix, pending, previous)
            if captured is None:  # a pack it reused was removed meantime: all of it, afresh
                captured = await self._capture_and_upload(store, owner, name, prefix, pending)
            if captured is None:
                raise ManifestError("the store lost packs while the snapshot was written")
            if self.replacing(owner) or self.gates.replaced(name) != replaced:
                raise ManifestError(
                    "the session's workspace was replaced (restored) while it was being "
                    "snapshotted: this snapshot is not kept; take another"
                )
            body = zlib.compress(json.dumps(captured.manifest, separators=(",", ":")).encode(), 6)
            if len(body) > MANIFEST_MAX:
                raise ManifestError("the workspace's manifest is too large to keep")
            await store.put(f"{prefix}/manifests/{snapshot_id}.z", body)
            meta = meta_of(snapshot_id, owner.session_id, trigger, captured, len(body))
            if (environment := self.environment_of(owner)) is not None:
                meta["environment"] = environment
            await store.put(f"{prefix}/meta/{snapshot_id}.json", json.dumps(meta).encode())
            if await self.still_home(owner):
                await self.point(store, owner, meta, used_at)
            else:
                logger.warning(
                    "snapshot {} of a session taken ({}) is not made its newest: this "
                    "replica's heartbeat lapsed or the session moved to another replica",
                    snapshot_id,
                    trigger,
                )
        finally:
            with contextlib.suppress(SandboxRuntimeError):
                await store.delete(pending)
        self._taken[name] = time.monotonic()
        self._cache(name, captured.manifest)
        self.metrics.stored.inc(captured.new_bytes)
        logger.info("snapshot {} of a session taken ({}): {} files, {} bytes, {} new",
                    snapshot_id, trigger, captured.files, captured.bytes,
                    captured.new_bytes)  # fmt: skip
        try:
            await self.prune(owner.principal, keep_id=snapshot_id)
        except SandboxRuntimeError as exc:
            logger.warning("snapshots not pruned: {}", exc)
        return public(meta)

    async def _capture_and_upload(
        self,
        store: ObjectStore,
        owner: Owner,
        name: str,
        prefix: str,
        pending: str,
        previous: dict[str, Any] | None = None,
    ) -> Captured | None:
        """Capture the workspace and upload its new packs; None when a pack it reuses from
        `previous` is no longer in the store (pruned meanwhile, here or on another replica).

        The packs it needs are recorded first (`pending`): prune keeps them while that record
        is young, so none can go between the check below and the snapshot's meta."""
        path, _ = await self.workspaces.ensure(name, owner.principal, ahead=True)
        staging = self.staging / secrets.token_hex(8)
        try:
            with self.workspaces.hold(name):
                known = previous.get("chunks", {}) if previous else {}
                bounds = self._bounds(path)
                captured: Captured = await asyncio.to_thread(
                    capture, path, staging, bounds, previous, known
                )
            needed = packs_needed(captured.manifest)
            await store.put(pending, json.dumps({"packs": needed}).encode())
            for pack, pack_path in captured.packs:
                await store.put_file(f"{prefix}/packs/{pack}", pack_path)
            stored = {info.key.rsplit("/", 1)[-1] for info in await store.list(f"{prefix}/packs")}
            if not set(needed) <= stored:
                self._manifests.pop(name, None)
                return None
            return captured
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _cache(self, name: str, manifest: dict[str, Any]) -> None:
        self._manifests[name] = manifest
        self._manifests.move_to_end(name)
        while len(self._manifests) > CACHED_MANIFESTS:
            self._manifests.popitem(last=False)

    def _used_at(self, name: str) -> float:
        """When the workspace was last used (wall clock; now if not this run)."""
        last = self.workspaces.last_used(name)
        now = time.time()
        return now if last is None else min(now, now - (time.monotonic() - last))

    async def point(
        self, store: ObjectStore, owner: Owner, meta: dict[str, Any], used_at: float
    ) -> None:
        """Make `meta` the session's newest snapshot (its pointer): what a takeover restores.
        `used_at`: when the session was last used (see takeover.lost_record)."""
        pointer = {"snapshot_id": meta["snapshot_id"], "taken_at": meta["taken_at"],
                   "used_at": used_at, "replica": self.replica_id,
                   "store_epoch": self.store_epoch()}  # fmt: skip
        key = f"{self.prefix_of(owner.principal)}/latest/{workspace_name(owner)}.json"
        await store.put(key, json.dumps(pointer).encode())

    async def pointer(self, owner: Owner) -> dict[str, Any] | None:
        """The session's newest-snapshot pointer (None: none, or unreadable)."""
        store = self.need_store()
        key = f"{self.prefix_of(owner.principal)}/latest/{workspace_name(owner)}.json"
        with contextlib.suppress(ObjectMissingError, ManifestError):
            return loads(await store.get(key, POINTER_MAX))
        return None

    async def own(
        self, owner: Owner, meta: dict[str, Any], trigger: str
    ) -> tuple[Callable[[], Awaitable[None]], dict[str, Any]]:
        """The session now holds what snapshot `meta` holds: see takeover.own."""
        return await own(self, owner, meta, trigger)

    async def _previous(self, store: ObjectStore, owner: Owner) -> dict[str, Any] | None:
        """The last manifest of the owner's workspace (its chunks are not stored again)."""
        name = workspace_name(owner)
        if name in self._manifests:
            return self._manifests[name]
        meta = await self.latest(owner)
        if meta is None:
            return None
        with contextlib.suppress(ManifestError, ObjectMissingError):
            return await self._manifest(store, owner.principal, meta["snapshot_id"])
        return None

    # -- finding -----------------------------------------------------------------------------

    async def meta(self, principal: str, snapshot_id: str) -> dict[str, Any]:
        """A snapshot of `principal`'s (InvalidRequestError: there is none of that id)."""
        store = self.need_store()
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID.fullmatch(snapshot_id):
            raise InvalidRequestError("snapshot_id must be an id list_snapshots gave")
        key = f"{self.prefix_of(principal)}/meta/{snapshot_id}.json"
        try:
            return loads(await store.get(key, META_MAX))
        except ObjectMissingError:
            raise InvalidRequestError(f"there is no snapshot {snapshot_id} of yours") from None

    async def latest(self, owner: Owner) -> dict[str, Any] | None:
        """The newest snapshot of the owner's session (None: none)."""
        hint = await self.pointer(owner)
        if hint is not None:
            with contextlib.suppress(InvalidRequestError):
                return await self.meta(owner.principal, str(hint.get("snapshot_id")))
        found = await self.list(owner.principal, owner.session_id)
        return found[0] if found else None

    async def list(self, principal: str, session: str | None = None) -> list[dict[str, Any]]:
        """The principal's snapshots (of one session), newest first."""
        store = self.need_store()
        metas = []
        for info in await store.list(f"{self.prefix_of(principal)}/meta"):
            with contextlib.suppress(ObjectMissingError, ManifestError):
                meta = loads(await store.get(info.key, META_MAX))
                if session is None or meta.get("session") == session:
                    metas.append(meta)
        metas.sort(key=lambda m: float(m.get("taken_at") or 0), reverse=True)
        return metas

    async def _manifest(self, store: ObjectStore, principal: str, snapshot_id: str) -> dict:
        key = f"{self.prefix_of(principal)}/manifests/{snapshot_id}.z"
        body = await store.get(key, MANIFEST_MAX)
        inflater = zlib.decompressobj()
        limit = max_manifest_bytes(self._bounds())
        try:
            text = inflater.decompress(body, limit)
        except zlib.error:
            raise ManifestError(f"the manifest of {snapshot_id} is corrupt") from None
        if inflater.unconsumed_tail:
            raise ManifestError(f"the manifest of {snapshot_id} is larger than it may be")
        return loads(text)

    # -- restoring ---------------------------------------------------------------------------

    async def restore(
        self,
        owner: Owner,
        meta: dict[str, Any],
        trigger: str,
        into: str | None = None,
        deadline: float | None = None,
    ) -> Applied:
        """Restore snapshot `meta` (of the owner's principal) into the owner's workspace (or
        workspace `into`), which must be empty and unused (a gate held). On failure it is
        left empty and the error raised: ManifestError (corrupt, missing object, more than
        the workspace holds), StoreUnavailableError, SlotsBusyError. Waiting for a slot and
        fetching are both within the restore's deadline (`deadline`, the event loop's time:
        one shared by several attempts; None: restore_seconds from now)."""
        store = self.need_store()
        name = into or workspace_name(owner)
        staging = self.staging / secrets.token_hex(8)
        prefix = self.prefix_of(owner.principal)
        outcome = "failed"
        deadline = self.deadline() if deadline is None else deadline
        try:
            async with self._slots.hold(owner.principal, deadline):
                applied = await self._restore(store, owner, meta, name, prefix, staging, deadline)
            outcome = "ok"
            return applied
        except TimeoutError:
            raise StoreUnavailableError(
                f"the snapshot could not be restored within {self.restore_seconds:g} s"
            ) from None
        except ObjectMissingError as exc:
            raise ManifestError(f"snapshot {meta['snapshot_id']} is incomplete: {exc}") from None
        except OSError as exc:
            raise ManifestError(
                f"snapshot {meta['snapshot_id']} could not be written: {exc}"
            ) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            self.metrics.restores.labels(trigger, outcome).inc()
            if outcome != "ok":
                await self._wipe(name, owner.principal, again=name == workspace_name(owner))

    async def _restore(
        self,
        store: ObjectStore,
        owner: Owner,
        meta: dict[str, Any],
        name: str,
        prefix: str,
        staging: Path,
        deadline: float,
    ) -> Applied:
        """Fetch the manifest and packs (within the restore's deadline: the store may hang),
        then write the workspace (local: not cut off half-way by a deadline), within what
        its filesystem has free (checked whole first: a snapshot too large fails at once)."""
        async with asyncio.timeout_at(deadline):
            manifest = await self._manifest(store, owner.principal, meta["snapshot_id"])
            local: dict[str, Path] = {}
            for pack in await asyncio.to_thread(packs_of, manifest, self._bounds()):
                local[pack] = await store.local(f"{prefix}/packs/{pack}", staging, PACK_MAX)
        path, _ = await self.workspaces.ensure(name, owner.principal, ahead=True)
        bounds = self._bounds(path, empty=True)
        with self.workspaces.hold(name):
            applied = await asyncio.to_thread(
                apply, path, manifest, bounds, local.__getitem__, self._owner_ids()
            )
        self._cache(workspace_name(owner), manifest)
        self._taken[workspace_name(owner)] = time.monotonic()
        if name == workspace_name(owner):  # (the session goes on on the snapshot's environment)
            self.adopt_environment(owner, meta.get("environment"))
        return applied

    def _owner_ids(self) -> tuple[int, int] | None:
        uid, gid = self.workspaces.uid, self.workspaces.gid
        return (uid, gid) if uid >= 0 else None

    async def _wipe(self, name: str, principal: str, again: bool) -> None:
        """Remove workspace `name` (a restore failed part-way); `again`: make it anew, empty."""
        with contextlib.suppress(OSError, SandboxRuntimeError):
            if self.workspaces.exists(name):
                await self.workspaces.remove(name)
            if again:
                await self.workspaces.ensure(name, principal, ahead=True)

    async def take_over(self, owner: Owner) -> dict[str, Any]:
        """After the session came here with an empty workspace (its home died, stopped, or
        lost it): restore its newest snapshot. What the session_reset then says: restored_from
        and lost, or restore_failed ({}: no snapshot, or snapshots are off)."""
        if self.store is None:
            return {}
        return await self._shielded(take_over(self, owner))

    async def _shielded(self, work: Coroutine[Any, Any, T]) -> T:
        if self.supervisor is None:
            return await work
        # A caller that gives up (cancelled) must not end the restore half-way, nor the gate
        # its session's other calls wait at: the restore runs on, and the gate with it.
        task = self.supervisor.spawn("restore a session", work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
            raise

    async def lost_record(
        self, owner: Owner, epoch: str, store_began: float, record_life: float
    ) -> dict[str, Any] | None:
        """A session claimed here as new, its workspace empty: restored from its pointer if
        its record was lost with the store (see takeover.lost_record); what its reset says,
        or None."""
        if self.store is None:
            return None
        work = lost_record(self, owner, epoch, store_began, record_life)
        return await self._shielded(work)

    # -- retention ---------------------------------------------------------------------------

    async def prune(self, principal: str, keep_id: str = "") -> int:
        """Apply retention to the principal's snapshots (see retention.prune): how many were
        removed."""
        store = self.need_store()
        return await prune(
            store,
            self.prefix_of(principal),
            await self.list(principal),
            keep=self.keep,
            ttl=self.ttl,
            quota=self.quota,
            max_count=self.max_per_principal,
            keep_id=keep_id,
        )
