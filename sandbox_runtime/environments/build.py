"""Building an environment from a Dockerfile (the subset in dockerfile.py), step by step,
each step cached by (parent digest, instruction) -> digest.

Every step that changes the root works on a copy under `<environments>/tmp/` and stores the
result by its digest only when it succeeded and fits the size limit; the name is pointed at
the final digest last. A build that fails anywhere leaves the store as it was, and the
previous environment of that name in place.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import posixpath
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_runtime.environments import bootstrap
from sandbox_runtime.environments.digest import TreeTooLargeError, kernelspecs, summarize
from sandbox_runtime.environments.dockerfile import (
    DockerfileError,
    Instruction,
    exec_form,
    expand,
    pairs,
    parse,
)
from sandbox_runtime.environments.extract import neutralize
from sandbox_runtime.environments.run import (
    COPY_AT,
    TooLargeError,
    _too_large,
    make_dirs,
    run_step,
)
from sandbox_runtime.environments.store import (
    DEFAULT_NAME,
    Environment,
    EnvironmentsError,
    EnvironmentStore,
    _read_json,
    _write_json,
    check_name,
    remove_tree,
)
from sandbox_runtime.sandbox.egress_port import EgressGate
from sandbox_runtime.sandbox.host import WORKSPACE

Log = Callable[[str], None]
CONFIG_KEYS = ("root_digest", "env", "workdir", "user", "labels")


@dataclass
class BuildSettings:
    max_bytes: int
    timeout: float
    allow: str  # names RUN may reach (egress policy syntax)
    runtime_dir: Path  # the shared runtime, for FROM default
    allow_cidrs: str = ""  # and address ranges RUN may reach


@dataclass
class State:
    """What the build has made so far: an image (root + configuration)."""

    digest: str = ""
    config: dict[str, Any] = field(default_factory=dict)


class Builder:
    def __init__(
        self,
        store: EnvironmentStore,
        settings: BuildSettings,
        egress: EgressGate[Any] | None,
        log: Log,
    ) -> None:
        self.store = store
        self.settings = settings
        self.egress = egress
        self.log = log

    async def build(
        self, name: str, dockerfile: str, context: Path, *, source: str = "Dockerfile"
    ) -> Environment:
        """Build `dockerfile` (its text) with `context` for COPY; point `name` at the result.
        Raises DockerfileError, EnvironmentsError (and its RunStepError, TooLargeError...)."""
        check_name(name)
        if name == DEFAULT_NAME:
            raise EnvironmentsError("'default' is built in: choose another name")
        steps = parse(dockerfile, source)
        context = await asyncio.to_thread(context.resolve)
        state = State()
        started = time.monotonic()
        for number, ins in enumerate(steps, 1):
            t0 = time.monotonic()
            self.log(f"step {number}/{len(steps)}: {ins.text()[:200]}")
            state, cached = await self._step(ins, state, context)
            took = time.monotonic() - t0
            self.log(f"  -> {state.digest[:19]} ({'cached' if cached else f'{took:.1f} s'})")
        env = self.store.by_digest(state.digest)
        assert env is not None
        self.store.point(name, state.digest)
        self.log(f"built {name} {state.digest} ({env.size_bytes // 2**20} MiB, "
                 f"{time.monotonic() - started:.1f} s)")  # fmt: skip
        result = self.store.get(name)
        assert result is not None
        return result

    async def _step(self, ins: Instruction, state: State, context: Path) -> tuple[State, bool]:
        kw = ins.keyword
        config = dict(state.config)
        env = dict(config.get("env") or {})
        if kw == "ENV":
            config["env"] = {**env, **{k: expand(v, env) for k, v in pairs(ins).items()}}
            return self._configure(config), False
        if kw == "LABEL":
            config["labels"] = {**(config.get("labels") or {}), **pairs(ins)}
            return self._configure(config), False
        if kw == "USER":
            config["user"] = expand(ins.args.split()[0], env)
            return self._configure(config), False
        if kw == "WORKDIR":
            path = expand(ins.args.strip(), env)
            workdir = posixpath.normpath(posixpath.join(config.get("workdir") or "/", path))
            config["workdir"] = workdir
            tree = self.store.root_path(config["root_digest"])
            if (tree / workdir.lstrip("/")).is_dir():
                return self._configure(config), False
            # (a directory to make: a root-changing step like RUN mkdir)
        if kw == "FROM" and not ins.args.startswith("debian:") and ins.args != DEFAULT_NAME:
            parent = self.store.get(ins.args.split()[0])
            if parent is None or parent.root is None:
                raise DockerfileError(
                    f"line {ins.line}: FROM {ins.args}: no environment of that name here (FROM "
                    "debian:<suite>, FROM default, or a name `srt-mcp-server env list` shows)"
                )
            return State(
                parent.digest, _read_json(self.store.image_path(parent.digest)) or {}
            ), True
        key = self._cache_key(ins, state, context)
        hit = self._cached(key)
        if hit is not None:
            return hit, True
        new_state = await self._make(ins, state, config, context)
        _write_json(self.store.cache / f"{key}.json", {"digest": new_state.digest})
        return new_state, False

    def _configure(self, config: dict[str, Any]) -> State:
        digest = image_digest(config)
        self.store.add_image(digest, config)
        return State(digest, config)

    def _cached(self, key: str) -> State | None:
        data = _read_json(self.store.cache / f"{key}.json") or {}
        env = self.store.by_digest(str(data.get("digest", "")))
        if env is None:
            return None
        config = _read_json(self.store.image_path(env.digest)) or {}
        return State(env.digest, config)

    def _cache_key(self, ins: Instruction, state: State, context: Path) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([state.digest, ins.keyword, ins.args]).encode())
        if ins.keyword == "FROM" and ins.args.strip() == DEFAULT_NAME:
            record = self.settings.runtime_dir / "srt-runtime.json"
            h.update(record.read_bytes() if record.is_file() else b"")
            h.update(bootstrap.DEFAULT_BASE_VERSION.encode())
        if ins.keyword == "COPY":
            for source in copy_sources(ins, context)[0]:
                h.update(summarize(source).digest.encode() if source.is_dir() else b"")
                h.update(_file_bytes_digest(source).encode() if source.is_file() else b"")
        return h.hexdigest()

    async def _make(
        self, ins: Instruction, state: State, config: dict[str, Any], context: Path
    ) -> State:
        tmp = await asyncio.to_thread(self.store.work_dir, "build")
        tree = tmp / "root"
        try:
            if ins.keyword == "FROM":
                config = await self._from(ins, tree)
            else:
                parent = self.store.root_path(state.config["root_digest"])
                await asyncio.to_thread(
                    bootstrap.copy_tree, parent, tree, self.log, self.settings.timeout
                )
                if ins.keyword == "RUN":
                    await self._run(ins, tree, config)
                elif ins.keyword == "COPY":
                    await self._copy(ins, tree, context, config)
                elif ins.keyword == "WORKDIR":
                    make_dirs(tree, config["workdir"])
            return await asyncio.to_thread(self._finish, tree, config)
        finally:
            await asyncio.to_thread(remove_tree, tmp)

    async def _from(self, ins: Instruction, tree: Path) -> dict[str, Any]:
        base = ins.args.split()[0]
        config: dict[str, Any] = {"env": {}, "workdir": "/", "user": "root", "labels": {}}
        if base.startswith("debian:"):
            await asyncio.to_thread(
                bootstrap.debootstrap, base.split(":", 1)[1], tree, self.log,
                self.settings.timeout,
            )  # fmt: skip
            return config
        if base == DEFAULT_NAME:
            await asyncio.to_thread(
                bootstrap.default_base, tree, self.settings.runtime_dir, self.log,
                self.settings.timeout,
            )  # fmt: skip
            config["env"] = {"PATH": f"/{bootstrap.RUNTIME_AT}/bin:{PATH_DEFAULT}"}
            return config
        raise DockerfileError(f"line {ins.line}: FROM {base}: not a base")

    async def _run(self, ins: Instruction, tree: Path, config: dict[str, Any]) -> None:
        command = exec_form(ins.args) or ["/bin/sh", "-c", ins.args]
        await run_step(
            tree,
            command,
            env=dict(config.get("env") or {}),
            workdir=config.get("workdir") or "/",
            user=config.get("user") or "root",
            egress=self.egress,
            allow=self.settings.allow,
            allow_cidrs=self.settings.allow_cidrs,
            step_seconds=self.settings.timeout,
            max_bytes=self.settings.max_bytes,
            log=self.log,
        )

    async def _copy(
        self, ins: Instruction, tree: Path, context: Path, config: dict[str, Any]
    ) -> None:
        """COPY: the sources are staged outside the tree, then placed by `cp` inside the
        build sandbox, so links already in the tree resolve inside it (never on the host)."""
        sources, dest = copy_sources(ins, context)
        env = dict(config.get("env") or {})
        dest = os.path.join(config.get("workdir") or "/", expand(dest, env))
        stage = tree.parent / "copy"
        stage.mkdir()
        script = []
        for n, source in enumerate(sources):
            staged = stage / str(n)
            if source.is_dir():
                await asyncio.to_thread(shutil.copytree, source, staged, symlinks=True)
                script.append(f"mkdir -p {_q(dest)} && cp -a {COPY_AT}/{n}/. {_q(dest)}/")
            else:
                await asyncio.to_thread(shutil.copy2, source, staged, follow_symlinks=False)
                if dest.endswith("/") or len(sources) > 1:
                    target = os.path.join(dest, source.name)
                    script.append(f"mkdir -p {_q(dest)} && cp -a {COPY_AT}/{n} {_q(target)}")
                else:
                    parent = os.path.dirname(dest.rstrip("/")) or "/"
                    script.append(f"mkdir -p {_q(parent)} && cp -a {COPY_AT}/{n} {_q(dest)}")
        await run_step(
            tree, ["/bin/sh", "-c", " && ".join(script)], env={}, workdir="/", user="root",
            egress=None, allow="", step_seconds=self.settings.timeout,
            max_bytes=self.settings.max_bytes, log=self.log, copy_from=stage,
        )  # fmt: skip

    def _finish(self, tree: Path, config: dict[str, Any]) -> State:
        digest = finish_root(self.store, tree, config, self.settings.max_bytes, self.log)
        return State(digest, _read_json(self.store.image_path(digest)) or {})


def finish_root(
    store: EnvironmentStore, tree: Path, config: dict[str, Any], max_bytes: int, log: Log
) -> str:
    """Store a finished tree (neutralized, measured, digested) and its configuration; returns
    the environment's digest. Raises TooLargeError past `max_bytes`."""
    from sandbox_runtime.environments.run import clean_leftovers

    clean_leftovers(tree)
    changed = neutralize(tree)
    ensure_mount_points(tree)
    for what, count in sorted(changed.items()):
        log(f"  {what}: {count}")
    try:
        summary = summarize(tree, max_bytes)
    except TreeTooLargeError as exc:
        raise TooLargeError(_too_large(exc.size, exc.limit)) from None
    config = {
        **config,
        "root_digest": summary.digest,
        "size_bytes": summary.size_bytes,
        "kernelspecs": kernelspecs(tree),
        "created": time.time(),
    }
    os.chmod(tree, 0o755)
    store.add_root(tree, summary.digest)
    digest = image_digest(config)
    store.add_image(digest, config)
    return digest


