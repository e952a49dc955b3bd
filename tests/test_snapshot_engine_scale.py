"""Snapshots' engine at scale and under churn: 100k small files, a tree deeper than Python's
recursion limit, files changing while they are captured. Plain files as in
test_snapshot_engine.py (its helpers), but each takes seconds of disk and CPU: integration,
out of the `-m unit` loop."""

from __future__ import annotations

import base64
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_snapshot_engine import (
    BIG,
    KiB,
    MiB,
    bounded,
    entry_at,
    packs,
    remove_tree,
    restore,
    snap,
    stored,
    write,
)

from sandbox_runtime.snapshots import capture as capture_module
from sandbox_runtime.snapshots.manifest import MAX_PATH_BYTES, validate

pytestmark = pytest.mark.integration


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def trust_fresh_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests capture right after writing (test_snapshot_engine.py tests the rule that a
    file changed within the last 50 ms is read again next time)."""
    monkeypatch.setattr(capture_module, "RECENT_NS", 0)


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs (/dev/shm) if there is one, else tmp_path: making and restoring
    100k files on a disk other tests are writing to can take minutes, which is not what the
    test measures."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="srt-snapshot-test-", dir=shm))
    try:
        yield path
    finally:
        remove_tree(path)


def test_100k_small_files_round_trip(fast_dir: Path) -> None:
    # (1000 directories: more than apply keeps open at once, so it closes and reopens some)
    tmp_path = fast_dir
    ws = tmp_path / "ws"
    ws.mkdir()
    started = time.perf_counter()
    for d in range(1000):
        directory = ws / f"d{d:04}"
        directory.mkdir()
        for i in range(100):
            with open(directory / f"f{i:03}", "wb") as f:
                f.write(b"%d/%d\n" % (d, i))
    made = time.perf_counter()
    captured = snap(ws, tmp_path / "staging")
    captured_at = time.perf_counter()
    done = restore(tmp_path / "target", captured.manifest, packs(captured))
    restored_at = time.perf_counter()
    print(
        f"\n100k files: made in {made - started:.1f} s, captured in {captured_at - made:.1f} s, "
        f"restored in {restored_at - captured_at:.1f} s"
    )
    assert (captured.files, captured.directories) == (100_000, 1000)
    assert (done.files, done.directories) == (100_000, 1000)
    assert len(captured.manifest["chunks"]) == 100_000
    target = tmp_path / "target"
    for d in (0, 1, 511, 512, 513, 999):
        for i in (0, 57, 99):
            assert (target / f"d{d:04}" / f"f{i:03}").read_bytes() == b"%d/%d\n" % (d, i)
    assert sum(len(files) for _, _, files in os.walk(target)) == 100_000


def test_deep_and_long_paths_make_a_snapshot_that_restores(tmp_path: Path, ws: Path) -> None:
    """A tree nested deeper than Python's recursion limit (its paths within a manifest's
    4096 bytes) is captured and restored; a path longer than a manifest may hold is left out
    (and counted), never kept in a manifest apply would refuse whole."""
    try:
        fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(1500):  # "d/d/d/...": 2999 bytes
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
            f.write(b"deep")
        os.close(fd)
        fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(20):  # 20 names of 250 bytes: past 4096
            os.mkdir("n" * 250, dir_fd=fd)
            child = os.open("n" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(fd)
        write(ws / "top", b"top")

        captured = snap(ws, tmp_path / "staging")
        validate(stored(captured.manifest), BIG)
        paths = [len(base64.b64decode(e["pb"]) if "pb" in e else e["p"].encode()) for e in
                 captured.manifest["entries"]]  # fmt: skip
        assert max(paths) <= MAX_PATH_BYTES
        assert captured.directories == 1500 + MAX_PATH_BYTES // 251
        assert captured.skipped == {"long_path": 1}
        done = restore(tmp_path / "target", captured.manifest, packs(captured))
        assert done.files == 2
        leaf = "/".join(["d"] * 1500) + "/leaf"
        fd = os.open(tmp_path / "target", os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in leaf.split("/")[:-1]:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = child
            leaf_fd = os.open("leaf", os.O_RDONLY, dir_fd=fd)
            assert os.read(leaf_fd, 10) == b"deep"
            os.close(leaf_fd)
        finally:
            os.close(fd)
    finally:
        remove_tree(tmp_path)
        tmp_path.mkdir()


# -- files changing while read ---------------------------------------------------------------


def _pattern(size: int, seed: int) -> bytes:
    unit = bytes((i * seed) % 255 + 1 for i in range(4099))  # (no zero bytes)
    return (unit * (size // len(unit) + 1))[:size]


def _bytes_or_zeros(kept: bytes, data: bytes) -> bool:
    """Whether each byte of `kept` is the byte of `data` at its offset, or zero."""
    if len(kept) > len(data):
        return False
    zeros = bytes(4096)
    for at in range(0, len(kept), 4096):
        page, want = kept[at : at + 4096], data[at : at + 4096]
        if page not in (want[: len(page)], zeros[: len(page)]):
            if any(b not in (0, w) for b, w in zip(page, want, strict=False)):
                return False
    return True


def test_files_changing_while_captured(tmp_path: Path, ws: Path) -> None:
    """One file grows, one shrinks and grows again, all the while: every capture finishes,
    its manifest is valid and restores, and what it kept of each file is what the file held
    (the one pattern written, at its offsets) when the change was not seen; when it was (and
    counted), only bytes of the file or zeros (a read racing a truncate can see zeros)."""
    size = 8 * MiB
    churn_data, grow_data = _pattern(size, 7), _pattern(4 * size, 13)
    write(ws / "churn", churn_data)
    write(ws / "grow", b"")
    write(ws / "still", b"still")
    stop = threading.Event()

    def churn() -> None:
        fd = os.open(ws / "churn", os.O_RDWR)
        try:
            while not stop.is_set():
                for kept in range(size, -1, -512 * KiB):
                    os.ftruncate(fd, kept)
                for offset in range(0, size, 1 * MiB):
                    os.pwrite(fd, churn_data[offset : offset + MiB], offset)
        finally:
            os.close(fd)

    def grow() -> None:
        with open(ws / "grow", "ab") as f:
            for offset in range(0, len(grow_data), 64 * KiB):
                if stop.is_set():
                    return
                f.write(grow_data[offset : offset + 64 * KiB])
                f.flush()
                time.sleep(0.0005)

    writers = [threading.Thread(target=churn), threading.Thread(target=grow)]
    for writer in writers:
        writer.start()
    changed = 0
    try:
        for round_ in range(10):
            captured = bounded(lambda r=round_: snap(ws, tmp_path / f"s{r}"))
            changed += captured.changed_while_read
            validate(stored(captured.manifest), BIG)
            target = tmp_path / f"t{round_}"
            restore(target, captured.manifest, packs(captured))
            assert (target / "still").read_bytes() == b"still"
            for name, data in (("churn", churn_data), ("grow", grow_data)):
                kept = (target / name).read_bytes()
                assert len(kept) == entry_at(captured.manifest, name)["s"]
                if captured.changed_while_read == 0:
                    assert kept == data[: len(kept)], f"{name}: not what the file held"
                else:  # (what was read: the file's bytes, or zeros where it was cut meanwhile)
                    assert _bytes_or_zeros(kept, data), f"{name}: bytes it never held"
            remove_tree(target)
    finally:
        stop.set()
        for writer in writers:
            writer.join(30)
    print(f"\nfiles changed while read, over 10 captures: {changed}")
