"""What the snapshot service writes and reads besides packs and manifests: its metrics, a
snapshot's meta as callers see it, and JSON objects read back from the store (checked)."""

from __future__ import annotations

import json
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from sandbox_runtime.snapshots.manifest import ManifestError

MANIFEST_MAX = 256 * 1024 * 1024  # a stored (compressed) manifest's bytes at most
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


def restored_from(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "snapshot_id": meta["snapshot_id"],
        "taken_at": meta.get("taken_at"),
        "trigger": meta.get("trigger"),
    }


def meta_of(
    snapshot_id: str, session: str, trigger: str, captured: Any, manifest_bytes: int
) -> dict[str, Any]:
    """A snapshot's meta: what list_snapshots shows, and the packs it needs."""
    return {
        "snapshot_id": snapshot_id,
        "session": session,
        "taken_at": time.time(),
        "trigger": trigger,
        "files": captured.files,
        "directories": captured.directories,
        "symlinks": captured.links,
        "hard_links": captured.hard_links,
        "size_bytes": captured.bytes,
        "stored_bytes": captured.new_bytes,
        "manifest_bytes": manifest_bytes,
        "skipped": captured.skipped,
        "changed_while_read": captured.changed_while_read,
        "packs": packs_needed(captured.manifest),
    }


def packs_needed(manifest: dict[str, Any]) -> list[str]:
    return sorted({ref[0] for ref in manifest["chunks"].values()})


def public(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != "packs"}


def loads(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ManifestError("a snapshot object is not valid JSON") from None
    if not isinstance(value, dict):
        raise ManifestError("a snapshot object is not a JSON object")
    return value
