"""Retention of a principal's snapshots: the newest `keep` of each session, none older than
the TTL, at most `max_count`, within the byte quota (packs and manifests); then removing what
no snapshot needs: packs (an hour after they were written, unless a snapshot being written
names them in its pending record) and manifests whose snapshot never got its meta."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from sandbox_runtime.errors import LimitExceededError
from sandbox_runtime.snapshots.manifest import ManifestError
from sandbox_runtime.snapshots.records import loads
from sandbox_runtime.snapshots.stores import ObjectMissingError, ObjectStore

PACK_GRACE_SECONDS = 3600.0
PENDING_MAX = 4 * 1024 * 1024


async def prune(
    store: ObjectStore,
    prefix: str,
    metas: list[dict[str, Any]],
    *,
    keep: int,
    ttl: float,
    quota: int,
    max_count: int,
    keep_id: str = "",
) -> int:
    """Apply retention to the principal's snapshots (the last `keep` per session, none
    older than the TTL, at most `max_per_principal`, within the byte quota; `keep_id`
    stays unless it alone is over the quota): how many were removed. Then remove packs
    no snapshot needs."""
    now = time.time()
    doomed: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    per_session: dict[str, int] = {}
    for meta in metas:  # newest first
        count = per_session[str(meta.get("session"))] = per_session.get(
            str(meta.get("session")), 0) + 1  # fmt: skip
        expired = float(meta.get("taken_at") or 0) + ttl < now
        if meta["snapshot_id"] != keep_id and (count > keep or expired):
            doomed.append(meta)
        else:
            kept.append(meta)
    packs = {info.key.rsplit("/", 1)[-1]: info for info in await store.list(f"{prefix}/packs")}

    def held(metas: list[dict[str, Any]]) -> int:
        needed = {p for m in metas for p in m.get("packs", ())}
        manifests = sum(int(m.get("manifest_bytes") or 0) for m in metas)
        return manifests + sum(packs[p].size for p in needed if p in packs)

    while len(kept) > 1 and (len(kept) > max_count or held(kept) > quota):
        oldest = next(m for m in reversed(kept) if m["snapshot_id"] != keep_id)
        kept.remove(oldest)
        doomed.append(oldest)
    if held(kept) > quota and keep_id:
        doomed.extend(m for m in kept if m["snapshot_id"] == keep_id)
        kept = [m for m in kept if m["snapshot_id"] != keep_id]
    for meta in doomed:
        await store.delete(f"{prefix}/meta/{meta['snapshot_id']}.json")
        await store.delete(f"{prefix}/manifests/{meta['snapshot_id']}.z")
    needed = {p for m in kept for p in m.get("packs", ())}
    needed |= await _pending_packs(store, prefix, now)
    for pack, info in packs.items():
        if pack not in needed and info.modified + PACK_GRACE_SECONDS < now:
            await store.delete(info.key)
    known = {m["snapshot_id"] for m in metas}
    for info in await store.list(f"{prefix}/manifests"):  # (a snapshot cut off mid-way)
        sid = info.key.rsplit("/", 1)[-1].removesuffix(".z")
        if sid not in known and info.modified + PACK_GRACE_SECONDS < now:
            await store.delete(info.key)
    if keep_id and any(m["snapshot_id"] == keep_id for m in doomed):
        raise LimitExceededError(
            f"the snapshot is larger than this token's snapshot quota ({quota} bytes)"
            " and was not kept"
        )
    return len(doomed)


async def _pending_packs(store: ObjectStore, prefix: str, now: float) -> set[str]:
    """The packs snapshots being written (here or elsewhere) need: kept while their record
    is younger than the grace period; older records (a writer that died) are removed."""
    needed: set[str] = set()
    for info in await store.list(f"{prefix}/pending"):
        if info.modified + PACK_GRACE_SECONDS < now:
            await store.delete(info.key)
            continue
        with contextlib.suppress(ObjectMissingError, ManifestError):
            record = loads(await store.get(info.key, PENDING_MAX))
            needed |= {str(p) for p in record.get("packs", ())}
    return needed
