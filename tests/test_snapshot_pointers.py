"""A session's newest-snapshot pointer on its own: looked up on a session's path (a worker's
placement) within a bound whatever the store does (a pointer that is a FIFO nobody writes
blocks a read, as a hung shared filesystem or S3 endpoint would); moved by a snapshot only
while this replica is still the session's home; naming the session's own copy of a snapshot
it was restored from, which stays restorable when retention removes the source; a takeover's
attempts within one restore deadline. A real Snapshots on a real directory store, workspaces
as plain directories."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.snapshots import takeover
from sandbox_runtime.snapshots.manifest import ManifestError
from sandbox_runtime.snapshots.service import Snapshots
from sandbox_runtime.snapshots.stores import DirectoryStore
from sandbox_runtime.workspaces.store import WorkspaceStore

pytestmark = pytest.mark.unit


@contextlib.contextmanager
def hanging_pointer(root: Path, snapshots: Snapshots, owner: Owner) -> Iterator[None]:
    """The owner's pointer a FIFO: a read blocks until the end, which frees it (EOF)."""
    fifo = root / snapshots.prefix_of(owner.principal) / "latest" / f"{workspace_name(owner)}.json"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    try:
        yield
    finally:  # (a reader blocked in a store thread gets EOF and ends)
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        fifo.unlink()


