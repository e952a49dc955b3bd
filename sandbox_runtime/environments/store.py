"""The environments kept in `<state_dir>/environments`: contents by digest, names as pointers.

Layout (every write is a temporary name renamed into place, so a reader sees a whole entry
or none, and a failed build leaves the previous environment of its name untouched):

    roots/<root digest>/          a root filesystem tree (read-only for sandboxes: bound, never
                                  copied per sandbox)
    images/<digest>.json          an environment's configuration: its root's digest, env,
                                  workdir, user, labels, description, kernelspecs, size
    names/<name>.json             {"digest": ...}: which image a name points at
    cache/<key>.json              build cache: (parent digest, instruction) -> digest
    tmp/                          builds and imports under way

An environment's `digest` is the sha256 of its root's digest and its configuration, so two
builds that differ only in ENV share one root on disk. `root_digest` is the content digest
of the tree alone (environments/digest.py says what it covers).

`default` is not stored: it is today's behaviour (the host's /usr read-only plus the shared
Python runtime at /opt/srt-runtime). `get("default")` returns DEFAULT, whose `root` is None;
a sandbox given an environment whose root is None runs exactly as before environments.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sandbox_runtime.errors import SandboxRuntimeError

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
DEFAULT_NAME = "default"


class EnvironmentsError(SandboxRuntimeError):
    """Base of the environment errors (a build, an import, a lookup)."""


class EnvironmentNotFoundError(EnvironmentsError):
    """No environment of that name or digest here (nor in the shared store)."""


@dataclass(frozen=True)
class Kernelspec:
    argv: list[str]
    display_name: str
    language: str


@dataclass(frozen=True)
class Environment:
    """One environment: a root filesystem plus what a sandbox needs to run in it.

    `root` is None only for DEFAULT (the host's /usr plus /opt/srt-runtime). Otherwise it is
    a directory that nothing may write to once stored; the use-half binds it read-only.
    `kernelspecs` maps a language (lower case, e.g. "r", "python") to the kernelspec found
    under share/jupyter/kernels in the root (argv paths are paths inside the root).
    """

    name: str
    digest: str
    root: Path | None
    root_digest: str = ""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "root"
    kernelspecs: dict[str, Kernelspec] = field(default_factory=dict)
    languages: list[str] = field(default_factory=list)
    size_bytes: int = 0
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    created: float = 0.0

    @property
    def is_default(self) -> bool:
        return self.root is None

    def config(self) -> dict[str, Any]:
        """The stored configuration (images/<digest>.json), without name, digest and root."""
        data = asdict(self)
        for key in ("name", "digest", "root"):
            data.pop(key)
        return data


DEFAULT = Environment(
    name=DEFAULT_NAME,
    digest="default",
    root=None,
    description="The host's /usr read-only plus the shared Python runtime (/opt/srt-runtime).",
)


class EnvironmentFetcher(Protocol):
    """Brings an environment missing here from the shared store (sharing.py), by digest."""

    async def fetch(self, digest: str, store: EnvironmentStore) -> bool: ...


def check_name(name: str) -> str:
    """Raises EnvironmentsError naming the rule when `name` is not an environment name."""
    if not NAME.match(name):
        raise EnvironmentsError(
            f"invalid environment name {name!r}: use 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return name


def environment_from(name: str, digest: str, root: Path, config: dict[str, Any]) -> Environment:
    specs = {
        lang: Kernelspec(
            argv=list(s["argv"]), display_name=s["display_name"], language=s["language"]
        )
        for lang, s in (config.get("kernelspecs") or {}).items()
    }
    return Environment(
        name=name,
        digest=digest,
        root=root,
        root_digest=config["root_digest"],
        env=dict(config.get("env") or {}),
        workdir=config.get("workdir") or "/",
        user=config.get("user") or "root",
        kernelspecs=specs,
        languages=sorted(specs),
        size_bytes=int(config.get("size_bytes") or 0),
        description=config.get("description")
        or (config.get("labels") or {}).get("description", ""),
        labels=dict(config.get("labels") or {}),
        created=float(config.get("created") or 0.0),
    )


class EnvironmentStore:
    """The environments of one state directory. Synchronous file work: call it from a thread
    (anyio.to_thread) in the server; `ensure` is the one async method (it may fetch)."""

    def __init__(self, base: Path, fetcher: EnvironmentFetcher | None = None) -> None:
        self.base = base
        self.fetcher = fetcher

    @property
    def roots(self) -> Path:
        return self.base / "roots"

    @property
    def images(self) -> Path:
        return self.base / "images"

    @property
    def names(self) -> Path:
        return self.base / "names"

    @property
    def cache(self) -> Path:
        return self.base / "cache"

    @property
    def tmp(self) -> Path:
        return self.base / "tmp"

    def work_dir(self, kind: str) -> Path:
        """A new directory under tmp/ for a build, import or fetch under way: root's alone
        (0700, tmp/ too). A RUN step is the host's root in its user namespace: until the
        tree is stored (neutralized) it may hold setuid-root files or file capabilities
        that no other host user may reach."""
        self.tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.tmp, 0o700)
        work = self.tmp / f"{kind}-{secrets.token_hex(6)}"
        work.mkdir(mode=0o700)
        return work

    def root_path(self, root_digest: str) -> Path:
        return self.roots / root_digest.removeprefix("sha256:")

    def image_path(self, digest: str) -> Path:
        return self.images / f"{digest.removeprefix('sha256:')}.json"

    # -- reading -----------------------------------------------------------------------------

    def get(self, name: str) -> Environment | None:
        """The environment `name` points at; DEFAULT for "default"; None when unknown."""
        if name == DEFAULT_NAME:
            return DEFAULT
        if not NAME.match(name):
            return None
        pointer = _read_json(self.names / f"{name}.json")
        if pointer is None:
            return None
        return self._image(name, pointer.get("digest", ""))

    def by_digest(self, digest: str) -> Environment | None:
        """The environment with this digest when its image and root are here (name: the
        first name pointing at it, else the digest itself)."""
        if digest == DEFAULT.digest:
            return DEFAULT
        names = [env.name for env in self.list() if env.digest == digest]
        return self._image(names[0] if names else digest, digest)

    def list(self) -> list[Environment]:
        """Every named environment, DEFAULT first, then by name."""
        found: list[Environment] = [DEFAULT]
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(self.names.iterdir()):
                if entry.suffix == ".json" and NAME.match(entry.stem):
                    env = self.get(entry.stem)
                    if env is not None:
                        found.append(env)
        return found

    def _image(self, name: str, digest: str) -> Environment | None:
        if not DIGEST.match(digest):
            return None
        config = _read_json(self.image_path(digest))
        if config is None or not DIGEST.match(config.get("root_digest", "")):
            return None
        root = self.root_path(config["root_digest"])
        if not root.is_dir():
            return None
        return environment_from(name, digest, root, config)

    async def ensure(self, digest: str) -> Environment:
        """The environment with `digest`, fetched from the shared store when it is not here.
        Raises EnvironmentNotFoundError when neither has it."""
        env = self.by_digest(digest)
        if env is None and self.fetcher is not None and DIGEST.match(digest):
            if await self.fetcher.fetch(digest, self):
                env = self.by_digest(digest)
        if env is None:
            raise EnvironmentNotFoundError(
                f"environment {digest} is neither on this worker nor in the shared store: build "
                "or import it here (`srt-mcp-server env build|import`), or push it from a "
                "worker that has it (`srt-mcp-server env push NAME`)"
            )
        return env

    # -- writing -----------------------------------------------------------------------------

    def add_root(self, tree: Path, root_digest: str) -> Path:
        """Move a finished tree (under tmp/) into roots/ by its digest; when that root is
        already stored the tree is removed instead. Returns the stored root."""
        target = self.root_path(root_digest)
        if target.is_dir():
            remove_tree(tree)
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tree, target)
        except OSError:
            if not target.is_dir():
                raise
            remove_tree(tree)
        return target

    def add_image(self, digest: str, config: dict[str, Any]) -> None:
        _write_json(self.image_path(digest), config)

    def point(self, name: str, digest: str) -> None:
        """Make `name` point at `digest` (atomically: the previous one stays until now)."""
        check_name(name)
        if name == DEFAULT_NAME:
            raise EnvironmentsError("'default' is built in: choose another name")
        _write_json(self.names / f"{name}.json", {"digest": digest})

    def remove(self, name: str) -> bool:
        """Drop the name; the root and image stay until `collect` finds them unused."""
        if not NAME.match(name):  # (`../../x` would be a file outside names/)
            return False
        try:
            (self.names / f"{name}.json").unlink()
        except FileNotFoundError:
            return False
        return True

    def prune(self) -> int:
        """Drop the build cache of every step whose root no named environment has (the
        intermediate roots: a rebuild runs those steps again), then `collect`."""
        keep = {env.root_digest for env in self.list()[1:]}
        with contextlib.suppress(FileNotFoundError):
            for entry in self.cache.iterdir():
                digest = str((_read_json(entry) or {}).get("digest", ""))
                config = _read_json(self.image_path(digest)) if DIGEST.match(digest) else None
                if config is None or config.get("root_digest") not in keep:
                    entry.unlink(missing_ok=True)
        return self.collect()

    def collect(self) -> int:
        """Remove roots and images no name points at and no cache entry reaches. Returns
        the number of roots removed."""
        live = {env.digest for env in self.list()[1:]}
        with contextlib.suppress(FileNotFoundError):
            for entry in self.cache.iterdir():
                data = _read_json(entry) or {}
                if isinstance(data.get("digest"), str):
                    live.add(data["digest"])
        live_roots: set[str] = set()
        with contextlib.suppress(FileNotFoundError):
            for image in self.images.iterdir():
                digest = "sha256:" + image.stem
                config = _read_json(image) or {}
                if digest in live:
                    live_roots.add(str(config.get("root_digest", "")).removeprefix("sha256:"))
                else:
                    image.unlink(missing_ok=True)
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for root in self.roots.iterdir():
                if root.name not in live_roots:
                    remove_tree(root)
                    removed += 1
        return removed


def remove_tree(path: Path) -> None:
    """Remove a tree we made, including directories a build left without write permission."""
    if not path.exists() and not path.is_symlink():
        return

    def onerror(func: Any, name: str, exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(name), 0o700)
            func(name)

    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    for parent, dirs, _files in os.walk(path):  # a RUN step may leave 0500 directories
        for d in dirs:
            with contextlib.suppress(OSError):
                full = os.path.join(parent, d)
                if not os.path.islink(full):
                    os.chmod(full, 0o700)
    shutil.rmtree(path, onerror=onerror)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    temp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(temp, path)
