"""Importing an environment from an OCI image: a `docker save` tar, an OCI layout directory
(`skopeo copy … oci:DIR`, `buildah push … oci:DIR`) or a tar of one.

The image's manifest names its layers and its configuration; the layers are applied in
order to an empty tree by extract.py (whiteouts honoured, hostile entries refused, size
bounded), and the configuration gives the environment its Env, WorkingDir, User and Labels.
Blob names come from the image's own JSON and are checked (sha256 hex) before use; blobs are
read from the archive by name, never through the filesystem by a path the image chose.
"""

from __future__ import annotations

import contextlib
import json
import re
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from sandbox_runtime.environments.extract import (
    BoundedInfo,
    Budget,
    LayerError,
    extract_layer,
)
from sandbox_runtime.environments.store import (
    Environment,
    EnvironmentsError,
    EnvironmentStore,
    check_name,
    remove_tree,
)

Log = Callable[[str], None]
MAX_JSON = 4 * 1024 * 1024
BLOB = re.compile(r"^sha256:([0-9a-f]{64})$")
SAVE_LAYER = re.compile(r"^[A-Za-z0-9._/-]{1,300}$")


class ImageError(EnvironmentsError):
    """The file is not an OCI image archive or layout we can read."""


class _Source:
    """Files of an image by name: in a directory or in a tar."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tar: tarfile.TarFile | None = None
        if path.is_file():
            try:
                self.tar = tarfile.open(path, mode="r:*", tarinfo=BoundedInfo)
            except (tarfile.TarError, OSError) as exc:
                raise ImageError(f"{path} is not a tar: {exc}") from None
        elif not path.is_dir():
            raise ImageError(f"{path}: no such file or directory")

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()

    def has(self, name: str) -> bool:
        if self.tar is not None:
            with contextlib.suppress(KeyError):
                return self.tar.getmember(name).isreg()
            with contextlib.suppress(KeyError):
                return self.tar.getmember(f"./{name}").isreg()
            return False
        target = (self.path / name).resolve()
        return target.is_relative_to(self.path.resolve()) and target.is_file()

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        if not SAVE_LAYER.match(name) or ".." in name.split("/"):
            raise ImageError(f"the image names a file {name!r} that is not a plain path")
        if self.tar is not None:
            member = None
            for candidate in (name, f"./{name}"):
                with contextlib.suppress(KeyError):
                    member = self.tar.getmember(candidate)
                    break
            stream = self.tar.extractfile(member) if member is not None and member.isreg() else None
            if stream is None:
                raise ImageError(f"the image has no file {name}")
            yield stream
            return
        target = (self.path / name).resolve()
        if not target.is_relative_to(self.path.resolve()) or not target.is_file():
            raise ImageError(f"the image has no file {name}")
        with open(target, "rb") as f:
            yield f

    def json(self, name: str) -> Any:
        with self.open(name) as f:
            data = f.read(MAX_JSON + 1)
        if len(data) > MAX_JSON:
            raise ImageError(f"{name} is larger than {MAX_JSON} bytes")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ImageError(f"{name} is not JSON: {exc}") from None


def blob_name(digest: Any) -> str:
    match = BLOB.match(str(digest))
    if match is None:
        raise ImageError(f"the image names a blob {str(digest)[:80]!r}: only sha256 is read")
    return f"blobs/sha256/{match.group(1)}"


def read_manifest(source: _Source) -> tuple[list[str], dict[str, Any]]:
    """(layer file names in order, the image configuration)."""
    if source.has("index.json"):
        index = source.json("index.json")
        manifests = index.get("manifests") or []
        if not manifests:
            raise ImageError("index.json lists no manifest")
        manifest = source.json(blob_name(manifests[0].get("digest")))
        if "manifests" in manifest:  # an index of per-platform manifests: take amd64/linux
            chosen = next(
                (m for m in manifest["manifests"]
                 if (m.get("platform") or {}).get("architecture") in ("amd64", None)),
                None,
            )  # fmt: skip
            if chosen is None:
                raise ImageError("the image has no linux/amd64 manifest")
            manifest = source.json(blob_name(chosen.get("digest")))
        layers = [blob_name(layer.get("digest")) for layer in manifest.get("layers") or []]
        config = source.json(blob_name((manifest.get("config") or {}).get("digest")))
        return layers, config
    if source.has("manifest.json"):
        saved = source.json("manifest.json")
        if not isinstance(saved, list) or not saved:
            raise ImageError("manifest.json lists no image")
        entry = saved[0]
        return [str(name) for name in entry.get("Layers") or []], source.json(str(entry["Config"]))
    raise ImageError("not an OCI image: no index.json (OCI layout) nor manifest.json (docker save)")


def environment_config(image: dict[str, Any]) -> dict[str, Any]:
    """The environment's configuration from the image's (Env, WorkingDir, User, Labels)."""
    conf = image.get("config") or image.get("Config") or {}
    env = {}
    for item in conf.get("Env") or []:
        key, eq, value = str(item).partition("=")
        if eq and key:
            env[key] = value
    return {
        "env": env,
        "workdir": str(conf.get("WorkingDir") or "/"),
        "user": str(conf.get("User") or "root"),
        "labels": {str(k): str(v) for k, v in (conf.get("Labels") or {}).items()},
    }


def import_image(
    store: EnvironmentStore, name: str, path: Path, max_bytes: int, log: Log
) -> Environment:
    """Import the image at `path` as environment `name` (the previous one of that name stays
    until the import succeeds). Raises ImageError, LayerError, LayerTooLargeError."""
    from sandbox_runtime.environments.build import finish_root

    check_name(name)
    source = _Source(path)
    work = store.work_dir("import")
    tree = work / "root"
    tree.mkdir()
    try:
        layers, image = read_manifest(source)
        budget = Budget(max_bytes)
        refused: Counter[str] = Counter()
        for number, layer in enumerate(layers, 1):
            log(f"layer {number}/{len(layers)}: {layer}")
            with source.open(layer) as stream:
                refused += extract_layer(stream, tree, max_bytes, True, budget)
        for reason, count in sorted(refused.items()):
            log(f"refused {count} entr{'y' if count == 1 else 'ies'}: {reason}")
        digest = finish_root(store, tree, environment_config(image), max_bytes, log)
        store.point(name, digest)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ImageError(f"the image's manifest is not of the expected shape: {exc}") from None
    except LayerError:
        raise
    finally:
        source.close()
        remove_tree(work)
    env = store.get(name)
    assert env is not None
    return env