PATH_DEFAULT = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# Directories every root has, so a sandbox can mount on them in a read-only root (an
# imported image may lack them; a directory there already, or a link, is left alone).
MOUNT_POINTS = {
    "proc": 0o555, "dev": 0o755, "sys": 0o555, "tmp": 0o1777, "run": 0o755, "etc": 0o755,
    "opt": 0o755, "root": 0o700, WORKSPACE.lstrip("/"): 0o755,
}  # fmt: skip


def ensure_mount_points(tree: Path) -> None:
    for name, mode in MOUNT_POINTS.items():
        path = tree / name
        if not path.exists() and not path.is_symlink():
            path.mkdir()
            os.chmod(path, mode)


def image_digest(config: dict[str, Any]) -> str:
    """The digest of an environment: its root's digest and what a sandbox is configured with."""
    core = {key: config.get(key) for key in CONFIG_KEYS}
    return "sha256:" + hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def copy_sources(ins: Instruction, context: Path) -> tuple[list[Path], str]:
    """COPY's sources (inside the build context: no `..` nor links out of it) and its
    destination. Raises DockerfileError."""
    words = exec_form(ins.args) or ins.args.split()
    words = [w for w in words if not w.startswith("--")]
    if len(words) < 2:
        raise DockerfileError(f"line {ins.line}: COPY needs a source and a destination")
    *names, dest = words
    sources = []
    for name in names:
        path = (context / name.lstrip("/")).resolve()
        if not path.is_relative_to(context):
            raise DockerfileError(
                f"line {ins.line}: COPY {name}: outside the build context {context}"
            )
        if not path.exists():
            raise DockerfileError(f"line {ins.line}: COPY {name}: not in the build context")
        if path.is_dir():
            for inner in path.rglob("*"):
                if inner.is_symlink() and not inner.resolve().is_relative_to(context):
                    raise DockerfileError(
                        f"line {ins.line}: COPY {name}: {inner.relative_to(context)} links "
                        "outside the build context"
                    )
        sources.append(path)
    return sources, dest


def _file_bytes_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _q(path: str) -> str:
    return shlex.quote(path)
