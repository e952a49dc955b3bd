"""Sharing environments across workers by digest, through the snapshot store (a directory
or S3: SANDBOX_SNAPSHOT_STORE).

An environment is two objects: `environments/roots/<root digest>.tar` (the root as a tar,
uncompressed: most of it is compressed packages already) and
`environments/images/<digest>.json` (its configuration). A push writes the root first, so a
reader that finds the image finds its root. A fetch never trusts the archive: it is
extracted by oci.py's safe extraction (no escapes, no devices, no setuid, bounded size) and
its digest recomputed; a root whose digest differs from its name is refused.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sandbox_runtime.environments.digest import kernelspecs, summarize, tree_size
from sandbox_runtime.environments.store import (
    DIGEST,
    Environment,
    EnvironmentsError,
    EnvironmentStore,
    remove_tree,
)

Log = Callable[[str], None]
MAX_CONFIG_BYTES = 1024 * 1024


class ArchiveStore(Protocol):
    """What sharing needs of the snapshot store (snapshots/stores.py's ObjectStore)."""

    async def put(self, key: str, data: bytes) -> None: ...

    async def put_file(self, key: str, path: Path) -> None: ...

    async def get(self, key: str, max_bytes: int) -> bytes: ...

    async def local(self, key: str, staging: Path, max_bytes: int) -> Path: ...


def root_key(root_digest: str) -> str:
    return f"environments/roots/{root_digest.removeprefix('sha256:')}.tar"


def image_key(digest: str) -> str:
    return f"environments/images/{digest.removeprefix('sha256:')}.json"


async def push(store: EnvironmentStore, env: Environment, shared: ArchiveStore, log: Log) -> None:
    """Put `env`'s root and configuration in the shared store."""
    assert env.root is not None
    staging = store.tmp / f"push-{secrets.token_hex(6)}.tar"
    store.tmp.mkdir(parents=True, exist_ok=True)
    try:
        log(f"archiving {env.name} ({env.size_bytes // 2**20} MiB)")
        await asyncio.to_thread(_archive, env.root, staging)
        await shared.put_file(root_key(env.root_digest), staging)
        config = json.dumps(env.config(), sort_keys=True).encode()
        await shared.put(image_key(env.digest), config)
        log(f"pushed {env.name} as {env.digest}")
    finally:
        await asyncio.to_thread(staging.unlink, True)


def _archive(root: Path, target: Path) -> None:
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(root, arcname=".", recursive=True)


class SharedFetcher:
    """EnvironmentStore's fetcher: brings a digest from the shared store."""

    def __init__(self, shared: ArchiveStore, max_bytes: int, log: Log) -> None:
        self.shared = shared
        self.max_bytes = max_bytes
        self.log = log

    async def fetch(self, digest: str, store: EnvironmentStore) -> bool:
        from sandbox_runtime.environments.build import CONFIG_KEYS, image_digest
        from sandbox_runtime.environments.oci import extract_layer

        if not DIGEST.match(digest):
            return False
        try:
            config: dict[str, Any] = json.loads(
                await self.shared.get(image_key(digest), MAX_CONFIG_BYTES)
            )
        except Exception:  # (a missing object or an unreadable store: not here)
            return False
        if not isinstance(config, dict):
            raise EnvironmentsError(f"the shared store's {digest} is not an environment")
        if image_digest(config) != digest or not DIGEST.match(str(config.get("root_digest"))):
            raise EnvironmentsError(f"the shared store's {digest} does not match its digest")
        root_digest = config["root_digest"]
        if not store.root_path(root_digest).is_dir():
            work = await asyncio.to_thread(store.work_dir, "fetch")
            try:
                self.log(f"fetching {digest} from the shared store")
                archive = await self.shared.local(root_key(root_digest), work, self.max_bytes)
                tree = work / "root"
                tree.mkdir()
                await asyncio.to_thread(extract_layer, archive, tree, self.max_bytes, False)
                summary = await asyncio.to_thread(summarize, tree, self.max_bytes)
                if summary.digest != root_digest:
                    raise EnvironmentsError(
                        f"the shared store's root for {digest} does not match its digest"
                    )
                store.add_root(tree, root_digest)
            finally:
                await asyncio.to_thread(remove_tree, work)
        # Only what the digest covers is taken from the store; the rest is this root's own
        # (the digest pins none of it: a store that could be written to would choose a
        # kernel's argv, or break every lookup here with a kernelspec of the wrong shape).
        root = store.root_path(root_digest)
        trusted = {key: config.get(key) for key in CONFIG_KEYS}
        trusted["kernelspecs"] = await asyncio.to_thread(kernelspecs, root)
        trusted["size_bytes"] = await asyncio.to_thread(tree_size, root)
        trusted["created"] = time.time()
        store.add_image(digest, trusted)
        return True
