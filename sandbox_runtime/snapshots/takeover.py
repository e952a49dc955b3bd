"""Takeovers: a session that reaches this replica without its files gets them back from its
newest snapshot (what its newest-snapshot pointer names).

A newest snapshot that cannot be restored (corrupt, incomplete, more than this workspace can
hold) gives way to the next older snapshot of the session, up to TAKEOVER_ATTEMPTS in all,
within one restore deadline; the reset then names the one restored (`restored_from`) and says
why the newer failed (`newest_failed`), and the one restored becomes the session's newest.
A store that does not answer, or no slot within the deadline, ends the takeover at once: an
older snapshot would fare no better, and the caller is waiting.

Whatever changes what a session holds (a restore, a fork into it, a takeover from an older
snapshot) gives it a snapshot of its own holding that (`own`): a copy of the restored
snapshot's meta and manifest (its packs are shared, so it costs a manifest), named by the
session's pointer. A pointer naming the source instead would not be sound: the source is
another session's (or an older one of this session's), which retention may remove while the
pointer still names it, and the session's newest would then fall back to whatever it took
before.

A session whose record the shared store lost (Redis restarted empty) after its home let it go
(drained, or gone) has no home to publish it again: `lost_record` restores it from its
pointer when the pointer was written under an earlier epoch of the store (its writer's; a
pointer without one: when the session was last used before the store began anew) and the
session was used recently enough that its record would still be there. A record that
expired (unused for its lifetime) or a session never seen in an earlier epoch starts afresh,
as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from loguru import logger

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.snapshots.manifest import ManifestError
from sandbox_runtime.snapshots.records import LOST, MANIFEST_MAX, restored_from
from sandbox_runtime.snapshots.stores import ObjectMissingError

if TYPE_CHECKING:
    from sandbox_runtime.snapshots.service import Snapshots

TAKEOVER_ATTEMPTS = 3  # the newest snapshot and, if it cannot be restored, two older ones
# How long after the store began anew a replica may still write pointers under the earlier
# epoch (it drains, or has not published again yet): past this and a record's lifetime, no
# session can have lost its record with that beginning.
EPOCH_LAG_SECONDS = 3600.0
# A new session's pointer is looked up inside a worker's placement, which the api waits for
# SANDBOX_PLACEMENT_WAIT_SECONDS (10 s): a store that hangs must not make every new session
# miss it (the store's own timeout is 30 s); past this it starts empty, as when the store fails.
POINTER_LOOKUP_SECONDS = 2.0
EMPTY = "the session starts with an empty workspace"


async def take_over(snapshots: Snapshots, owner: Owner) -> dict[str, Any]:
    """Restore the session's newest snapshot into its (empty) workspace, or the next older
    one that can be: what the session_reset says (restored_from, lost, newest_failed;
    restore_failed; {}: it has none)."""
    try:
        newest = await snapshots.latest(owner)
    except Exception as exc:  # a takeover never fails the call: it starts empty
        logger.warning("a session's snapshots could not be listed: {}", exc)
        return {"restore_failed": f"{exc}; {EMPTY}"}
    if newest is None:
        return {}
    failures: list[str] = []
    tried: list[str] = []
    meta: dict[str, Any] | None = newest
    deadline = snapshots.deadline()  # (one for all the attempts: the caller is waiting)
    while meta is not None:
        tried.append(meta["snapshot_id"])
        try:
            applied = await snapshots.restore(owner, meta, "takeover", deadline=deadline)
        except ManifestError as exc:  # this snapshot cannot be restored: an older one may
            failures.append(f"snapshot {meta['snapshot_id']}: {exc}")
            logger.warning("a session's snapshot {} could not be restored: {}",
                           meta["snapshot_id"], exc)  # fmt: skip
            meta = await _older(snapshots, owner, tried, failures)
            continue
        except Exception as exc:  # the store is down, no slot in time: no older one helps
            failures.append(f"snapshot {meta['snapshot_id']}: {exc}")
            logger.warning("a session's snapshot was not restored: {}", exc)
            break
        logger.info("session restored from snapshot {} ({} files, {} bytes)",
                    meta["snapshot_id"], applied.files, applied.bytes)  # fmt: skip
        result = {"restored_from": restored_from(meta), "lost": LOST}
        if failures:
            result["newest_failed"] = (
                f"{'; '.join(failures)}; restored the older snapshot {meta['snapshot_id']}"
            )
        await _make_newest(snapshots, owner, meta)
        return result
    return {"restore_failed": f"{'; '.join(failures)}; {EMPTY}"}


async def _older(
    snapshots: Snapshots, owner: Owner, tried: list[str], failures: list[str]
) -> dict[str, Any] | None:
    """The session's newest snapshot not tried yet (None: none, or enough were tried)."""
    if len(tried) >= TAKEOVER_ATTEMPTS:
        return None
    try:
        found = await snapshots.list(owner.principal, owner.session_id)
    except Exception as exc:
        failures.append(f"older snapshots could not be listed: {exc}")
        return None
    return next((m for m in found if m["snapshot_id"] not in tried), None)


