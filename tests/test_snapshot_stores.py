"""Snapshot stores behind one protocol: DirectoryStore on a real directory and S3Store against
a real S3 server (moto's, started here as a process on a free port), put through the same
tests; then a capture uploaded to each, fetched back with local() and applied."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox_runtime.snapshots import capture as capture_module
from sandbox_runtime.snapshots.apply import apply, packs_of
from sandbox_runtime.snapshots.capture import capture
from sandbox_runtime.snapshots.manifest import Bounds, ManifestError
from sandbox_runtime.snapshots.stores import (
    KEY,
    TEMP_PREFIX,
    DirectoryStore,
    ObjectMissingError,
    ObjectStore,
    S3Store,
    StoreUnavailableError,
)

# The directory store's tests are unit tests; the S3 store's talk HTTP to a server (moto's, a
# process, or a socket that never answers): integration, out of the `-m unit` loop.
UNIT, INTEGRATION = pytest.mark.unit, pytest.mark.integration

TIMEOUT = 3.0
BIG = Bounds(max_bytes=1 << 34, max_entries=100_000)
MiB = 1024 * 1024
PACK_MAX = 64 * MiB


# -- a real S3 server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """`python -m moto.server` on a free port of 127.0.0.1, until stopped."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # (closed in stop)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NO_PROXY": "*"},
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                    break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def create_bucket(self, bucket: str) -> None:
        request = urllib.request.Request(f"{self.endpoint}/{bucket}", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    server = Moto(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)


def s3_store(endpoint: str, bucket: str, prefix: str = "prefix") -> S3Store:
    url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return S3Store(url, endpoint=endpoint, region="us-east-1", timeout=TIMEOUT)


@pytest.fixture(
    params=[pytest.param("directory", marks=UNIT), pytest.param("s3", marks=INTEGRATION)]
)
def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> ObjectStore:
    if request.param == "directory":
        return DirectoryStore(tmp_path / "store", timeout=TIMEOUT)
    server: Moto = request.getfixturevalue("moto")
    s3_env(monkeypatch)
    bucket = f"snapshots-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    return s3_store(server.endpoint, bucket)


# -- the protocol, on both -------------------------------------------------------------------


async def test_put_get_list_delete(store: ObjectStore) -> None:
    await store.put("v1/p/meta/a.json", b"1")
    await store.put("v1/p/meta/b.json", b"22")
    await store.put("v1/p/other/c", b"333")
    assert await store.get("v1/p/meta/a.json", 10) == b"1"
    assert await store.get("v1/p/meta/b.json", 2) == b"22"  # (exactly its bound)
    listed = await store.list("v1/p/meta")
    assert sorted((o.key, o.size) for o in listed) == [
        ("v1/p/meta/a.json", 1),
        ("v1/p/meta/b.json", 2),
    ]
    assert all(abs(o.modified - time.time()) < 300 for o in listed)
    assert sorted(o.key for o in await store.list("v1/p/meta/")) == [o.key for o in listed]
    assert await store.list("v1/p/none") == []
    assert await store.list("v1/p/met") == []  # (a prefix is a whole component)

    await store.put("v1/p/meta/a.json", b"replaced")  # (a put replaces)
    assert await store.get("v1/p/meta/a.json", 10) == b"replaced"

    await store.delete("v1/p/meta/a.json")
    assert [o.key for o in await store.list("v1/p/meta")] == ["v1/p/meta/b.json"]
    with pytest.raises(ObjectMissingError):
        await store.get("v1/p/meta/a.json", 10)
    await store.delete("v1/p/meta/a.json")  # (deleting what is not there: no error)
    await store.delete("v1/never/was")
    assert await store.get("v1/p/other/c", 10) == b"333"


async def test_empty_and_binary_objects(store: ObjectStore) -> None:
    data = bytes(range(256)) * 1000
    await store.put("k/bin", data)
    await store.put("k/empty", b"")
    assert await store.get("k/bin", len(data)) == data
    assert await store.get("k/empty", 0) == b""


async def test_put_file_stores_a_staging_file(store: ObjectStore, tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    data = os.urandom(3 * MiB + 17)
    source = staging / "pack"
    source.write_bytes(data)
    await store.put_file("v1/p/packs/0123", source)
    assert not source.exists()  # (moved, or uploaded and removed)
    assert await store.get("v1/p/packs/0123", len(data)) == data
    assert [(o.key, o.size) for o in await store.list("v1/p/packs")] == [
        ("v1/p/packs/0123", len(data))
    ]


async def test_local_gives_a_file_holding_the_object(store: ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(1 * MiB)
    await store.put("v1/p/packs/abc", data)
    staging = tmp_path / "fetch"
    path = await store.local("v1/p/packs/abc", staging, len(data))
    assert await asyncio.to_thread(path.read_bytes) == data
    fd = os.open(path, os.O_RDONLY)  # (read by offset, as apply does)
    try:
        assert os.pread(fd, 10, 1000) == data[1000:1010]
    finally:
        os.close(fd)
    if isinstance(store, S3Store):
        assert path.parent == staging


async def test_objects_over_their_bound_are_refused(store: ObjectStore, tmp_path: Path) -> None:
    await store.put("v1/p/manifests/big", b"x" * 1001)
    with pytest.raises(ObjectMissingError, match="larger"):
        await store.get("v1/p/manifests/big", 1000)
    with pytest.raises(ObjectMissingError, match="larger"):
        await store.local("v1/p/manifests/big", tmp_path / "fetch", 1000)
    assert await store.get("v1/p/manifests/big", 1001) == b"x" * 1001


async def test_a_missing_object_is_object_missing(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectMissingError):
        await store.get("v1/p/meta/nothing.json", 100)
    with pytest.raises(ObjectMissingError):
        await store.local("v1/p/packs/nothing", tmp_path / "fetch", 100)


BAD_KEYS = [
    "",
    "/abs",
    "../x",
    "a/../b",
    "a/./b",
    "a//b",
    "a/",
    ".hidden",
    f"a/{TEMP_PREFIX}1",
    "a b",
    "a\0b",
    "a\nb",
    "a\\b",
    "caf\u00e9",
    "/".join(["a"] * 9),
    "x" * 129,
]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
async def test_invalid_keys_are_rejected(store: ObjectStore, tmp_path: Path, key: str) -> None:
    source = tmp_path / "source"
    source.write_bytes(b"data")
    with pytest.raises(ValueError, match="invalid object key"):
        await store.put(key, b"data")
    with pytest.raises(ValueError, match="invalid object key"):
        await store.put_file(key, source)
    with pytest.raises(ValueError, match="invalid object key"):
        await store.get(key, 100)
    with pytest.raises(ValueError, match="invalid object key"):
        await store.local(key, tmp_path / "fetch", 100)
    with pytest.raises(ValueError, match="invalid object key"):
        await store.delete(key)
    if not KEY.fullmatch(key.rstrip("/")):  # (a listing's prefix may end in "/")
        with pytest.raises(ValueError, match="invalid object key"):
            await store.list(key)
    assert not (tmp_path.parent / "x").exists()
    assert not (tmp_path / "b").exists()


async def test_a_put_is_seen_whole_or_not_at_all(store: ObjectStore) -> None:
    """Readers while an object is replaced over and over see one whole version, never a mix
    or a part; a listing never shows a partial object."""
    versions = [bytes([v]) * (2 * MiB) for v in b"AB"]
    await store.put("v1/p/latest/x", versions[0])
    stop = asyncio.Event()

    async def writer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            await store.put("v1/p/latest/x", versions[n % 2])
            await store.put(f"v1/p/latest/y{n % 3}", versions[n % 2])

    task = asyncio.create_task(writer())
    try:
        seen = set()
        for _ in range(30):
            data = await store.get("v1/p/latest/x", 4 * MiB)
            assert data in versions
            seen.add(data[:1])
            for info in await store.list("v1/p/latest"):
                assert info.size == 2 * MiB
                assert not info.key.rsplit("/", 1)[1].startswith(TEMP_PREFIX)
    finally:
        stop.set()
        await task
    assert seen


@INTEGRATION
async def test_two_prefixes_of_one_bucket_do_not_see_each_other(
    moto: Moto, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env(monkeypatch)
    bucket = f"shared-{uuid.uuid4().hex[:12]}"
    moto.create_bucket(bucket)
    one, two, whole = (s3_store(moto.endpoint, bucket, p) for p in ("one", "two/deeper", ""))
    await one.put("k/a", b"1")
    await two.put("k/a", b"2")
    assert await one.get("k/a", 10) == b"1"
    assert await two.get("k/a", 10) == b"2"
    assert [o.key for o in await one.list("k")] == ["k/a"]
    assert [o.key for o in await two.list("k")] == ["k/a"]
    assert sorted(o.key for o in await whole.list("one")) == ["one/k/a"]
    assert sorted(o.key for o in await whole.list("two")) == ["two/deeper/k/a"]
    await one.delete("k/a")
    assert await two.get("k/a", 10) == b"2"


# -- the directory store's own ---------------------------------------------------------------


@UNIT
async def test_directory_store_leaves_no_temp_files_in_sight(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "store", timeout=TIMEOUT)
    await store.put("v1/p/meta/a.json", b"{}")
    source = tmp_path / "pack"
    source.write_bytes(b"pack data")
    await store.put_file("v1/p/meta/b", source)
    # what a put cut off by a crash leaves: a temp file, never listed, never a key
    stray = tmp_path / "store" / "v1" / "p" / "meta" / f"{TEMP_PREFIX}0123456789abcdef"
    stray.write_bytes(b"partial")
    os.mkdir(tmp_path / "store" / "v1" / "p" / "meta" / "subdir")
    assert sorted(o.key for o in await store.list("v1/p/meta")) == [
        "v1/p/meta/a.json",
        "v1/p/meta/b",
    ]
    with pytest.raises(ValueError):
        await store.get(f"v1/p/meta/{stray.name}", 100)
    names = sorted(os.listdir(tmp_path / "store" / "v1" / "p" / "meta"))
    assert names == sorted(["a.json", "b", "subdir", stray.name])  # (no temp file of its own)
    st = os.stat(tmp_path / "store" / "v1" / "p" / "meta" / "a.json")
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "store").st_mode) == 0o700


def _other_filesystem(than: Path) -> Path | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != than.stat().st_dev:
        return shm
    return None


@UNIT
async def test_directory_store_put_file_across_filesystems(tmp_path: Path) -> None:
    shm = _other_filesystem(tmp_path)
    if shm is None:
        pytest.skip("no second filesystem to copy from")
    store = DirectoryStore(tmp_path / "store", timeout=TIMEOUT)
    source = shm / f"srt-snapshot-test-{uuid.uuid4().hex}"
    source.write_bytes(b"from another filesystem")
    try:
        await store.put_file("v1/p/packs/x", source)
        assert await store.get("v1/p/packs/x", 100) == b"from another filesystem"
        assert [o.key for o in await store.list("v1/p/packs")] == ["v1/p/packs/x"]
    finally:
        source.unlink(missing_ok=True)


@UNIT
async def test_directory_store_that_cannot_be_used_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_bytes(b"")
    store = DirectoryStore(tmp_path / "not-a-dir", timeout=TIMEOUT)
    with pytest.raises(StoreUnavailableError, match=r"snapshot store \(directory\) failed"):
        await store.put("v1/p/meta/a", b"x")
    with pytest.raises(StoreUnavailableError):
        await store.get("v1/p/meta/a", 10)


@UNIT
async def test_directory_store_that_does_not_answer_times_out(tmp_path: Path) -> None:
    """A read that blocks (a hung network filesystem; here a FIFO where an object should be)
    ends as StoreUnavailableError after the store's timeout."""
    store = DirectoryStore(tmp_path / "store", timeout=1.0)
    await store.put("v1/p/meta/ok", b"x")
    fifo = tmp_path / "store" / "v1" / "p" / "meta" / "hung"
    os.mkfifo(fifo)
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError, match="TimeoutError"):
            await store.get("v1/p/meta/hung", 10)
        assert time.monotonic() - started < 1.0 + 2.0
    finally:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # (releases the blocked thread)
        os.close(fd)


# -- an S3 store that is down ----------------------------------------------------------------


async def _all_unavailable(store: S3Store, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.write_bytes(b"x")
    calls: list[Any] = [
        lambda: store.put("v1/p/meta/a", b"x"),
        lambda: store.put_file("v1/p/packs/a", source),
        lambda: store.get("v1/p/meta/a", 10),
        lambda: store.local("v1/p/packs/a", tmp_path / "fetch", 10),
        lambda: store.list("v1/p/meta"),
        lambda: store.delete("v1/p/meta/a"),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=r"snapshot store \(S3\) failed") as raised:
            await call()
        said = str(raised.value)
        # what callers are shown names no endpoint, bucket, prefix or key (the log has them)
        for secret in ("127.0.0.1", "http", "going", "nobody", "prefix", "v1/p", "meta/a"):
            assert secret not in said, said
        elapsed = time.monotonic() - started
        assert elapsed < TIMEOUT + 2.0, f"{elapsed:.1f} s: longer than the store's timeout"


@INTEGRATION
async def test_s3_store_down_is_unavailable_within_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env(monkeypatch)
    server = Moto(tmp_path / "moto.log")
    try:
        server.create_bucket("going")
        store = s3_store(server.endpoint, "going")
        await store.put("v1/p/meta/a", b"x")
        assert await store.get("v1/p/meta/a", 10) == b"x"
    finally:
        server.stop()
    await _all_unavailable(store, tmp_path)


@INTEGRATION
async def test_s3_store_on_a_closed_port_is_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env(monkeypatch)
    await _all_unavailable(s3_store(f"http://127.0.0.1:{free_port()}", "nobody"), tmp_path)


@INTEGRATION
async def test_s3_store_that_never_answers_times_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that takes the connection and says nothing: each call ends at the timeout."""
    s3_env(monkeypatch)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        port = silent.getsockname()[1]
        store = s3_store(f"http://127.0.0.1:{port}", "silent")
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await store.get("v1/p/meta/a", 10)
        assert TIMEOUT - 0.5 <= time.monotonic() - started < TIMEOUT + 2.0
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await store.put("v1/p/meta/a", b"x")
        assert time.monotonic() - started < TIMEOUT + 2.0
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        silent.close()


# -- a snapshot through each store -----------------------------------------------------------


def _tree(root: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            rel = os.path.relpath(full, root)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("l", os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("d", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                found[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_size, digest)
    return found


def _workspace(root: Path) -> None:
    root.mkdir()
    (root / "src").mkdir()
    (root / "src" / "main.py").write_text("print('hello')\n" * 1000)
    (root / "data.bin").write_bytes(os.urandom(6 * MiB))  # (two chunks: two packs, below)
    (root / "empty").mkdir()
    os.symlink("src/main.py", root / "link")
    with open(root / "sparse", "wb") as f:
        f.truncate(64 * MiB)
        f.seek(32 * MiB)
        f.write(b"middle")


@pytest.fixture(autouse=True)
def small_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packs of 1 MiB (not 16): a small workspace's capture makes several."""
    monkeypatch.setattr(capture_module, "PACK_TARGET", 1 * MiB)


async def _upload(store: ObjectStore, root: Path, staging: Path) -> dict[str, Any]:
    captured = capture(root, staging, BIG, None, {})
    assert len(captured.packs) >= 2
    for pack, path in captured.packs:
        await store.put_file(f"v1/p/packs/{pack}", path)
        assert not path.exists()
    body = json.dumps(captured.manifest).encode()
    await store.put("v1/p/manifests/snap", body)
    return json.loads(await store.get("v1/p/manifests/snap", len(body)))


async def _fetch(store: ObjectStore, manifest: dict[str, Any], staging: Path) -> dict[str, Path]:
    return {
        pack: await store.local(f"v1/p/packs/{pack}", staging, PACK_MAX)
        for pack in packs_of(manifest, BIG)
    }


async def test_a_snapshot_round_trips_through_the_store(store: ObjectStore, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    _workspace(ws)
    manifest = await _upload(store, ws, tmp_path / "staging")
    assert sorted(o.key.rsplit("/", 1)[1] for o in await store.list("v1/p/packs")) == sorted(
        packs_of(manifest, BIG)
    )
    local = await _fetch(store, manifest, tmp_path / "fetch")
    target = tmp_path / "target"
    target.mkdir()
    done = await asyncio.to_thread(apply, target, manifest, BIG, local.__getitem__, None)
    assert done.files == 3
    assert _tree(target) == _tree(ws)
    assert os.stat(target / "sparse").st_blocks * 512 < 1 * MiB


async def test_a_corrupted_pack_in_the_store_fails_the_restore(
    store: ObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    _workspace(ws)
    manifest = await _upload(store, ws, tmp_path / "staging")
    # the pack holding data.bin's first chunk, overwritten with garbage of its size
    first = next(e for e in manifest["entries"] if e.get("p") == "data.bin")["x"][0][2]
    pack = manifest["chunks"][first][0]
    size = len(await store.get(f"v1/p/packs/{pack}", PACK_MAX))
    await store.put(f"v1/p/packs/{pack}", os.urandom(size))
    local = await _fetch(store, manifest, tmp_path / "fetch")
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(ManifestError, match=r"checksum|decompress"):
        await asyncio.to_thread(apply, target, manifest, BIG, local.__getitem__, None)
    # and one cut short
    await store.put(f"v1/p/packs/{pack}", b"short")
    local = await _fetch(store, manifest, tmp_path / "fetch2")
    target = tmp_path / "target2"
    target.mkdir()
    with pytest.raises(ManifestError, match=r"shorter|checksum"):
        await asyncio.to_thread(apply, target, manifest, BIG, local.__getitem__, None)
