"""`srt-mcp-server env …`: build, import, list, inspect, remove, push and fetch environments."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pwd
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from sandbox_runtime.config import Settings, cli_name
from sandbox_runtime.environments.build import Builder, BuildSettings
from sandbox_runtime.environments.store import (
    DEFAULT_NAME,
    Environment,
    EnvironmentsError,
    EnvironmentStore,
    remove_tree,
)

# A factory of the shared store (sharing.py's ArchiveStore) given the settings: the caller
# (the top-level cli) hands it in, since the snapshot stores live in a layer above.
SharedStoreFactory = Callable[[Settings], Any]


class UsageError(Exception):
    """The command line is wrong (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    prog = f"{cli_name()} env"
    parser = _Parser(prog=prog, description="Environments: read-only root filesystems that "
                     "sessions run on (docs/environments-build.md).")  # fmt: skip
    sub = parser.add_subparsers(dest="action", required=True, parser_class=_Parser)
    b = sub.add_parser("build", help="build NAME from a Dockerfile (the subset in the docs)")
    b.add_argument("name")
    b.add_argument("context", nargs="?", default=".", help="the build context (COPY's sources)")
    b.add_argument("-f", "--file", help="the Dockerfile (default CONTEXT/Dockerfile)")
    b.add_argument("--description", default=None)
    i = sub.add_parser("import", help="import NAME from an OCI archive or layout directory")
    i.add_argument("name")
    i.add_argument("image", help="a `docker save` tar, an OCI layout directory or its tar")
    i.add_argument("--description", default=None)
    sub.add_parser("list", help="the environments here").add_argument("--json", action="store_true")
    n = sub.add_parser("inspect", help="one environment's configuration")
    n.add_argument("name")
    r = sub.add_parser("rm", help="remove NAME (its root goes when nothing else uses it)")
    r.add_argument("name")
    sub.add_parser("prune", help="drop the cache of intermediate build steps and their roots")
    p = sub.add_parser("push", help="put NAME's root in the shared store (SANDBOX_SNAPSHOT_STORE)")
    p.add_argument("name")
    f = sub.add_parser("fetch", help="bring DIGEST from the shared store, optionally as NAME")
    f.add_argument("digest")
    f.add_argument("--name", default=None)
    return parser


def main(
    argv: Sequence[str],
    settings: Settings | None = None,
    shared: SharedStoreFactory | None = None,
) -> int:
    """Run `env ACTION …`. Returns the exit code (0 ok, 1 failed, 2 usage)."""
    try:
        args = build_parser().parse_args(list(argv))
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    settings = settings or Settings(**{})  # (from the environment and .env)
    store = EnvironmentStore(settings.environments_path())
    try:
        return ACTIONS[args.action](args, settings, store, shared)
    except EnvironmentsError as exc:
        print(f"env {args.action}: {exc}", file=sys.stderr)
        return 1


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _build(args: Any, settings: Settings, store: EnvironmentStore, _shared: Any) -> int:
    if os.geteuid() != 0:
        # (mmdebstrap's root mode and the build sandbox's uid map both need it)
        print(f"env build: run it as root (sudo {cli_name()} env build …)", file=sys.stderr)
        return 2
    context = Path(args.context)
    dockerfile = Path(args.file) if args.file else context / "Dockerfile"
    try:
        text = dockerfile.read_text()
    except OSError as exc:
        print(f"env build: cannot read {dockerfile}: {exc.strerror}", file=sys.stderr)
        return 2
    if not context.is_dir():
        print(f"env build: the build context {context} is not a directory", file=sys.stderr)
        return 2
    env = asyncio.run(_build_async(args.name, text, context, str(dockerfile), settings, store))
    if args.description is not None:
        _describe(store, env, args.description)
    print(env.digest)
    return 0


async def _build_async(
    name: str, text: str, context: Path, source: str, settings: Settings, store: EnvironmentStore
) -> Environment:
    from sandbox_runtime.egress.supervisor import EgressProxy

    build_settings = BuildSettings(
        max_bytes=settings.environment_max_mb * 2**20,
        timeout=float(settings.environment_build_timeout),
        allow=settings.environment_build_allow,
        allow_cidrs=settings.environment_build_allow_cidrs,
        runtime_dir=settings.runtime_path(),
    )
    egress = None
    # The proxy drops to `nobody` and makes its sockets here: a directory of its own in the
    # system's temporary directory, which that user can reach (a state directory may not be).
    holder = Path(tempfile.mkdtemp(prefix="srt-build-egress-"))
    os.chmod(holder, 0o711)
    base = holder / "egress"
    if build_settings.allow.strip():
        nobody = pwd.getpwnam("nobody")
        # (a build downloads what its packages weigh: the size limit bounds it, not egress's)
        egress_settings = dataclasses.replace(settings.egress_settings(), max_bytes=0)
        egress = EgressProxy(egress_settings, base, nobody.pw_uid, nobody.pw_gid)
        await egress.start()
        if egress.problem:
            raise EnvironmentsError(egress.problem)
    try:
        builder = Builder(store, build_settings, egress, _log)
        return await builder.build(name, text, context, source=source)
    finally:
        if egress is not None:
            await egress.aclose()
        await asyncio.to_thread(remove_tree, holder)


def _describe(store: EnvironmentStore, env: Environment, description: str) -> None:
    from sandbox_runtime.environments.store import _read_json

    config = _read_json(store.image_path(env.digest)) or {}
    config["description"] = description
    store.add_image(env.digest, config)  # (not part of the digest: a note, not content)


def _import(args: Any, settings: Settings, store: EnvironmentStore, _shared: Any) -> int:
    from sandbox_runtime.environments.oci import import_image

    started = time.monotonic()
    env = import_image(
        store, args.name, Path(args.image), settings.environment_max_mb * 2**20, _log
    )
    if args.description is not None:
        _describe(store, env, args.description)
    _log(f"imported {args.name} {env.digest} ({env.size_bytes // 2**20} MiB, "
         f"{time.monotonic() - started:.1f} s)")  # fmt: skip
    print(env.digest)
    return 0


def summary(env: Environment) -> dict[str, Any]:
    return {
        "name": env.name,
        "digest": env.digest,
        "languages": env.languages,
        "size_mb": round(env.size_bytes / 2**20, 1),
        "description": env.description,
    }


def _list(args: Any, _settings: Settings, store: EnvironmentStore, _shared: Any) -> int:
    envs = store.list()
    if args.json:
        print(json.dumps([summary(env) for env in envs], indent=1))
        return 0
    for env in envs:
        langs = ",".join(env.languages) or ("python,javascript,bash" if env.is_default else "-")
        size = "host" if env.is_default else f"{env.size_bytes / 2**20:.0f} MiB"
        print(f"{env.name:<20} {env.digest[:19]:<20} {size:>9}  {langs}  {env.description}")
    return 0


def _inspect(args: Any, _settings: Settings, store: EnvironmentStore, _shared: Any) -> int:
    env = store.get(args.name)
    if env is None:
        print(
            f"env inspect: no environment {args.name!r} (`{cli_name()} env list`)", file=sys.stderr
        )
        return 1
    data = dataclasses.asdict(env)
    data["root"] = str(env.root) if env.root is not None else None
    print(json.dumps(data, indent=1, sort_keys=True))
    return 0


def _rm(args: Any, _settings: Settings, store: EnvironmentStore, _shared: Any) -> int:
    if args.name == DEFAULT_NAME:
        print("env rm: 'default' is built in", file=sys.stderr)
        return 1
    if not store.remove(args.name):
        print(f"env rm: no environment {args.name!r} (`{cli_name()} env list`)", file=sys.stderr)
        return 1
    removed = store.collect()
    _log(f"removed {args.name} ({removed} unused root(s) deleted)")
    return 0


def _prune(_args: Any, _settings: Settings, store: EnvironmentStore, _shared: Any) -> int:
    _log(f"pruned the build cache: {store.prune()} root(s) deleted")
    return 0


def _push(args: Any, settings: Settings, store: EnvironmentStore, shared: Any) -> int:
    from sandbox_runtime.environments.sharing import push

    env = store.get(args.name)
    if env is None or env.is_default:
        print(f"env push: no environment {args.name!r} to push", file=sys.stderr)
        return 1
    if shared is None:
        print("env push: no shared store (SANDBOX_SNAPSHOT_STORE)", file=sys.stderr)
        return 1
    asyncio.run(push(store, env, shared(settings), _log))
    print(env.digest)
    return 0


def _fetch(args: Any, settings: Settings, store: EnvironmentStore, shared: Any) -> int:
    from sandbox_runtime.environments.sharing import SharedFetcher

    if shared is None:
        print("env fetch: no shared store (SANDBOX_SNAPSHOT_STORE)", file=sys.stderr)
        return 1
    store.fetcher = SharedFetcher(shared(settings), settings.environment_max_mb * 2**20, _log)
    env = asyncio.run(store.ensure(args.digest))
    if args.name:
        store.point(args.name, env.digest)
    print(env.digest)
    return 0


ACTIONS: dict[str, Callable[[Any, Settings, EnvironmentStore, Any], int]] = {
    "build": _build,
    "import": _import,
    "list": _list,
    "inspect": _inspect,
    "rm": _rm,
    "prune": _prune,
    "push": _push,
    "fetch": _fetch,
}