async def _make_newest(snapshots: Snapshots, owner: Owner, meta: dict[str, Any]) -> None:
    """The session holds `meta`'s files now: its pointer must say so (or the next takeover
    brings back the newer one that failed, or nothing)."""
    try:
        await snapshots.own(owner, meta, "takeover")
    except Exception as exc:  # (the session has its files; only the pointer lags)
        logger.warning("a restored session's newest-snapshot pointer was not moved: {}", exc)


async def lost_record(
    snapshots: Snapshots, owner: Owner, epoch: str, store_began: float, record_life: float
) -> dict[str, Any] | None:
    """For a session claimed here as new, with an empty workspace, in the store's epoch
    `epoch` (begun at `store_began`, wall clock): when its pointer was written in an earlier
    epoch and the session was used within `record_life` (a record's lifetime past its last
    use), its record was lost with the store, not expired: restore it. What the
    session_reset says (with `previous_replica`: the replica that wrote the pointer), or
    None (a session new indeed)."""
    now = time.time()
    if now - store_began >= record_life + EPOCH_LAG_SECONDS:
        return None  # (no record lost when the store began would still be alive now)
    try:  # (inside a worker's placement: bounded well within the api's placement wait)
        pointer = await asyncio.wait_for(snapshots.pointer(owner), POINTER_LOOKUP_SECONDS)
    except Exception as exc:  # (cannot tell: it starts empty, as a new session would)
        why = (
            f"no answer within {POINTER_LOOKUP_SECONDS:g} s"
            if isinstance(exc, TimeoutError)
            else exc
        )
        logger.warning(
            "a new session's snapshots could not be looked up ({}); it starts empty", why
        )
        return None
    if pointer is None:
        return None
    try:
        used_at = float(pointer.get("used_at") or pointer.get("taken_at") or 0)
    except (TypeError, ValueError):
        return None
    written_in = pointer.get("store_epoch")
    earlier = written_in != epoch if written_in else used_at < store_began
    if not earlier or now - used_at >= record_life:
        return None
    logger.warning("a session whose record the shared store lost comes back from its snapshot")
    restored = await take_over(snapshots, owner)
    previous = pointer.get("replica")
    return {**restored, "previous_replica": str(previous)[:128] if previous else "unknown"}


async def _nothing() -> None:
    return None


async def own(
    snapshots: Snapshots, owner: Owner, meta: dict[str, Any], trigger: str
) -> tuple[Callable[[], Awaitable[None]], dict[str, Any]]:
    """The session now holds what snapshot `meta` (of its principal) holds: give it a
    snapshot of its own with that content and make it the session's newest, unless its
    pointer names `meta` already. Returns what undoes that (when the change it was made for
    failed), and the meta of the snapshot the session's pointer names now: the one to
    restore from afterwards (the prune after the copy may have removed `meta`'s, the
    source's). Raises StoreUnavailableError, ManifestError."""
    store = snapshots.need_store()
    prefix = snapshots.prefix_of(owner.principal)
    before = await snapshots.pointer(owner)
    if before is not None and before.get("snapshot_id") == meta["snapshot_id"]:
        return _nothing, meta
    snapshot_id = f"snap-{secrets.token_hex(16)}"
    pending = f"{prefix}/pending/{snapshot_id}.json"
    copy = {**meta, "snapshot_id": snapshot_id, "session": owner.session_id,
            "taken_at": time.time(), "trigger": trigger, "stored_bytes": 0,
            "from_snapshot": meta["snapshot_id"]}  # fmt: skip
    try:  # (its packs kept meanwhile: the source may be pruned while this is written)
        await store.put(pending, json.dumps({"packs": copy.get("packs", [])}).encode())
        body = await store.get(f"{prefix}/manifests/{meta['snapshot_id']}.z", MANIFEST_MAX)
        await store.put(f"{prefix}/manifests/{snapshot_id}.z", body)
        await store.put(f"{prefix}/meta/{snapshot_id}.json", json.dumps(copy).encode())
        await snapshots.point(store, owner, copy, time.time())
    except ObjectMissingError as exc:
        raise ManifestError(f"snapshot {meta['snapshot_id']} is incomplete: {exc}") from None
    finally:
        with contextlib.suppress(SandboxRuntimeError):
            await store.delete(pending)
    logger.info("snapshot {} ({}) is a session's newest now: a copy of {}", snapshot_id,
                trigger, meta["snapshot_id"])  # fmt: skip
    try:
        await snapshots.prune(owner.principal, keep_id=snapshot_id)
    except SandboxRuntimeError as exc:
        logger.warning("snapshots not pruned: {}", exc)
    latest = f"{prefix}/latest/{workspace_name(owner)}.json"

    async def undo() -> None:
        with contextlib.suppress(SandboxRuntimeError):
            if before is None:
                await store.delete(latest)
            else:
                await store.put(latest, json.dumps(before).encode())
            await store.delete(f"{prefix}/meta/{snapshot_id}.json")
            await store.delete(f"{prefix}/manifests/{snapshot_id}.z")

    return undo, copy
