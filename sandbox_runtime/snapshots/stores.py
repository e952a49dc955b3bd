"""Where snapshots are kept: a directory (local disk, or any shared filesystem: NFS, a
ReadWriteMany volume) or S3-compatible object storage, chosen by SANDBOX_SNAPSHOT_STORE.

Both are plain object stores: put, get, list, delete by key. A key is a relative path of
letters, digits and `._-` components that this package makes (never a caller's text). A put
is atomic (a reader sees the whole object or none): the directory store writes a temporary
file, syncs it and renames it into place; S3 makes an object visible when its PUT completes.
Every call is bounded in time; a store that does not answer raises StoreUnavailableError,
which the snapshot service turns into a delay (snapshots) or a fresh start (restores), never
into a failed call of anything else. What these errors say reaches callers: never a path,
endpoint, bucket, prefix or key (a key names the principal's hash and the workspace); the
operator's log has the whole error.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loguru import logger

from sandbox_runtime.errors import SandboxRuntimeError

# The stores' own threads: a store that hangs (a hard-mounted NFS that stopped answering)
# holds these, never the threads the rest of the server uses for file and mount work.
STORE_THREADS = 4
_executor = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="snapshot-store")


async def in_store_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_executor, fn, *args)


KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}){0,7}")
TEMP_PREFIX = ".tmp-"


class StoreUnavailableError(SandboxRuntimeError):
    """The snapshot store did not answer (down, slow, refusing our credentials)."""


class ObjectMissingError(SandboxRuntimeError):
    """An object the snapshot needs is not in the store."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float  # unix time


class ObjectStore(Protocol):
    describe: str

    async def put(self, key: str, data: bytes) -> None: ...

    async def put_file(self, key: str, path: Path) -> None:
        """Store the file at `path` (a staging file of ours, which this may move)."""

    async def get(self, key: str, max_bytes: int) -> bytes: ...

    async def local(self, key: str, staging: Path, max_bytes: int) -> Path:
        """A local file holding the object (the object itself, or a copy made in
        `staging`), for reading by offset."""

    async def list(self, prefix: str) -> list[ObjectInfo]: ...

    async def delete(self, key: str) -> None: ...


def check_key(key: str) -> str:
    if not KEY.fullmatch(key):
        raise ValueError(f"invalid object key {key!r}")
    return key


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


KINDS = {
    "packs": "a pack",
    "manifests": "a manifest",
    "meta": "a snapshot's record",
    "latest": "the session's newest-snapshot pointer",
    "pending": "a pending record",
}
STATUS = re.compile(r"\b(?:status(?: code)?:?\s*|HTTP\s*)([1-5]\d\d)\b", re.IGNORECASE)
# What kind of failure an error's text says, in the store client's words (first match);
# the client's own settings in its text (retry_timeout: 3s) are not what happened.
SETTINGS = re.compile(r"\b(?:max_retries|retry_timeout)\s*:\s*\S+", re.IGNORECASE)
FAILURES = (
    ("connection refused", re.compile(r"connection refused", re.IGNORECASE)),
    ("access denied", re.compile(r"access ?denied|forbidden|signature|credential", re.I)),
    ("no such bucket", re.compile(r"no ?such ?bucket", re.IGNORECASE)),
    ("timed out", re.compile(r"timed? ?out|timeout", re.IGNORECASE)),
    ("connection failed", re.compile(r"connect|sending request|dns|resolve|reset by", re.I)),
)


def object_kind(key: str) -> str:
    """What the object at `key` is, without its key: "a pack", "a manifest", ..."""
    parts = key.rstrip("/").split("/")
    for part in reversed(parts[-2:]):  # (a key's folder, or a listed prefix itself)
        if part in KINDS:
            return KINDS[part]
    return "an object"


def _too_large(key: str) -> str:
    return f"{object_kind(key)} of the snapshot is larger than it may be"


