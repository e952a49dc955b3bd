"""Session snapshots (sandbox_runtime.snapshots): what taking and restoring one costs, for a
workspace of 100 MiB in 1,000 files (random bytes, incompressible; --compressible: text).

For each store (a DirectoryStore on the host disk; an S3Store against a local moto server, if
moto is installed), each round on a fresh, empty store:

a) first snapshot: what Snapshots._take does: capture() into a staging directory, put_file of
   each new pack, the zlib-compressed JSON manifest, the meta and the `latest` hint (retention,
   Snapshots.prune, is left out): seconds, and bytes the store holds afterwards.
b) 1% of the workspace changed (--change files: 10 of the 1,000 files rewritten whole;
   --change spread: 1 MiB as 4 KiB writes at random offsets across the files), then an
   incremental snapshot (previous = the last manifest, known = its chunks): seconds, and the
   bytes it added to the store. Target <= 0.5 s.
c) restore of that snapshot into an empty workspace, as Snapshots.restore does: manifest get,
   packs_of, store.local() of each pack, apply() (owned by `nobody`): seconds, and the restored
   tree checked byte for byte against the workspace. Target <= 2 s.

The workspace and the restore target are ext4 images as the server makes them (mkfs_argv,
allocated in full, loop-mounted with MOUNT_OPTIONS; needs root); --no-image: plain
directories. Staging and the directory store share the host filesystem, as the server's
state directory does. `sync` runs before every timed step; --cold also drops the page cache
then (the workspace and the packs are read from disk). Each figure is the median of --rounds.

    .venv/bin/python bench/bench_snapshots.py [--rounds 3] [--compressible] [--cold]
        [--change files|spread] [--no-image] [--no-s3] [--mb 100] [--files 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.util
import json
import os
import pwd
import random
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_runtime.config.parsing import inode_count
from sandbox_runtime.snapshots.apply import apply, packs_of
from sandbox_runtime.snapshots.capture import Captured, capture
from sandbox_runtime.snapshots.manifest import Bounds
from sandbox_runtime.snapshots.records import meta_of
from sandbox_runtime.snapshots.service import MANIFEST_MAX, PACK_MAX
from sandbox_runtime.snapshots.stores import DirectoryStore, ObjectStore, S3Store
from sandbox_runtime.workspaces import images

MiB = 1024 * 1024
IMAGE_MB = 256
FILES_PER_DIR = 100
SPREAD_WRITE = 4096
INCREMENTAL_TARGET_S = 0.5
RESTORE_TARGET_S = 2.0
STORE_TIMEOUT = 300.0
BUCKET = "srt-bench-snapshots"
SKIPPED = ("lost+found",)


class BenchFailure(Exception):
    """Something the benchmark relies on did not hold (not a missed target)."""


# -- workspaces ---------------------------------------------------------------------------------


class Volumes:
    """Empty workspaces under `tmp`: ext4 images loop-mounted like the server's, or plain
    directories. `close` unmounts them all."""

    def __init__(self, tmp: Path, use_image: bool, size_mb: int, owner: tuple[int, int]) -> None:
        self.tmp, self.use_image, self.size_mb, self.owner = tmp, use_image, size_mb, owner
        self.mounted: list[Path] = []

    def make(self, name: str) -> Path:
        point = self.tmp / "mnt" / name
        point.mkdir(parents=True)
        if not self.use_image:
            os.chown(point, *self.owner)
            return point
        (self.tmp / "images").mkdir(exist_ok=True)
        image = self.tmp / "images" / f"{name}.img"
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size_mb * MiB)  # (SANDBOX_WORKSPACE_RESERVE=allocate)
        finally:
            os.close(fd)
        images.run(images.mkfs_argv(image, inode_count(self.size_mb, None), self.owner))
        images.run(images.mount_argv(image, point, images.MOUNT_OPTIONS))
        self.mounted.append(point)
        return point

    def close(self) -> list[str]:
        problems = []
        for point in reversed(self.mounted):
            try:
                images.umount(point)
            except OSError as exc:
                problems.append(f"umount {point}: {exc}")
        self.mounted.clear()
        return problems


def empty(root: Path) -> None:
    """Remove everything in a workspace (its lost+found stays)."""
    for child in root.iterdir():
        if child.name in SKIPPED:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


class Content:
    """File contents: random bytes, or text (words; zlib level 1 packs it ~2-3x)."""

    def __init__(self, rng: random.Random, compressible: bool) -> None:
        self.rng, self.compressible = rng, compressible
        self.corpus = b""
        if compressible:
            letters = "abcdefghijklmnopqrstuvwxyz_"
            vocabulary = [
                "".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(3000)
            ] + ["def", "return", "import", "self", "(", ")", ":", "=", "#", "0", "1", "None"]
            words = rng.choices(vocabulary, k=400_000)
            lines = [" ".join(words[i : i + 9]) for i in range(0, len(words), 9)]
            text = "\n".join(lines).encode()
            self.corpus = text + text

    def make(self, size: int) -> bytes:
        if not self.compressible:
            return self.rng.randbytes(size)
        header = f"# {self.rng.getrandbits(64):016x}\n".encode()  # (no two files alike)
        start = self.rng.randrange(len(self.corpus) // 2)
        body = self.corpus[start : start + size]
        while len(body) < size:
            body += self.corpus[: size - len(body)]
        return (header + body)[:size]


def fill(root: Path, files: int, total: int, content: Content) -> list[Path]:
    """`files` files of `total` bytes in all, FILES_PER_DIR to a directory."""
    paths = []
    size = total // files
    for i in range(files):
        directory = root / f"dir{i // FILES_PER_DIR:03d}"
        directory.mkdir(exist_ok=True)
        path = directory / f"file{i:05d}.bin"
        path.write_bytes(content.make(size if i < files - 1 else total - size * (files - 1)))
        paths.append(path)
    return paths


def change(paths: list[Path], mode: str, total: int, content: Content) -> tuple[set[Path], int]:
    """Change 1% of the workspace in place (the files keep their inodes): the files changed
    and the bytes written."""
    rng = content.rng
    changed: set[Path] = set()
    written = 0
    if mode == "files":
        for path in rng.sample(paths, max(1, len(paths) // 100)):
            data = content.make(path.stat().st_size)
            with open(path, "r+b") as f:
                f.write(data)
            changed.add(path)
            written += len(data)
        return changed, written
    for _ in range(max(1, total // 100 // SPREAD_WRITE)):
        path = rng.choice(paths)
        size = path.stat().st_size
        length = min(SPREAD_WRITE, size)
        offset = rng.randrange(size - length + 1)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, content.make(length), offset)
        finally:
            os.close(fd)
        changed.add(path)
        written += length
    return changed, written


def tree_digest(root: Path) -> str:
    """Paths, modes, sizes and contents of the regular files and directories under `root`."""
    digest = hashlib.sha256()
    for directory, dirs, names in os.walk(root):
        rel = os.path.relpath(directory, root)
        if rel == ".":
            dirs[:] = [d for d in dirs if d not in SKIPPED]
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(directory, name)
            st = os.lstat(path)
            digest.update(f"{rel}/{name}\0{st.st_mode:o}\0{st.st_size}\0".encode())
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def settle(cold: bool) -> None:
    """Before a timed step: write back what is dirty; `cold`: drop the page cache too."""
    os.sync()
    if cold:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


# -- the steps, as sandbox_runtime.snapshots.service does them ------------------------------------


@dataclass
class Taken:
    snapshot_id: str
    manifest: dict[str, Any]
    captured: Captured
    seconds: float


async def take(
    store: ObjectStore,
    prefix: str,
    root: Path,
    staging_root: Path,
    bounds: Bounds,
    previous: dict[str, Any] | None,
) -> Taken:
    """Snapshots._take without its workspace bookkeeping and pruning."""
    staging = staging_root / secrets.token_hex(8)
    snapshot_id = f"snap-{secrets.token_hex(16)}"
    started = time.perf_counter()
    try:
        known = previous.get("chunks", {}) if previous else {}
        captured = await asyncio.to_thread(capture, root, staging, bounds, previous, known)
        for pack, pack_path in captured.packs:
            await store.put_file(f"{prefix}/packs/{pack}", pack_path)
        body = zlib.compress(json.dumps(captured.manifest, separators=(",", ":")).encode(), 6)
        if len(body) > MANIFEST_MAX:
            raise BenchFailure("the manifest is over MANIFEST_MAX")
        await store.put(f"{prefix}/manifests/{snapshot_id}.z", body)
        meta = meta_of(snapshot_id, "bench", "bench", captured, len(body))
        await store.put(f"{prefix}/meta/{snapshot_id}.json", json.dumps(meta).encode())
        latest = {"snapshot_id": snapshot_id, "taken_at": meta["taken_at"]}
        await store.put(f"{prefix}/latest/bench.json", json.dumps(latest).encode())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Taken(snapshot_id, captured.manifest, captured, time.perf_counter() - started)


async def restore(
    store: ObjectStore,
    prefix: str,
    snapshot_id: str,
    target: Path,
    staging_root: Path,
    bounds: Bounds,
    owner: tuple[int, int],
) -> tuple[int, float]:
    """Snapshots.restore (manifest get, packs_of, store.local of each pack, apply) into the
    empty `target`: (bytes written, seconds)."""
    staging = staging_root / secrets.token_hex(8)
    started = time.perf_counter()
    try:
        body = await store.get(f"{prefix}/manifests/{snapshot_id}.z", MANIFEST_MAX)
        inflater = zlib.decompressobj()
        manifest = json.loads(inflater.decompress(body, bounds.max_entries * 2048 + MiB))
        local: dict[str, Path] = {}
        for pack in await asyncio.to_thread(packs_of, manifest, bounds):
            local[pack] = await store.local(f"{prefix}/packs/{pack}", staging, PACK_MAX)
        applied = await asyncio.to_thread(apply, target, manifest, bounds, local.__getitem__, owner)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return applied.bytes, time.perf_counter() - started


async def held(store: ObjectStore, prefix: str) -> int:
    """Bytes of all objects under the prefix."""
    total = 0
    for part in ("packs", "manifests", "meta", "latest"):
        total += sum(info.size for info in await store.list(f"{prefix}/{part}"))
    return total


async def wipe(store: ObjectStore, prefix: str) -> None:
    for part in ("packs", "manifests", "meta", "latest"):
        for info in await store.list(f"{prefix}/{part}"):
            key = info.key
            if not key.startswith(prefix):  # (obstore lists paths with the store's prefix)
                key = key[key.index(prefix) :]
            await store.delete(key)


# -- one store, N rounds ------------------------------------------------------------------------


@dataclass
class Results:
    first_s: list[float] = field(default_factory=list)
    first_bytes: list[int] = field(default_factory=list)
    incr_s: list[float] = field(default_factory=list)
    incr_bytes: list[int] = field(default_factory=list)
    incr_reread: list[int] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    restore_bytes: list[int] = field(default_factory=list)
    first_packs: list[int] = field(default_factory=list)


@dataclass
class Setup:
    args: argparse.Namespace
    workspace: Path
    target: Path
    staging: Path
    bounds: Bounds
    owner: tuple[int, int]
    paths: list[Path]
    content: Content
    total: int


async def rounds(setup: Setup, label: str, open_store: Any) -> Results:
    args = setup.args
    out = Results()
    for n in range(args.rounds):
        store, prefix, cleanup = open_store(n)
        try:
            print(f"  {label}: round {n + 1}/{args.rounds} ...", flush=True)
            settle(args.cold)
            first = await take(store, prefix, setup.workspace, setup.staging, setup.bounds, None)
            if first.captured.files != len(setup.paths) or first.captured.bytes != setup.total:
                raise BenchFailure(
                    f"the first snapshot holds {first.captured.files} files, "
                    f"{first.captured.bytes} bytes (expected {len(setup.paths)}, {setup.total})"
                )
            out.first_s.append(first.seconds)
            out.first_bytes.append(await held(store, prefix))
            out.first_packs.append(len(first.captured.packs))

            changed, _ = change(setup.paths, args.change, setup.total, setup.content)
            before = await held(store, prefix)
            settle(args.cold)
            incr = await take(
                store, prefix, setup.workspace, setup.staging, setup.bounds, first.manifest
            )
            reread = incr.captured.files - incr.captured.reused_files
            if reread != len(changed):
                raise BenchFailure(
                    f"the incremental snapshot read {reread} files again; {len(changed)} changed"
                )
            out.incr_s.append(incr.seconds)
            out.incr_bytes.append(await held(store, prefix) - before)
            out.incr_reread.append(reread)

            expected = tree_digest(setup.workspace)
            settle(args.cold)
            written, seconds = await restore(
                store, prefix, incr.snapshot_id, setup.target, setup.staging, setup.bounds,
                setup.owner,
            )  # fmt: skip
            if written != setup.total or tree_digest(setup.target) != expected:
                raise BenchFailure(f"{label}: the restored workspace differs from the original")
            out.restore_s.append(seconds)
            out.restore_bytes.append(written)
        finally:
            empty(setup.target)
            await cleanup()
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_moto(port: int) -> subprocess.Popen[bytes]:
    """moto's standalone S3 server on 127.0.0.1:`port`, with the bucket made (HTTP PUT)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 30
    while True:
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/{BUCKET}", method="PUT")
            opener.open(request, timeout=2).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise BenchFailure("moto's server did not start") from None
            time.sleep(0.2)


