"""Snapshots' engine on real directories: capture (a workspace walked into a manifest and
pack files) and apply (a manifest restored into an empty directory), and apply's refusal of
hostile manifests. No store, no service, no sandbox: plain files under tmp_path, as root."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import socket
import stat
import subprocess
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandbox_runtime.snapshots import capture as capture_module
from sandbox_runtime.snapshots.apply import Applied, apply, packs_of
from sandbox_runtime.snapshots.capture import Captured, CaptureError, capture
from sandbox_runtime.snapshots.manifest import (
    BLOCK,
    CHUNK,
    Bounds,
    ManifestError,
    validate,
)

pytestmark = pytest.mark.unit

BIG = Bounds(max_bytes=1 << 34, max_entries=1_000_000)
KiB, MiB = 1024, 1024 * 1024
TIB = 1 << 40


# -- helpers ---------------------------------------------------------------------------------


def snap(
    root: Path,
    staging: Path,
    bounds: Bounds = BIG,
    previous: dict[str, Any] | None = None,
    known: dict[str, list[Any]] | None = None,
) -> Captured:
    return capture(root, staging, bounds, previous, known or {})


def packs(*captures: Captured) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for captured in captures:
        found.update(dict(captured.packs))
    return found


def stored(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest as the service keeps it (JSON) and reads it back."""
    return json.loads(json.dumps(manifest, separators=(",", ":")))


def restore(
    target: Path,
    manifest: dict[str, Any],
    pack_files: dict[str, Path],
    bounds: Bounds = BIG,
) -> Applied:
    target.mkdir(mode=0o700)
    return apply(target, stored(manifest), bounds, pack_files.__getitem__, None)