def failure_of(exc: BaseException) -> str:
    """A store client's error as callers may see it: its type and what kind of failure it
    was (an HTTP status, a timeout, ...), never its text (which names the endpoint, bucket
    and key)."""
    text = SETTINGS.sub("", str(exc))
    found = [status.group(1) for status in [STATUS.search(text)] if status]
    found += [name for name, pattern in FAILURES if pattern.search(text)][:1]
    detail = ", ".join(f"HTTP {f}" if f.isdigit() else f for f in found)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


class DirectoryStore:
    """Objects as files under a directory (root-owned, 0700)."""

    def __init__(self, root: Path, timeout: float) -> None:
        self.root = root
        self.timeout = timeout
        self.describe = "directory"  # (its path stays out of what callers are told)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def _run(self, fn: Any, *args: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                return await in_store_thread(fn, *args)
        except FileNotFoundError as exc:
            key = str(exc.filename or "?").removeprefix(f"{self.root}/")
            logger.info("snapshot store {}: {} is missing", self.root, key)
            raise ObjectMissingError(f"{object_kind(key)} of the snapshot is missing") from None
        except (OSError, TimeoutError) as exc:
            logger.warning("snapshot store {} failed: {}", self.root, exc)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "timed out"
            raise StoreUnavailableError(
                f"the snapshot store ({self.describe}) failed: {type(exc).__name__}: {reason}"
            ) from None

    def _prepare(self, path: Path) -> Path:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path.parent / f"{TEMP_PREFIX}{secrets.token_hex(8)}"

    def _put_sync(self, key: str, data: bytes) -> None:
        def write(temp: Path) -> None:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)

        self._place(key, write)

    def _put_file_sync(self, key: str, source: Path) -> None:
        def move(temp: Path) -> None:
            try:
                os.rename(source, temp)  # (same filesystem: no copy)
            except OSError:
                shutil.copyfile(source, temp)

        self._place(key, move)

    def _place(self, key: str, make: Any) -> None:
        """Make the object in a temporary file beside it, sync it, rename it into place: a
        reader sees the whole object or none."""
        path = self._path(key)
        temp = self._prepare(path)
        try:
            make(temp)
            fd = os.open(temp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()

    def _get_sync(self, key: str, max_bytes: int) -> bytes:
        with open(self._path(key), "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ObjectMissingError(_too_large(key))
        return data

    def _local_sync(self, key: str, staging: Path, max_bytes: int) -> Path:
        """A copy in `staging` (read under the store's timeout: a restore then reads only
        local files, which a hung shared filesystem cannot stall)."""
        path = self._path(key)
        if path.stat().st_size > max_bytes:
            raise ObjectMissingError(_too_large(key))
        staging.mkdir(mode=0o700, parents=True, exist_ok=True)
        copy = staging / key.replace("/", "_")
        shutil.copyfile(path, copy)
        return copy

    def _list_sync(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix.rstrip("/"))
        found: list[ObjectInfo] = []
        with contextlib.suppress(FileNotFoundError), os.scandir(base) as entries:
            for entry in entries:
                if entry.name.startswith(TEMP_PREFIX) or not entry.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    found.append(ObjectInfo(f"{prefix.rstrip('/')}/{entry.name}", st.st_size,
                                            st.st_mtime))  # fmt: skip
        return found

    def _delete_sync(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    async def put(self, key: str, data: bytes) -> None:
        await self._run(self._put_sync, key, data)

    async def put_file(self, key: str, path: Path) -> None:
        await self._run(self._put_file_sync, key, path)

    async def get(self, key: str, max_bytes: int) -> bytes:
        return await self._run(self._get_sync, key, max_bytes)

    async def local(self, key: str, staging: Path, max_bytes: int) -> Path:
        return await self._run(self._local_sync, key, staging, max_bytes)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Objects directly under `prefix` (one level: keys are made that way)."""
        return await self._run(self._list_sync, prefix)

    async def delete(self, key: str) -> None:
        await self._run(self._delete_sync, key)


class S3Store:
    """Objects in an S3 bucket under a prefix, through obstore (the Rust object_store crate's
    async client): only the S3 API, so AWS, MinIO, Ceph or any compatible server work alike."""

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None,
        region: str,
        timeout: float,
    ) -> None:
        from obstore.store import S3Store as ObstoreS3

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        self.timeout = timeout
        self.describe = f"s3://{bucket}/{prefix}".rstrip("/")
        options: Any = {"timeout": f"{max(1, int(timeout))}s", "connect_timeout": "5s"}
        config: Any = {"region": region}
        if endpoint:
            config["endpoint"] = endpoint
            if endpoint.startswith("http://"):
                options["allow_http"] = True
        self._store = ObstoreS3(
            bucket,
            prefix=prefix.strip("/") or None,
            config=config,
            client_options=options,
            retry_config={"max_retries": 2, "retry_timeout": timedelta_seconds(timeout)},
        )

    async def _call(self, work: Any, key: str) -> Any:
        """Run a request about `key` (errors say what kind of object, never its key; the
        log has the client's whole error)."""
        try:
            async with asyncio.timeout(self.timeout):
                return await work
        except ObjectMissingError:
            raise
        except FileNotFoundError as exc:
            logger.info("snapshot store {}: {}", self.describe, _first_line(exc))
            raise ObjectMissingError(f"{object_kind(key)} of the snapshot is missing") from None
        except (Exception, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                failure = f"no answer within {self.timeout:g} s"
            else:
                failure = failure_of(exc)
            logger.warning("snapshot store {} failed: {}", self.describe, _first_line(exc))
            raise StoreUnavailableError(f"the snapshot store (S3) failed: {failure}") from None

    async def put(self, key: str, data: bytes) -> None:
        import obstore

        await self._call(obstore.put_async(self._store, check_key(key), data), key)

    async def put_file(self, key: str, path: Path) -> None:
        data = await in_store_thread(path.read_bytes)
        await self.put(key, data)
        await in_store_thread(lambda: path.unlink(missing_ok=True))

    async def get(self, key: str, max_bytes: int) -> bytes:
        import obstore

        check_key(key)  # (here: a ValueError inside _call would be "unavailable")

        async def fetch() -> bytes:
            result = await obstore.get_async(self._store, key)
            if int(result.meta["size"]) > max_bytes:
                raise ObjectMissingError(_too_large(key))
            return bytes(await result.bytes_async())

        return await self._call(fetch(), key)

    async def local(self, key: str, staging: Path, max_bytes: int) -> Path:
        data = await self.get(key, max_bytes)
        path = staging / key.replace("/", "_")

        def write() -> None:
            staging.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.write_bytes(data)

        await in_store_thread(write)
        return path

    async def list(self, prefix: str) -> list[ObjectInfo]:
        import obstore

        check_key(prefix.rstrip("/"))

        async def collect() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            stream = obstore.list(self._store, prefix.rstrip("/") + "/", chunk_size=1000)
            async for batch in stream:
                for meta in batch:
                    modified = meta.get("last_modified")
                    when = modified.timestamp() if modified is not None else time.time()
                    found.append(ObjectInfo(str(meta["path"]), int(meta["size"]), when))
            return found

        return await self._call(collect(), prefix)

    async def delete(self, key: str) -> None:
        import obstore

        with contextlib.suppress(ObjectMissingError):
            await self._call(obstore.delete_async(self._store, check_key(key)), key)


def timedelta_seconds(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def open_store(
    setting: str, default_dir: Path, *, endpoint: str | None, region: str, timeout: float
) -> ObjectStore | None:
    """The store SANDBOX_SNAPSHOT_STORE names ("": a directory under the state directory;
    "none": no snapshots)."""
    if setting.strip().lower() == "none":
        return None
    if setting.startswith("s3://"):
        return S3Store(setting, endpoint=endpoint, region=region, timeout=timeout)
    return DirectoryStore(Path(setting) if setting else default_dir, timeout)