async def run_all(setup: Setup, moto_port: int | None) -> dict[str, Results]:
    results: dict[str, Results] = {}
    state = setup.staging.parent

    def directory_store(n: int) -> tuple[ObjectStore, str, Any]:
        root = state / f"store-{n}"

        async def cleanup() -> None:
            shutil.rmtree(root, ignore_errors=True)

        return DirectoryStore(root, STORE_TIMEOUT), f"v1/{secrets.token_hex(16)}", cleanup

    results["directory"] = await rounds(setup, "directory store", directory_store)

    if moto_port is not None:
        endpoint = f"http://127.0.0.1:{moto_port}"

        def s3_store(n: int) -> tuple[ObjectStore, str, Any]:
            store = S3Store(
                f"s3://{BUCKET}/bench", endpoint=endpoint, region="us-east-1",
                timeout=STORE_TIMEOUT,
            )  # fmt: skip
            prefix = f"v1/{secrets.token_hex(16)}"

            async def cleanup() -> None:  # (moto keeps objects in memory)
                with contextlib.suppress(Exception):
                    await wipe(store, prefix)

            return store, prefix, cleanup

        results["s3 (moto)"] = await rounds(setup, "S3 store (moto)", s3_store)
    return results


# -- the table ----------------------------------------------------------------------------------