def tree(root: Path) -> dict[bytes, tuple[Any, ...]]:
    """Everything under `root` (bytes paths): kind, mode, mtime and content (hash) or target."""
    base = os.fsencode(root)
    found: dict[bytes, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, base)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("l", os.readlink(full), st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("d", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                found[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_size, digest)
    return found


def bounded(fn: Callable[[], Any], seconds: float = 30.0) -> Any:
    """fn() in a thread: it must finish within `seconds` (it must not block)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # (handed to the test)
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} did not finish in {seconds} s (blocked?)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def unblock_fifo(path: Path) -> None:
    """Release any reader blocked opening the FIFO at `path` (a failed test's cleanup)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def remove_tree(path: Path) -> None:
    """rm -rf (shutil.rmtree recurses once per level: not for deep trees)."""
    subprocess.run(["rm", "-rf", "--", str(path)], check=True)


def write(path: Path | bytes, data: bytes, mode: int = 0o644, mtime_ns: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def entry_at(manifest: dict[str, Any], path: str) -> dict[str, Any]:
    for entry in manifest["entries"]:
        if entry.get("p") == path:
            return entry
    raise KeyError(path)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir()
    return path


# -- round trips -----------------------------------------------------------------------------


def test_round_trip_keeps_files_modes_times_dirs_links_and_odd_names(
    tmp_path: Path, ws: Path
) -> None:
    t0 = 1_600_000_000_123_456_789
    rng = os.urandom(10 * MiB + 123)  # crosses chunk boundaries, does not compress
    text = b"the same line, again and again\n" * 200_000  # compresses
    write(ws / "plain.txt", b"hello\n", 0o640, t0)
    write(ws / "run.sh", b"#!/bin/sh\necho hi\n", 0o755, t0 + 1)
    write(ws / "empty", b"", 0o600, t0 + 2)
    write(ws / "random.bin", rng, 0o644, t0 + 3)
    write(ws / "text.log", text, 0o444, t0 + 4)
    (ws / "empty-dir").mkdir(mode=0o750)
    (ws / "d" / "e" / "f").mkdir(parents=True)
    (ws / "ro").mkdir()
    write(ws / "ro" / "inside", b"in a read-only directory", 0o600, t0 + 5)
    os.chmod(ws / "ro", 0o555)
    # names: a newline, and bytes that are not UTF-8
    (ws / "dir\nwith\nnewlines").mkdir()
    write(ws / "dir\nwith\nnewlines" / "file\nname", b"newline names", 0o600, t0 + 6)
    bad_dir = os.fsencode(ws) + b"/\xc3("
    os.mkdir(bad_dir)
    write(bad_dir + b"/caf\xe9.txt", b"latin-1 name", 0o600, t0 + 7)
    write(os.fsencode(ws) + b"/bad\xff\xfe.bin", b"\xff\xfe", 0o600, t0 + 8)
    # symlinks, kept as links: relative, dangling, to directories, outside, odd targets
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "fifo")  # (a link followed to it would block the walk)
    os.symlink("plain.txt", ws / "rel-link")
    os.symlink("no/such/file", ws / "dangling")
    os.symlink("d/e", ws / "dir-link")
    os.symlink("/etc/shadow", ws / "shadow")
    os.symlink(outside / "fifo", ws / "to-fifo")
    os.symlink(outside, ws / "to-outside")
    os.symlink(b"\xff\xfe-target", os.fsencode(ws) + b"/odd-target")
    os.symlink("../../..", ws / "d" / "up")
    for link in ("rel-link", "dangling", "shadow", "to-fifo", "d/up"):
        os.utime(ws / link, ns=(t0 + 9, t0 + 9), follow_symlinks=False)
    for directory in ("d/e/f", "d/e", "d", "empty-dir", "dir\nwith\nnewlines"):
        os.utime(ws / directory, ns=(t0 + 10, t0 + 10))
    before = tree(ws)

    try:
        captured = bounded(lambda: snap(ws, tmp_path / "staging"))
    finally:
        unblock_fifo(outside / "fifo")
    manifest = captured.manifest
    validate(stored(manifest), BIG)
    assert captured.files == 9
    assert captured.links == 8
    assert captured.directories == 7
    assert captured.skipped == {}
    assert captured.changed_while_read == 0
    assert captured.bytes == sum(e.get("s", 0) for e in manifest["entries"])  # (none sparse)
    assert entry_at(manifest, "shadow")["l"] == "/etc/shadow"
    odd = [e for e in manifest["entries"] if "pb" in e]
    assert {base64.b64decode(e["pb"]) for e in odd} == {  # (not UTF-8, or control characters)
        b"\xc3(",
        b"\xc3(/caf\xe9.txt",
        b"bad\xff\xfe.bin",
        b"dir\nwith\nnewlines",
        b"dir\nwith\nnewlines/file\nname",
    }
    assert base64.b64decode(entry_at(manifest, "odd-target")["lb"]) == b"\xff\xfe-target"
    assert {ref[4] for ref in manifest["chunks"].values()} == {0, 1}  # both kinds stored
    assert captured.new_bytes < len(rng) + len(text) // 10

    done = restore(tmp_path / "target", manifest, packs(captured))
    assert (done.files, done.links, done.directories) == (9, 8, 7)
    assert done.bytes == captured.bytes
    after = tree(tmp_path / "target")
    assert after == before
    assert os.readlink(tmp_path / "target" / "shadow") == "/etc/shadow"
    assert os.readlink(tmp_path / "target" / "to-fifo") == str(outside / "fifo")
    assert os.listdir(outside) == ["fifo"]
    assert (tmp_path / "target" / "random.bin").read_bytes() == rng


def test_a_1_tib_sparse_file_is_read_by_its_data_and_restored_sparse(
    tmp_path: Path, ws: Path
) -> None:
    sparse = ws / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(TIB)
        for offset, data in ((0, b"head"), (TIB // 2, b"middle"), (TIB - 4, b"tail")):
            f.seek(offset)
            f.write(data)
    assert os.stat(sparse).st_size == TIB

    started = time.perf_counter()
    captured = bounded(lambda: snap(ws, tmp_path / "staging", Bounds(1 * MiB, 10)))
    seconds = time.perf_counter() - started
    print(f"\ncapture of a 1 TiB sparse file: {seconds:.3f} s, {captured.bytes} bytes read")
    entry = entry_at(captured.manifest, "sparse")
    assert entry["s"] == TIB
    assert len(entry["x"]) == 3  # one extent per written block: the holes are not stored
    assert captured.bytes <= 3 * 64 * KiB
    assert sum(path.stat().st_size for _, path in captured.packs) <= 3 * 64 * KiB

    done = restore(tmp_path / "target", captured.manifest, packs(captured), Bounds(1 * MiB, 10))
    assert done.bytes == captured.bytes
    restored = tmp_path / "target" / "sparse"
    st = os.stat(restored)
    assert st.st_size == TIB
    assert st.st_blocks * 512 <= 1 * MiB  # still sparse
    with open(restored, "rb") as f:
        for offset, data in ((0, b"head"), (TIB // 2, b"middle"), (TIB - 4, b"tail")):
            f.seek(offset)
            assert f.read(len(data)) == data
        f.seek(TIB // 4)
        assert f.read(4096) == bytes(4096)


def test_hard_links_are_kept_once_and_restored_as_links(tmp_path: Path, ws: Path) -> None:
    data = os.urandom(1 * MiB)
    write(ws / "one", data)
    os.link(ws / "one", ws / "two")
    (ws / "sub").mkdir()
    os.link(ws / "one", ws / "sub" / "three")
    write(ws / "alone", b"alone")
    assert os.stat(ws / "one").st_nlink == 3

    captured = snap(ws, tmp_path / "staging")
    assert (captured.files, captured.hard_links) == (2, 2)
    assert captured.bytes == len(data) + 5, "the data is counted once"
    assert captured.new_bytes < 2 * len(data)  # and stored once
    assert entry_at(captured.manifest, "two") == {**entry_at(captured.manifest, "two"),
                                                  "t": "h", "h": "one"}  # fmt: skip
    done = restore(tmp_path / "target", captured.manifest, packs(captured))
    assert (done.files, done.hard_links, done.bytes) == (2, 2, len(data) + 5)
    target = tmp_path / "target"
    inodes = {os.stat(target / name).st_ino for name in ("one", "two", "sub/three")}
    assert len(inodes) == 1 and os.stat(target / "one").st_nlink == 3
    assert (target / "sub" / "three").read_bytes() == data
    assert os.stat(target / "alone").st_nlink == 1

    # a second capture of the restored tree: the same links, nothing stored again
    again = snap(target, tmp_path / "staging2", known=captured.manifest["chunks"])
    assert (again.files, again.hard_links, again.new_bytes) == (2, 2, 0)


def test_a_file_linked_three_times_fits_a_bound_its_copies_would_not(
    tmp_path: Path, ws: Path
) -> None:
    """The reproduction's shape: a 21 MB file with two more links is 63 MB as separate files;
    kept as links it needs 21 MB on restore, which fits a bound of 30 MB."""
    data = os.urandom(21 * MiB)
    write(ws / "big", data)
    os.link(ws / "big", ws / "big2")
    os.link(ws / "big", ws / "big3")
    bound = Bounds(max_bytes=30 * MiB, max_entries=100)
    captured = snap(ws, tmp_path / "staging", bound)
    done = restore(tmp_path / "target", captured.manifest, packs(captured), bound)
    assert (done.files, done.hard_links) == (1, 2)
    assert os.stat(tmp_path / "target" / "big3").st_nlink == 3


def test_a_far_future_mtime_is_kept_and_restored(tmp_path: Path, ws: Path) -> None:
    """touch -d 2200-01-01 (ext4 holds times up to 2446): still a snapshot that restores."""
    year_2200 = 7_258_118_400 * 10**9
    write(ws / "future", b"x", mtime_ns=year_2200)
    captured = snap(ws, tmp_path / "staging")
    restore(tmp_path / "target", captured.manifest, packs(captured))
    assert os.stat(tmp_path / "target" / "future").st_mtime_ns == year_2200


def test_lost_and_found_and_partial_uploads_at_the_root_are_left_out(
    tmp_path: Path, ws: Path
) -> None:
    (ws / "lost+found").mkdir()
    write(ws / ".srt-upload-abc", b"partial")
    (ws / "sub").mkdir()
    (ws / "sub" / "lost+found").mkdir()
    captured = snap(ws, tmp_path / "staging")
    assert [e["p"] for e in captured.manifest["entries"]] == ["sub", "sub/lost+found"]


# -- what is not kept ------------------------------------------------------------------------


def test_fifo_socket_and_device_are_skipped_and_counted_without_blocking(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.mkfifo(ws / "fifo")
    (ws / "sub").mkdir()
    os.mkfifo(ws / "sub" / "fifo2")
    os.symlink("fifo", ws / "link-to-fifo")
    monkeypatch.chdir(ws)  # (a socket's path is short)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("sock")
    sock.listen(1)
    try:
        os.mknod(ws / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.mknod(ws / "blk", stat.S_IFBLK | 0o600, os.makedev(7, 0))
        devices = 2
    except PermissionError:
        devices = 0
    write(ws / "kept", b"kept")
    try:
        captured = bounded(lambda: snap(ws, tmp_path / "staging"), seconds=20)
    finally:
        unblock_fifo(ws / "fifo")
        unblock_fifo(ws / "sub" / "fifo2")
        sock.close()
    expected = {"fifo": 2, "socket": 1} | ({"device": devices} if devices else {})
    assert captured.skipped == expected
    kinds = {e["p"]: e["t"] for e in captured.manifest["entries"]}
    assert kinds == {"kept": "f", "link-to-fifo": "l", "sub": "d"}
    restore(tmp_path / "target", captured.manifest, packs(captured))
    assert sorted(os.listdir(tmp_path / "target")) == ["kept", "link-to-fifo", "sub"]
    assert os.listdir(tmp_path / "target" / "sub") == []
    if not devices:
        pytest.skip("device nodes cannot be made here (no CAP_MKNOD): FIFOs and sockets only")


# -- incremental -----------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def trust_fresh_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests capture right after writing: the rule that a file changed within the last
    50 ms is read again next time has a test of its own."""
    monkeypatch.setattr(capture_module, "RECENT_NS", 0)


def test_a_file_changed_just_before_a_capture_is_read_again_next_time(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture_module, "RECENT_NS", 10**12)  # (everything is recent)
    write(ws / "a", b"one")
    first = snap(ws, tmp_path / "s1")
    assert entry_at(first.manifest, "a")["sig"] == [0, 0, 0, -1]
    previous = stored(first.manifest)
    second = snap(ws, tmp_path / "s2", previous=previous, known=previous["chunks"])
    assert second.reused_files == 0, "a signature too recent to trust is never matched"
    assert second.new_bytes == 0, "its data, read again, is known"


def test_a_second_capture_reuses_unchanged_files_and_stores_only_changes(
    tmp_path: Path, ws: Path
) -> None:
    contents = {f"f{i:03}": os.urandom(64 * KiB) for i in range(200)}
    for name, data in contents.items():
        write(ws / name, data)
    first = snap(ws, tmp_path / "s1")
    assert first.reused_files == 0
    assert first.new_bytes >= 200 * 64 * KiB

    contents["f007"] = os.urandom(64 * KiB)
    write(ws / "f007", contents["f007"])
    contents["new"] = os.urandom(10 * KiB)
    write(ws / "new", contents["new"])
    os.chmod(ws / "f100", 0o600)  # (its metadata changed: read again, no new data)
    previous = stored(first.manifest)
    second = snap(ws, tmp_path / "s2", previous=previous, known=previous["chunks"])
    assert second.reused_files == 198
    assert second.files == 201
    assert 74 * KiB <= second.new_bytes <= 80 * KiB
    assert sum(path.stat().st_size for _, path in second.packs) == second.new_bytes
    assert entry_at(second.manifest, "f100")["m"] == 0o600

    # the second manifest names chunks in the first capture's packs too
    assert set(packs_of(stored(second.manifest), BIG)) >= {p for p, _ in first.packs}
    restore(tmp_path / "target", second.manifest, packs(first, second))
    target = tmp_path / "target"
    for name, data in contents.items():
        assert (target / name).read_bytes() == data
    assert stat.S_IMODE(os.stat(target / "f100").st_mode) == 0o600

    previous = stored(second.manifest)
    third = snap(ws, tmp_path / "s3", previous=previous, known=previous["chunks"])
    assert (third.reused_files, third.new_bytes, third.packs) == (201, 0, [])


def test_a_file_rewritten_just_after_a_capture_is_read_again(tmp_path: Path, ws: Path) -> None:
    """Same size, same inode, rewritten right after the capture saw it: never reused stale."""
    for round_ in range(20):
        write(ws / "f", b"A" * 100)
        first = snap(ws, tmp_path / f"a{round_}")
        with open(ws / "f", "r+b") as f:
            f.write(b"B" * 100)
        second = snap(ws, tmp_path / f"b{round_}", previous=first.manifest,
                      known=first.manifest["chunks"])  # fmt: skip
        assert second.reused_files == 0
        target = tmp_path / f"t{round_}"
        restore(target, second.manifest, packs(first, second))
        assert (target / "f").read_bytes() == b"B" * 100


# -- bounds ----------------------------------------------------------------------------------


def test_capture_over_its_bounds_is_refused(tmp_path: Path, ws: Path) -> None:
    """Bounds count what a restore allocates: data in 4 KiB blocks, a block per directory
    and per symlink too long for its inode (a short one costs nothing)."""
    for i in range(3):
        write(ws / f"f{i}", bytes([i + 1]) * 1000)
    (ws / "d").mkdir()
    os.symlink("f0", ws / "d" / "l")
    needed = 3 * BLOCK + BLOCK  # three files of one block each, one directory
    assert snap(ws, tmp_path / "ok", Bounds(max_bytes=needed, max_entries=5)).files == 3
    with pytest.raises(CaptureError, match=rf"more than its {needed - 1} usable bytes"):
        snap(ws, tmp_path / "s1", Bounds(max_bytes=needed - 1, max_entries=100))
    with pytest.raises(CaptureError, match="more than 4 entries"):
        snap(ws, tmp_path / "s2", Bounds(max_bytes=1 << 30, max_entries=4))
    # a sparse file counts what it holds, not its size
    with open(ws / "sparse", "wb") as f:
        f.truncate(100 * MiB)
    assert snap(ws, tmp_path / "s3", Bounds(max_bytes=needed, max_entries=6)).bytes == 3000
    os.symlink("x" * 100, ws / "long")  # (a block of its own)
    with pytest.raises(CaptureError, match="usable bytes"):
        snap(ws, tmp_path / "s4", Bounds(max_bytes=needed, max_entries=10))


def test_apply_refuses_a_manifest_over_its_bounds_before_writing(tmp_path: Path, ws: Path) -> None:
    for i in range(3):
        write(ws / f"f{i}", os.urandom(1000))
    captured = snap(ws, tmp_path / "staging")
    for n, bounds in enumerate((Bounds(3 * BLOCK - 1, 100), Bounds(1 << 30, 2))):
        target = tmp_path / f"target{n}"
        with pytest.raises(ManifestError, match="more than the workspace"):
            restore(target, captured.manifest, packs(captured), bounds)
        assert os.listdir(target) == []
    restore(tmp_path / "fits", captured.manifest, packs(captured), Bounds(3 * BLOCK, 3))


# -- hostile manifests -----------------------------------------------------------------------


class Hostile:
    """A real manifest to edit (d/, d/f, top, big) and its packs; `refused` checks that apply
    refuses an edited one and writes nothing, in the target or outside it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        ws = tmp_path / "ws"
        ws.mkdir()
        (ws / "d").mkdir()
        write(ws / "d" / "f", b"hello")
        write(ws / "top", os.urandom(100))
        write(ws / "big", b"compressible " * 100_000)
        self.captured = snap(ws, tmp_path / "staging")
        self.manifest = stored(self.captured.manifest)
        self.packs = packs(self.captured)
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        self._n = 0

    def edit(self) -> dict[str, Any]:
        return copy.deepcopy(self.manifest)

    def entry(self, manifest: dict[str, Any], path: str) -> dict[str, Any]:
        return entry_at(manifest, path)

    def target(self) -> Path:
        self._n += 1
        target = self.tmp / f"target{self._n}"
        target.mkdir()
        return target

    def apply(self, manifest: Any, pack_path: Callable[[str], Path] | None = None) -> Path:
        target = self.target()
        apply(target, manifest, BIG, pack_path or self.packs.__getitem__, None)
        return target

    def refused(self, manifest: Any, match: str | None = None) -> None:
        target = self.target()
        with pytest.raises(ManifestError, match=match):
            apply(target, manifest, BIG, self.packs.__getitem__, None)
        assert os.listdir(target) == []
        assert os.listdir(self.outside) == []
        assert not (self.tmp / "x").exists()


@pytest.fixture
def hostile(tmp_path: Path) -> Hostile:
    return Hostile(tmp_path)


def set_path(entry: dict[str, Any], text: str | None = None, raw: bytes | None = None) -> None:
    entry.pop("p", None)
    entry.pop("pb", None)
    if raw is not None:
        entry["pb"] = base64.b64encode(raw).decode()
    else:
        entry["p"] = text


def test_hostile_base_manifest_applies(hostile: Hostile) -> None:
    target = hostile.apply(hostile.edit())
    assert (target / "d" / "f").read_bytes() == b"hello"


def test_restored_entries_belong_to_the_owner_given(hostile: Hostile) -> None:
    manifest = hostile.edit()
    manifest["entries"].append({"t": "l", "p": "d/link", "m": 0o777, "mt": 0, "l": "/etc"})
    target = hostile.target()
    apply(target, manifest, BIG, hostile.packs.__getitem__, (65534, 65533))
    for name in ("d", "d/f", "top", "big", "d/link"):
        st = os.lstat(target / name)
        assert (st.st_uid, st.st_gid) == (65534, 65533), name
    assert os.stat("/etc").st_uid == 0  # (the link's target untouched)


def test_extreme_mtimes_in_range_are_restored_without_error(hostile: Hostile) -> None:
    manifest = hostile.edit()
    hostile.entry(manifest, "top")["mt"] = (1 << 63) - 1
    hostile.entry(manifest, "d/f")["mt"] = -(1 << 63)
    hostile.entry(manifest, "d")["mt"] = 0
    target = hostile.apply(manifest)  # (the filesystem clamps them to what it holds)
    assert os.stat(target / "top").st_mtime_ns > 0
    assert os.stat(target / "d" / "f").st_mtime_ns < 0
    assert os.stat(target / "d").st_mtime_ns == 0


BAD_PATHS = [
    "..",
    "../x",
    "../outside/x",
    "d/../../outside/x",
    ".",
    "./x",
    "d/./f2",
    "d//f2",
    "d/",
    "/x",
    "{outside}/x",
    "",
    "a\0b",
    "n" * 256,
    "d/" * 2100 + "x",
]


@pytest.mark.parametrize("path", BAD_PATHS, ids=repr)
@pytest.mark.parametrize("kind", ["top", "d"])
def test_hostile_paths_are_refused(hostile: Hostile, path: str, kind: str) -> None:
    manifest = hostile.edit()
    entry = hostile.entry(manifest, kind)
    if kind == "d":  # (the directory moved last, so its path is the only thing wrong)
        manifest["entries"] = [e for e in manifest["entries"] if e.get("p") not in ("d", "d/f")]
        manifest["entries"].append(entry)
    set_path(entry, path.replace("{outside}", str(hostile.outside)))
    hostile.refused(manifest, "unacceptable path|listed before")


@pytest.mark.parametrize(
    "raw", [b"../outside/x", b"/x", b"a\0b", b"d/../../x", b"", b"d//f2", b"\xff/.."], ids=repr
)
def test_hostile_raw_paths_are_refused(hostile: Hostile, raw: bytes) -> None:
    manifest = hostile.edit()
    set_path(hostile.entry(manifest, "top"), raw=raw)
    hostile.refused(manifest, "unacceptable path")


def test_a_path_not_base64_or_not_text_is_refused(hostile: Hostile) -> None:
    for value in ({"pb": "not base64!"}, {"p": 7}, {"pb": 7}, {}):
        manifest = hostile.edit()
        entry = hostile.entry(manifest, "top")
        set_path(entry, "top")
        del entry["p"]
        entry.update(value)
        hostile.refused(manifest)


@pytest.mark.parametrize("target", ["{outside}", "../outside", "/tmp", "d"])
def test_nothing_is_made_through_a_symlink_entry(hostile: Hostile, target: str) -> None:
    manifest = hostile.edit()
    top = hostile.entry(manifest, "top")
    link = {"t": "l", "p": "a", "m": 0o777, "mt": 0, "l": target.format(outside=hostile.outside)}
    for child in (
        {**top, "p": "a/x"},
        {"t": "d", "p": "a/sub", "m": 0o755, "mt": 0},
        {"t": "l", "p": "a/l", "m": 0o777, "mt": 0, "l": "/etc/shadow"},
    ):
        edited = hostile.edit()
        edited["entries"] += [link, child]
        hostile.refused(edited, "listed before its directory")
    # the same, one level down: d/a a link, then d/a/x
    edited = hostile.edit()
    edited["entries"] += [{**link, "p": "d/a"}, {**top, "p": "d/a/x"}]
    hostile.refused(edited, "listed before its directory")
    # and a link alone is made as a link, its target untouched
    made = hostile.edit()
    made["entries"].append(link)
    root = hostile.apply(made)
    assert os.readlink(root / "a") == link["l"]
    assert os.listdir(hostile.outside) == []


def test_entries_out_of_order_and_duplicates_are_refused(hostile: Hostile) -> None:
    manifest = hostile.edit()
    d = hostile.entry(manifest, "d")
    f = hostile.entry(manifest, "d/f")
    top = hostile.entry(manifest, "top")
    rest = [e for e in manifest["entries"] if e not in (d, f)]
    cases = {
        "child first": [f, d, *rest],
        "file twice": [d, f, *rest, top],
        "dir twice": [d, d, f, *rest],
        "dir then file": [d, f, *rest, {**top, "p": "d"}],
        "link over dir": [d, f, *rest, {"t": "l", "p": "d", "m": 0o777, "mt": 0, "l": "x"}],
        "file as parent": [d, f, *rest, {**top, "p": "top/x"}],
        "same bytes twice": [d, f, *rest, {**{k: v for k, v in top.items() if k != "p"},
                                           "pb": base64.b64encode(b"top").decode()}],
    }  # fmt: skip
    for entries in cases.values():
        edited = hostile.edit()
        edited["entries"] = copy.deepcopy(entries)
        hostile.refused(edited, "listed twice|listed before")


@pytest.mark.parametrize("kind", ["c", "b", "p", "s", "h", "", None, 1, "D", "ff"])
def test_other_entry_types_are_refused(hostile: Hostile, kind: Any) -> None:
    manifest = hostile.edit()
    hostile.entry(manifest, "top")["t"] = kind
    hostile.refused(manifest, "type|malformed")


def test_a_hard_link_is_made_only_to_a_file_listed_before_it(hostile: Hostile) -> None:
    def with_link(to: dict[str, str], at: int | None = None) -> dict[str, Any]:
        manifest = hostile.edit()
        link = {"t": "h", "p": "d/linked", "m": 0o644, "mt": 0, **to}
        entries = manifest["entries"]
        entries.insert(len(entries) if at is None else at, link)
        return manifest

    root = hostile.apply(with_link({"h": "d/f"}))
    assert os.stat(root / "d" / "linked").st_ino == os.stat(root / "d" / "f").st_ino
    assert (root / "d" / "linked").read_bytes() == b"hello"
    refused = {  # (what each is)
        "a directory": {"h": "d"},
        "nothing listed": {"h": "d/nothing"},
        "outside": {"h": "../outside/x"},
        "absolute": {"h": "/etc/passwd"},
        "empty": {"h": ""},
        "not base64": {"hb": "%%%"},
        "not text": {"h": 5},
    }
    for to in refused.values():
        hostile.refused(with_link(to), "hard link|unacceptable|base64|not a string")
    paths = [e.get("p") for e in hostile.manifest["entries"]]
    manifest = with_link({"h": "top"}, at=paths.index("top"))  # (before top is made)
    hostile.refused(manifest, "not listed before it")
    symlinked = hostile.edit()
    symlinked["entries"].append({"t": "l", "p": "d/sl", "m": 0o777, "mt": 0, "l": "/etc"})
    symlinked["entries"].append({"t": "h", "p": "d/via", "m": 0o644, "mt": 0, "h": "d/sl"})
    hostile.refused(symlinked, "not listed before it")


def test_setuid_setgid_and_sticky_bits_are_not_restored(hostile: Hostile) -> None:
    manifest = hostile.edit()
    hostile.entry(manifest, "top")["m"] = 0o4755
    hostile.entry(manifest, "d")["m"] = 0o2775
    hostile.entry(manifest, "d/f")["m"] = 0o7777
    manifest["entries"].append({"t": "d", "p": "tmp", "m": 0o1777, "mt": 0})
    root = hostile.apply(manifest)
    assert stat.S_IMODE(os.stat(root / "top").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(root / "d").st_mode) == 0o775
    assert stat.S_IMODE(os.stat(root / "d" / "f").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(root / "tmp").st_mode) == 0o777


@pytest.mark.parametrize(
    ("field", "value"),
    [("m", 0o100644), ("m", -1), ("m", "0644"), ("m", True), ("mt", "now"), ("mt", 1 << 64),
     ("mt", None), ("s", -1), ("s", 1 << 45), ("s", 1.5), ("s", True)],
)  # fmt: skip
def test_out_of_range_fields_are_refused(hostile: Hostile, field: str, value: Any) -> None:
    manifest = hostile.edit()
    hostile.entry(manifest, "top")[field] = value
    hostile.refused(manifest, "out of range|outside the file")


def test_bad_symlink_targets_are_refused(hostile: Hostile) -> None:
    for target in ({"l": ""}, {"l": "a\0b"}, {"l": "x" * 4097}, {"lb": "!!"}, {}, {"l": 1}):
        manifest = hostile.edit()
        manifest["entries"].append({"t": "l", "p": "link", "m": 0o777, "mt": 0, **target})
        hostile.refused(manifest)


def test_malformed_manifests_are_refused(hostile: Hostile) -> None:
    for broken in (
        None,
        [],
        "manifest",
        {**hostile.edit(), "format": "srt-snapshot/2"},
        {k: v for k, v in hostile.edit().items() if k != "entries"},
        {**hostile.edit(), "chunks": []},
        {**hostile.edit(), "entries": {}},
        {**hostile.edit(), "entries": [["t", "f"]]},
    ):
        hostile.refused(broken)


def _one_extent(manifest: dict[str, Any], path: str) -> tuple[dict[str, Any], list[Any]]:
    entry = entry_at(manifest, path)
    assert len(entry["x"]) == 1
    return entry, entry["x"][0]


@pytest.mark.parametrize(
    "case",
    ["overlap", "past end", "negative", "before previous", "unknown chunk", "wrong length",
     "zero length", "not a list", "short item", "string offset", "size shrunk"],
)  # fmt: skip
def test_bad_extents_are_refused(hostile: Hostile, case: str) -> None:
    manifest = hostile.edit()
    entry, (offset, length, name) = _one_extent(manifest, "top")
    assert (offset, length) == (0, 100)
    x: Any = {
        "overlap": [[0, 100, name], [50, 100, name]],
        "past end": [[1, 100, name]],
        "negative": [[-1, 100, name]],
        "before previous": [[200, 100, name], [0, 100, name]],
        "unknown chunk": [[0, 100, "0" * 64]],
        "wrong length": [[0, 50, name]],
        "zero length": [[0, 0, name]],
        "not a list": {"0": [0, 100, name]},
        "short item": [[0, 100]],
        "string offset": [["0", 100, name]],
        "size shrunk": [[0, 100, name]],
    }[case]
    entry["x"] = x
    if case in ("overlap", "before previous"):
        entry["s"] = 300
    if case == "size shrunk":
        entry["s"] = 99
    hostile.refused(manifest, "extent|chunk")


@pytest.mark.parametrize(
    "ref",
    [["../../../etc/passwd", 0, 10, 10, 0], ["A" * 32, 0, 10, 10, 0], [None, 0, 10, 10, 0],
     ["{pack}", -1, 10, 10, 0], ["{pack}", 0, 0, 10, 0], ["{pack}", 0, 10, 0, 0],
     ["{pack}", 0, 10, CHUNK + 1, 0], ["{pack}", 0, CHUNK + 65 * KiB, 10, 1],
     ["{pack}", 0, 10, 10, 2], ["{pack}", True, 10, 10, 0], ["{pack}", 0, 10, 10],
     "ref", ["{pack}", 1 << 40, 10, 10, 0]],
)  # fmt: skip
def test_malformed_chunk_references_are_refused(hostile: Hostile, ref: Any) -> None:
    manifest = hostile.edit()
    _, (_, _, name) = _one_extent(manifest, "top")
    pack = manifest["chunks"][name][0]
    if isinstance(ref, list):
        ref = [pack if v == "{pack}" else v for v in ref]
    manifest["chunks"][name] = ref
    hostile.refused(manifest, "chunk reference")
    bad_name = hostile.edit()
    bad_name["chunks"]["NOT-A-HASH"] = bad_name["chunks"][name]
    hostile.refused(bad_name, "chunk reference")


@pytest.mark.parametrize("path", ["top", "big"])
def test_a_corrupted_chunk_is_refused(hostile: Hostile, path: str) -> None:
    manifest = hostile.edit()
    _, (_, _, name) = _one_extent(manifest, path)
    pack, offset, stored_length, _, compressed = manifest["chunks"][name]
    assert compressed == (path == "big")
    with open(hostile.packs[pack], "r+b") as f:
        f.seek(offset + stored_length // 2)
        byte = f.read(1)
        f.seek(offset + stored_length // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    target = hostile.target()
    with pytest.raises(ManifestError, match=r"checksum|decompress"):
        apply(target, manifest, BIG, hostile.packs.__getitem__, None)
    assert not (target / path).exists() or (target / path).stat().st_size == 0


def test_a_truncated_pack_is_refused(hostile: Hostile) -> None:
    manifest = hostile.edit()
    _, (_, _, name) = _one_extent(manifest, "big")
    pack, offset, stored_length, _, _ = manifest["chunks"][name]
    os.truncate(hostile.packs[pack], offset + stored_length - 1)
    with pytest.raises(ManifestError, match="shorter"):
        hostile.apply(manifest)


def _bomb(hostile: Hostile, raw: bytes, claimed: int, name: bytes) -> dict[str, Any]:
    """A manifest whose one file is one compressed chunk of `raw`, said to be `claimed`
    bytes of content hashing to sha256(name)."""
    packed = zlib.compress(raw, 9)
    pack = "b" * 32
    path = hostile.tmp / "bomb-pack"
    path.write_bytes(packed)
    hostile.packs[pack] = path
    chunk = hashlib.sha256(name).hexdigest()
    return {
        "format": hostile.manifest["format"],
        "entries": [{"t": "f", "p": "bomb", "m": 0o644, "mt": 0, "s": claimed,
                     "x": [[0, claimed, chunk]]}],
        "chunks": {chunk: [pack, 0, len(packed), claimed, 1]},
    }  # fmt: skip


def test_a_decompression_bomb_is_refused(hostile: Hostile) -> None:
    # 64 MiB of zeros said to be a 4 MiB chunk (whose hash is that of its first 4 MiB)
    manifest = _bomb(hostile, bytes(64 * MiB), CHUNK, bytes(CHUNK))
    validate(manifest, BIG)
    with pytest.raises(ManifestError, match="checksum"):
        hostile.apply(manifest)
    # and one that inflates to less than it says
    manifest = _bomb(hostile, bytes(CHUNK - 1), CHUNK, bytes(CHUNK))
    with pytest.raises(ManifestError, match="checksum"):
        hostile.apply(manifest)
    # the honest one is restored
    manifest = _bomb(hostile, bytes(CHUNK), CHUNK, bytes(CHUNK))
    root = hostile.apply(manifest)
    assert (root / "bomb").read_bytes() == bytes(CHUNK)


def test_a_missing_pack_is_a_clear_error(hostile: Hostile) -> None:
    def missing(pack: str) -> Path:
        raise FileNotFoundError(f"pack {pack} is not here")

    with pytest.raises((ManifestError, FileNotFoundError), match="pack"):
        hostile.apply(hostile.edit(), missing)
    with pytest.raises((ManifestError, FileNotFoundError)):
        hostile.apply(hostile.edit(), lambda pack: hostile.tmp / "no-such-pack")


def test_packs_of_names_only_the_packs_in_use(hostile: Hostile) -> None:
    assert packs_of(hostile.edit(), BIG) == set(hostile.packs)
    manifest = hostile.edit()
    manifest["chunks"]["f" * 64] = ["c" * 32, 0, 10, 10, 0]  # (listed, used by no file)
    assert packs_of(manifest, BIG) == set(hostile.packs)
