"""Snapshots of sessions' workspaces: taking them, restoring them, listing and pruning them.

A snapshot is, under the principal's prefix `v1/<hash of principal>/` of the store:

    packs/<id>          new chunks (content-addressed, SHA-256), appended; shared by every
                        snapshot of the principal that needs them
    manifests/<sid>.z   the manifest (manifest.py), zlib-compressed JSON
    meta/<sid>.json     what list_snapshots shows, and the packs it needs; written last:
                        a snapshot exists once its meta does
    latest/<ws>.json    the newest snapshot of a session (a hint: the metas decide)

Snapshot ids are 128 random bits; every look-up is under the caller's own prefix, so another
principal can neither list, restore nor fork them. Packs no snapshot needs are removed an
hour after they were written (a snapshot being written elsewhere may not have its meta yet).
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
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from loguru import logger
from prometheus_client import CollectorRegistry, Counter, Histogram

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import InvalidRequestError, LimitExceededError, SandboxRuntimeError
from sandbox_runtime.snapshots.apply import Applied, apply, packs_of
from sandbox_runtime.snapshots.capture import PACK_TARGET, Captured, capture
from sandbox_runtime.snapshots.manifest import MAX_STORED_CHUNK, Bounds, ManifestError
from sandbox_runtime.snapshots.stores import ObjectMissingError, ObjectStore, StoreUnavailableError
from sandbox_runtime.workspaces.store import WorkspaceStore

SNAPSHOT_ID = re.compile(r"snap-[0-9a-f]{32}")
META_MAX = 64 * 1024
MANIFEST_MAX = 256 * 1024 * 1024
PACK_MAX = PACK_TARGET + MAX_STORED_CHUNK
PACK_GRACE_SECONDS = 3600.0
CACHED_MANIFESTS = 8
LOST = "changes made after the snapshot was taken, and interpreter state (variables, imports)"


class SnapshotMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.taken = Counter("srt_snapshots_total", "Snapshots attempted, by trigger and "
                             "outcome.", ["trigger", "outcome"], registry=r)  # fmt: skip
        self.seconds = Histogram("srt_snapshot_seconds", "Time to take a snapshot.",
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
                                 registry=r)  # fmt: skip
        self.stored = Counter("srt_snapshot_stored_bytes_total", "Bytes stored for the first "
                              "time (new chunks, compressed).", registry=r)  # fmt: skip
        self.restores = Counter("srt_snapshot_restores_total", "Restores, by trigger and "
                                "outcome.", ["trigger", "outcome"], registry=r)  # fmt: skip


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]


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
    ) -> None:
        self.store = store
        self.workspaces = workspaces
        self.staging = staging
        shutil.rmtree(staging, ignore_errors=True)  # (what a killed server was writing)
        self.metrics = SnapshotMetrics(registry)
        self.keep, self.ttl, self.quota = keep, ttl_seconds, quota_bytes
        self.max_per_principal = max_per_principal
        self._locks: dict[str, asyncio.Lock] = {}
        self._gates: dict[str, asyncio.Event] = {}
        self._taken: dict[str, float] = {}  # workspace -> when its last snapshot ended
        self._manifests: OrderedDict[str, dict[str, Any]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def _bounds(self) -> Bounds:
        return Bounds(self.workspaces.size_mb * 1024 * 1024, max(1, self.workspaces.inodes))

    def _prefix(self, principal: str) -> str:
        return f"v1/{_digest('principal', principal)}"

    def _need_store(self) -> ObjectStore:
        if self.store is None:
            raise InvalidRequestError("snapshots are turned off (SANDBOX_SNAPSHOT_STORE=none)")
        return self.store

    def _lock(self, name: str) -> asyncio.Lock:
        if len(self._locks) > 10_000:
            self._locks = {n: lk for n, lk in self._locks.items() if lk.locked()}
        return self._locks.setdefault(name, asyncio.Lock())

    # -- a session's calls wait for its restore ----------------------------------------------

    @contextlib.asynccontextmanager
    async def gate(self, owner: Owner) -> AsyncIterator[None]:
        """While held, `settled(owner)` waits: the session's workspace is being replaced."""
        name = workspace_name(owner)
        while (other := self._gates.get(name)) is not None:
            await other.wait()
        event = self._gates[name] = asyncio.Event()
        try:
            yield
        finally:
            del self._gates[name]
            event.set()

    async def settled(self, owner: Owner) -> None:
        while (event := self._gates.get(workspace_name(owner))) is not None:
            await event.wait()

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
        store = self._need_store()
        name = workspace_name(owner)
        started = time.perf_counter()
        outcome = "failed"
        try:
            async with self._lock(name):
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
        prefix = self._prefix(owner.principal)
        previous = await self._previous(store, owner)
        path, _ = await self.workspaces.ensure(name, owner.principal, ahead=True)
        staging = self.staging / secrets.token_hex(8)
        snapshot_id = f"snap-{secrets.token_hex(16)}"
        try:
            with self.workspaces.hold(name):
                known = previous.get("chunks", {}) if previous else {}
                captured: Captured = await asyncio.to_thread(
                    capture, path, staging, self._bounds(), previous, known
                )
            for pack, pack_path in captured.packs:
                await store.put_file(f"{prefix}/packs/{pack}", pack_path)
            body = zlib.compress(json.dumps(captured.manifest, separators=(",", ":")).encode(), 6)
            if len(body) > MANIFEST_MAX:
                raise ManifestError("the workspace's manifest is too large to keep")
            await store.put(f"{prefix}/manifests/{snapshot_id}.z", body)
            packs = sorted({ref[0] for ref in captured.manifest["chunks"].values()})
            meta = {
                "snapshot_id": snapshot_id,
                "session": owner.session_id,
                "taken_at": time.time(),
                "trigger": trigger,
                "files": captured.files,
                "directories": captured.directories,
                "symlinks": captured.links,
                "size_bytes": captured.bytes,
                "stored_bytes": captured.new_bytes,
                "manifest_bytes": len(body),
                "skipped": captured.skipped,
                "changed_while_read": captured.changed_while_read,
                "packs": packs,
            }
            await store.put(f"{prefix}/meta/{snapshot_id}.json", json.dumps(meta).encode())
            latest = {"snapshot_id": snapshot_id, "taken_at": meta["taken_at"]}
            await store.put(f"{prefix}/latest/{name}.json", json.dumps(latest).encode())
        finally:
            shutil.rmtree(staging, ignore_errors=True)
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
        return _public(meta)

    def _cache(self, name: str, manifest: dict[str, Any]) -> None:
        self._manifests[name] = manifest
        self._manifests.move_to_end(name)
        while len(self._manifests) > CACHED_MANIFESTS:
            self._manifests.popitem(last=False)

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
        store = self._need_store()
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID.fullmatch(snapshot_id):
            raise InvalidRequestError("snapshot_id must be an id list_snapshots gave")
        key = f"{self._prefix(principal)}/meta/{snapshot_id}.json"
        try:
            return _loads(await store.get(key, META_MAX))
        except ObjectMissingError:
            raise InvalidRequestError(f"there is no snapshot {snapshot_id} of yours") from None

    async def latest(self, owner: Owner) -> dict[str, Any] | None:
        """The newest snapshot of the owner's session (None: none)."""
        store = self._need_store()
        prefix = self._prefix(owner.principal)
        with contextlib.suppress(ObjectMissingError, ManifestError):
            hint = _loads(await store.get(f"{prefix}/latest/{workspace_name(owner)}.json", 4096))
            with contextlib.suppress(InvalidRequestError):
                return await self.meta(owner.principal, str(hint.get("snapshot_id")))
        found = await self.list(owner.principal, owner.session_id)
        return found[0] if found else None

    async def list(self, principal: str, session: str | None = None) -> list[dict[str, Any]]:
        """The principal's snapshots (of one session), newest first."""
        store = self._need_store()
        metas = []
        for info in await store.list(f"{self._prefix(principal)}/meta"):
            with contextlib.suppress(ObjectMissingError, ManifestError):
                meta = _loads(await store.get(info.key, META_MAX))
                if session is None or meta.get("session") == session:
                    metas.append(meta)
        metas.sort(key=lambda m: float(m.get("taken_at") or 0), reverse=True)
        return metas

    async def _manifest(self, store: ObjectStore, principal: str, snapshot_id: str) -> dict:
        body = await store.get(f"{self._prefix(principal)}/manifests/{snapshot_id}.z", MANIFEST_MAX)
        inflater = zlib.decompressobj()
        limit = self._bounds().max_entries * 2048 + 1024 * 1024
        try:
            text = inflater.decompress(body, limit)
        except zlib.error:
            raise ManifestError(f"the manifest of {snapshot_id} is corrupt") from None
        if inflater.unconsumed_tail:
            raise ManifestError(f"the manifest of {snapshot_id} is larger than it may be")
        return _loads(text)

    # -- restoring ---------------------------------------------------------------------------

    async def restore(
        self, owner: Owner, meta: dict[str, Any], trigger: str, into: str | None = None
    ) -> Applied:
        """Restore snapshot `meta` (of the owner's principal) into the owner's workspace (or
        workspace `into`), which must be empty and unused (a gate held). On failure it is
        left empty and the error raised: ManifestError (corrupt, missing object),
        StoreUnavailableError."""
        store = self._need_store()
        name = into or workspace_name(owner)
        staging = self.staging / secrets.token_hex(8)
        prefix = self._prefix(owner.principal)
        outcome = "failed"
        try:
            manifest = await self._manifest(store, owner.principal, meta["snapshot_id"])
            bounds = self._bounds()
            local: dict[str, Path] = {}
            for pack in await asyncio.to_thread(packs_of, manifest, bounds):
                local[pack] = await store.local(f"{prefix}/packs/{pack}", staging, PACK_MAX)
            path, _ = await self.workspaces.ensure(name, owner.principal, ahead=True)
            with self.workspaces.hold(name):
                applied = await asyncio.to_thread(
                    apply, path, manifest, bounds, local.__getitem__, self._owner_ids()
                )
            self._cache(workspace_name(owner), manifest)
            self._taken[workspace_name(owner)] = time.monotonic()
            outcome = "ok"
            return applied
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
        try:
            meta = await self.latest(owner)
            if meta is None:
                return {}
            applied = await self.restore(owner, meta, "takeover")
        except (ManifestError, StoreUnavailableError) as exc:
            logger.warning("a session's snapshot was not restored: {}", exc)
            return {"restore_failed": f"{exc}; the session starts with an empty workspace"}
        logger.info("session restored from snapshot {} ({} files, {} bytes)",
                    meta["snapshot_id"], applied.files, applied.bytes)  # fmt: skip
        return {"restored_from": restored_from(meta), "lost": LOST}

    # -- retention ---------------------------------------------------------------------------

    async def prune(self, principal: str, keep_id: str = "") -> int:
        """Apply retention to the principal's snapshots (the last `keep` per session, none
        older than the TTL, at most `max_per_principal`, within the byte quota; `keep_id`
        stays unless it alone is over the quota): how many were removed. Then remove packs
        no snapshot needs."""
        store = self._need_store()
        prefix = self._prefix(principal)
        metas = await self.list(principal)
        now = time.time()
        doomed: list[dict[str, Any]] = []
        kept: list[dict[str, Any]] = []
        per_session: dict[str, int] = {}
        for meta in metas:  # newest first
            count = per_session[str(meta.get("session"))] = per_session.get(
                str(meta.get("session")), 0) + 1  # fmt: skip
            expired = float(meta.get("taken_at") or 0) + self.ttl < now
            if meta["snapshot_id"] != keep_id and (count > self.keep or expired):
                doomed.append(meta)
            else:
                kept.append(meta)
        packs = {info.key.rsplit("/", 1)[-1]: info for info in await store.list(f"{prefix}/packs")}

        def held(metas: list[dict[str, Any]]) -> int:
            needed = {p for m in metas for p in m.get("packs", ())}
            return sum(packs[p].size for p in needed if p in packs)

        while len(kept) > 1 and (len(kept) > self.max_per_principal or held(kept) > self.quota):
            oldest = next(m for m in reversed(kept) if m["snapshot_id"] != keep_id)
            kept.remove(oldest)
            doomed.append(oldest)
        if held(kept) > self.quota and keep_id:
            doomed.extend(m for m in kept if m["snapshot_id"] == keep_id)
            kept = [m for m in kept if m["snapshot_id"] != keep_id]
        for meta in doomed:
            await store.delete(f"{prefix}/meta/{meta['snapshot_id']}.json")
            await store.delete(f"{prefix}/manifests/{meta['snapshot_id']}.z")
        needed = {p for m in kept for p in m.get("packs", ())}
        for pack, info in packs.items():
            if pack not in needed and info.modified + PACK_GRACE_SECONDS < now:
                await store.delete(info.key)
        if keep_id and any(m["snapshot_id"] == keep_id for m in doomed):
            raise LimitExceededError(
                f"the snapshot is larger than this token's snapshot quota ({self.quota} bytes)"
                " and was not kept"
            )
        return len(doomed)


def restored_from(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "snapshot_id": meta["snapshot_id"],
        "taken_at": meta.get("taken_at"),
        "trigger": meta.get("trigger"),
    }


def _public(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != "packs"}


def _loads(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ManifestError("a snapshot object is not valid JSON") from None
    if not isinstance(value, dict):
        raise ManifestError("a snapshot object is not a JSON object")
    return value


Sessions = Callable[[], list[Owner]]