def seconds_cell(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} s  ({min(values):.3f}-{max(values):.3f})"


def mib(value: float) -> str:
    return f"{value / MiB:8.2f} MiB"


def report(results: dict[str, Results], setup: Setup, s3_skipped: str) -> None:
    args = setup.args
    changed = (
        f"{max(1, args.files // 100)} of {args.files} files rewritten"
        if args.change == "files"
        else f"{max(1, setup.total // 100 // SPREAD_WRITE)} x 4 KiB writes across the files"
    )
    head = (
        f"{'store':<10} {'step':<36} {'median (min-max)':>26} {'stored':>13} {'target':>9}  verdict"
    )
    print()
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        rows = [
            ("first snapshot", r.first_s, statistics.median(r.first_bytes), None),
            (
                f"incremental, 1% ({statistics.median(r.incr_reread):g} files re-read)",
                r.incr_s,
                statistics.median(r.incr_bytes),
                INCREMENTAL_TARGET_S,
            ),
            (
                f"restore {statistics.median(r.restore_bytes) / MiB:g} MiB into empty",
                r.restore_s,
                None,
                RESTORE_TARGET_S,
            ),
        ]
        for step, values, stored, target in rows:
            stored_cell = mib(stored) if stored is not None else f"{'-':>13}"
            if target is None:
                target_cell, verdict = f"{'-':>9}", ""
            else:
                ok = statistics.median(values) <= target
                target_cell, verdict = f"<= {target:g} s".rjust(9), "OK" if ok else "MISS"
            print(
                f"{name:<10} {step:<36} {seconds_cell(values):>26} {stored_cell} "
                f"{target_cell}  {verdict}"
            )
    if s3_skipped:
        print(f"{'s3':<10} skipped: {s3_skipped}")
    # Restore on takeover (the latency a restore adds to a session's first call after its
    # home died) needs two replicas and Redis: bench/bench_takeover.py measures it.
    print(f"{'takeover':<10} what a restore adds to the first call: bench/bench_takeover.py")
    print()
    first = next(iter(results.values()))
    print(
        f"workspace: {setup.total / MiB:g} MiB in {args.files} files "
        f"({'compressible text' if args.compressible else 'random bytes'}), "
        f"{statistics.median(first.first_packs):g} packs; change: {changed}; "
        f"{args.rounds} rounds, {'cold' if args.cold else 'warm'} page cache"
    )
    print(
        "stored = bytes the store holds after the first snapshot (packs, manifest, meta, "
        "latest), and those the incremental one added"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="repeats; medians shown (3)")
    parser.add_argument("--mb", type=int, default=100, help="workspace data, MiB (100)")
    parser.add_argument("--files", type=int, default=1000, help="files holding it (1000)")
    parser.add_argument("--compressible", action="store_true", help="text, not random bytes")
    parser.add_argument(
        "--change", choices=("files", "spread"), default="files",
        help="the 1%% change: whole files rewritten, or 4 KiB writes across files (files)",
    )  # fmt: skip
    parser.add_argument("--cold", action="store_true", help="drop the page cache before steps")
    parser.add_argument("--no-image", action="store_true", help="plain directories, no ext4")
    parser.add_argument("--no-s3", action="store_true", help="leave out the S3 (moto) store")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.rounds < 1 or args.mb < 1 or args.files < 1:
        parser.error("--rounds, --mb and --files must be positive")
    image_mb = max(IMAGE_MB, args.mb + 128)  # (one workspace holds the data once)
    if (not args.no_image or args.cold) and os.geteuid() != 0:
        parser.error("ext4 images and --cold need root (or use --no-image)")

    s3_skipped = ""
    if args.no_s3:
        s3_skipped = "--no-s3"
    elif importlib.util.find_spec("moto") is None or importlib.util.find_spec("obstore") is None:
        s3_skipped = "moto (or obstore) is not installed"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench-key")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret")
    os.environ["NO_PROXY"] = ",".join(
        filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1", "localhost"])
    )
    try:
        nobody = pwd.getpwnam("nobody")
        owner = (nobody.pw_uid, nobody.pw_gid)
    except KeyError:
        owner = (65534, 65534)

    where = (
        "plain directories (--no-image)"
        if args.no_image
        else f"ext4 images of {image_mb} MiB, loop-mounted ({images.MOUNT_OPTIONS})"
    )
    print(f"bench_snapshots: {os.cpu_count()} cores; workspaces: {where}", flush=True)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="srt-bench-snapshots-"))
    volumes = Volumes(tmp, not args.no_image, image_mb, owner)
    moto: subprocess.Popen[bytes] | None = None
    problems: list[str] = []
    try:
        staging = tmp / "state" / "snapshot-staging"
        staging.mkdir(parents=True)
        workspace = volumes.make("workspace")
        target = volumes.make("restored")
        content = Content(random.Random(args.seed), args.compressible)
        total = args.mb * MiB
        print(f"  writing {args.mb} MiB in {args.files} files ...", flush=True)
        paths = fill(workspace, args.files, total, content)
        os.sync()
        bounds = Bounds(image_mb * MiB, inode_count(image_mb, None))
        setup = Setup(args, workspace, target, staging, bounds, owner, paths, content, total)
        port = None
        if not s3_skipped:
            port = free_port()
            moto = start_moto(port)
        results = asyncio.run(run_all(setup, port))
        report(results, setup, s3_skipped)
    except BenchFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        problems.append(str(exc))
    finally:
        if moto is not None:
            moto.kill()
            moto.wait()
        problems += volumes.close()
        left = images.mounts_under(tmp)
        loops = images.loop_devices_under(tmp)
        if left or loops:
            problems.append(f"still mounted: {left}, loop devices: {loops}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        for problem in problems:
            print(f"cleanup: {problem}", file=sys.stderr)
    print(f"(whole run {time.perf_counter() - started:.0f} s)")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