async def test_a_new_sessions_pointer_lookup_that_hangs_ends_in_seconds_and_starts_empty(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    snapshots = Snapshots(
        DirectoryStore(root, timeout=30),  # (the store's own timeout: past the placement wait)
        None,  # type: ignore[arg-type]  # (a pointer lookup uses no workspace)
        tmp_path / "staging",
        CollectorRegistry(),
    )
    owner = Owner("alice", "s:one")
    with hanging_pointer(root, snapshots, owner):
        began = time.monotonic()
        restored = await takeover.lost_record(snapshots, owner, "epoch-2", time.time() - 60, 3600)
        took = time.monotonic() - began
    assert restored is None  # (it starts empty, as when the store fails)
    assert takeover.POINTER_LOOKUP_SECONDS <= took < takeover.POINTER_LOOKUP_SECONDS + 2, took


def local_snapshots(
    tmp_path: Path, keep: int = 5, restore_seconds: float = 120.0
) -> tuple[Snapshots, WorkspaceStore]:
    workspaces = WorkspaceStore(tmp_path / "ws", size_mb=16, inodes=256, quota="none",
                                retention_seconds=3600)  # fmt: skip
    workspaces.start(os.getuid(), os.getgid())
    store = DirectoryStore(tmp_path / "store", timeout=30)
    registry = CollectorRegistry()
    snapshots = Snapshots(
        store,
        workspaces,
        tmp_path / "staging",
        registry,
        keep=keep,
        restore_seconds=restore_seconds,
    )
    return snapshots, workspaces


async def test_a_snapshot_taken_once_this_replica_is_no_longer_home_does_not_move_the_pointer(
    tmp_path: Path,
) -> None:
    """(A replica back from a freeze mid-upload: the session was taken over meanwhile.)"""
    snapshots, workspaces = local_snapshots(tmp_path)
    owner = Owner("alice", "s:one")
    path, _ = await workspaces.ensure(workspace_name(owner), owner.principal)
    (path / "a.txt").write_text("first")
    first = await snapshots.take(owner, "manual")
    assert (await snapshots.pointer(owner) or {}).get("snapshot_id") == first["snapshot_id"]
    home = False

    async def still_home(asked: Owner) -> bool:
        assert asked == owner
        return home

    snapshots.still_home = still_home
    (path / "a.txt").write_text("stale")
    stale = await snapshots.take(owner, "manual")
    assert stale["snapshot_id"] != first["snapshot_id"]
    assert (await snapshots.pointer(owner) or {}).get("snapshot_id") == first["snapshot_id"]
    home = True
    newest = await snapshots.take(owner, "manual")
    assert (await snapshots.pointer(owner) or {}).get("snapshot_id") == newest["snapshot_id"]
    await workspaces.aclose()


async def test_a_restored_sessions_own_copy_stays_restorable_when_retention_removes_the_source(
    tmp_path: Path,
) -> None:
    """restore_session of the session's older snapshot: `own` copies it, and the prune after
    the copy (two kept per session here) removes the source. What own returns is the copy,
    from which the restore that follows a failed adopt (a mount cap) writes the files."""
    snapshots, workspaces = local_snapshots(tmp_path, keep=2)
    owner = Owner("alice", "s:one")
    path, _ = await workspaces.ensure(workspace_name(owner), owner.principal)
    (path / "a.txt").write_text("restored")
    source = await snapshots.take(owner, "manual")
    meta = await snapshots.meta(owner.principal, source["snapshot_id"])
    (path / "a.txt").write_text("newer")  # (so the session's pointer names another)
    await snapshots.take(owner, "manual")
    _, held = await snapshots.own(owner, meta, "on_demand")
    assert (
        held["snapshot_id"] != meta["snapshot_id"] and held["from_snapshot"] == meta["snapshot_id"]
    )
    assert (await snapshots.pointer(owner) or {}).get("snapshot_id") == held["snapshot_id"]
    await workspaces.remove(workspace_name(owner))
    with pytest.raises(ManifestError):  # (the source is gone: pruned)
        await snapshots.restore(owner, meta, "on_demand")
    applied = await snapshots.restore(owner, held, "on_demand")
    assert applied.files == 1
    path, _ = await workspaces.ensure(workspace_name(owner), owner.principal)
    assert (path / "a.txt").read_text() == "restored"
    await workspaces.aclose()


def slow_corrupt(fifo: Path, after: float, stop: threading.Event) -> None:
    """Once a reader opened `fifo`, answer it `after` seconds later with bytes that are no
    manifest (a store that is slow, then corrupt)."""
    while not stop.is_set():
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # (ENXIO: no reader yet)
            stop.wait(0.02)
            continue
        stop.wait(after)
        with contextlib.suppress(OSError):
            os.write(fd, b"not a manifest")
        os.close(fd)
        return


async def test_a_takeovers_attempts_share_one_restore_deadline(tmp_path: Path) -> None:
    """The two newest snapshots each fail after 1.5 s; the restore deadline is 2.5 s. One
    deadline for all attempts: the second ends at 2.5 s in all and the takeover says so (a
    deadline for each let it go on to the third, holding its caller past the deadline)."""
    snapshots, workspaces = local_snapshots(tmp_path, restore_seconds=2.5)
    owner = Owner("alice", "s:one")
    path, _ = await workspaces.ensure(workspace_name(owner), owner.principal)
    taken = []
    for i in range(3):
        (path / "a.txt").write_text(f"v{i}")
        taken.append((await snapshots.take(owner, "manual"))["snapshot_id"])
    await workspaces.remove(workspace_name(owner))
    await workspaces.ensure(workspace_name(owner), owner.principal)
    manifests = tmp_path / "store" / snapshots.prefix_of(owner.principal) / "manifests"
    stop = threading.Event()
    writers = []
    for snapshot_id in taken[1:]:
        fifo = manifests / f"{snapshot_id}.z"
        fifo.unlink()
        os.mkfifo(fifo)
        writers.append(threading.Thread(target=slow_corrupt, args=(fifo, 1.5, stop)))
    for writer in writers:
        writer.start()
    try:
        began = time.monotonic()
        result = await takeover.take_over(snapshots, owner)
        took = time.monotonic() - began
    finally:
        stop.set()
        for writer in writers:
            writer.join(10)
    assert "restore_failed" in result and "restored_from" not in result, result
    assert f"snapshot {taken[2]}: the manifest of {taken[2]} is corrupt" in result["restore_failed"]
    assert "could not be restored within 2.5 s" in result["restore_failed"], result
    assert took < 2.5 + 1, took
    await workspaces.aclose()
