"""Which environment a session's sandboxes run on (DESIGN §21): named by a call's `image`,
allowed per principal by the operator, fixed when the session's first sandbox starts.

The choice is recorded on the session's home (`<state_dir>/session-environments/`, root's,
by workspace name: never in the workspace, which the sandbox may write; not beside the
environments, which several servers may share) as the environment's
name and content digest; snapshots carry it (snapshots/service.py), so a session restored on
another replica goes on on the same environment, fetched there by digest when missing
(EnvironmentStore.ensure). A later call naming another environment is refused: the session
keeps its files and its interpreters' state on the one it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.config.parsing import environments_allow as parse_allow
from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.environments.sharing import SharedFetcher
from sandbox_runtime.environments.store import (
    DEFAULT,
    DEFAULT_NAME,
    Environment,
    EnvironmentsError,
    EnvironmentStore,
)
from sandbox_runtime.errors import InvalidRequestError, SandboxUnavailableError
from sandbox_runtime.sandbox.spec import ImageRoot


class SnapshotHooks(Protocol):
    """What the snapshot service offers here (snapshots/service.py; a layer above)."""

    store: Any
    environment_of: Callable[[Owner], dict[str, str] | None]
    adopt_environment: Callable[[Owner, Any], None]


def session_images(settings: Settings) -> SessionImages:
    """The sessions' environments under `settings`. Raises ValueError (a wrong
    SANDBOX_ENVIRONMENTS_ALLOW: the server does not start)."""
    return SessionImages(
        EnvironmentStore(settings.environments_path()),
        parse_allow(settings.environments_allow),
        settings.state_dir / "session-environments",
    )


def image_of(env: Environment) -> ImageRoot | None:
    """The backend's view of `env` (None: the default root)."""
    if env.root is None:
        return None
    return ImageRoot(env.name, env.digest, env.root, tuple(env.env.items()), env.workdir, env.user)


class SessionImages:
    """The environments of this replica's sessions."""

    def __init__(self, store: EnvironmentStore, allow: dict[str, set[str]], records: Path) -> None:
        self.store = store
        self.allow = allow
        self.records = records
        self._known: dict[str, dict[str, str]] = {}
        self._found: dict[str, Environment] = {}  # by digest (a stored one never changes)

    def attach(self, snapshots: SnapshotHooks, max_mb: int) -> None:
        """A session's environment travels with its snapshots (recorded in each, adopted by
        the session one is restored into), and is fetched by digest from the shared store
        where it is missing (environments/sharing.py)."""
        snapshots.environment_of = self.recorded
        snapshots.adopt_environment = self.adopt
        if snapshots.store is not None:
            self.store.fetcher = SharedFetcher(snapshots.store, max_mb * 2**20, logger.info)

    def allowed(self, principal: str, name: str) -> bool:
        """Whether `principal` may run on environment `name` (`default` always)."""
        if not self.allow or name == DEFAULT_NAME:
            return True
        names = self.allow.get(principal, self.allow.get("*", set()))
        return "*" in names or name in names

    def recorded(self, owner: Owner) -> dict[str, str] | None:
        """The session's environment ({name, digest}), if its first sandbox has started."""
        key = workspace_name(owner)
        if key not in self._known:
            with contextlib.suppress(OSError, ValueError):
                data = json.loads((self.records / f"{key}.json").read_text())
                if isinstance(data, dict) and {"name", "digest"} <= set(data):
                    self._known[key] = {"name": str(data["name"]), "digest": str(data["digest"])}
        return self._known.get(key)

    def adopt(self, owner: Owner, record: Any) -> None:
        """Record `record` (a snapshot's) as the session's environment: a restored session
        goes on on the environment it had. Nothing for a snapshot without one."""
        if isinstance(record, dict) and isinstance(record.get("digest"), str):
            self._write(owner, {"name": str(record.get("name", "")), "digest": record["digest"]})

    def forget(self, owner: Owner) -> None:
        """The session is gone (or starts afresh): its next sandbox chooses again."""
        key = workspace_name(owner)
        self._known.pop(key, None)
        (self.records / f"{key}.json").unlink(missing_ok=True)

    def _write(self, owner: Owner, record: dict[str, str]) -> None:
        """Record the session's environment: in memory, and on disk unless it is the default
        (a session without a record is on the default, so a new session on it writes nothing).
        A record that cannot be written (a full state filesystem) is kept in memory: the call
        goes on, and only a restart of this replica forgets it."""
        key = workspace_name(owner)
        self._known[key] = record
        if record["name"] == DEFAULT_NAME:
            return
        temp = self.records / f".{key}.{os.getpid()}"
        try:
            self.records.mkdir(mode=0o700, parents=True, exist_ok=True)
            temp.write_text(json.dumps(record))
            os.replace(temp, self.records / f"{key}.json")
        except OSError as exc:
            temp.unlink(missing_ok=True)
            logger.warning("session environment not recorded on disk session={}: {}", key, exc)

    async def for_call(self, owner: Owner, name: str | None) -> ImageRoot | None:
        """The root `owner`'s next sandbox runs on: the session's recorded environment, or
        the one `name`s (recorded now), or the default. Raises InvalidRequestError (unknown,
        not allowed, another than the session's), SandboxUnavailableError (the session's
        environment is neither here nor in the shared store)."""
        record = self.recorded(owner)
        if record is not None:
            if not self.allowed(owner.principal, record["name"]):
                # (the operator took it away since; or a snapshot of then was restored)
                raise InvalidRequestError(
                    f"this session runs on environment {record['name']!r}, which you may no "
                    "longer use (SANDBOX_ENVIRONMENTS_ALLOW): start a new session (another "
                    "session name) on one list_environments shows"
                )
            if name is not None and name != record["name"]:
                raise InvalidRequestError(
                    f"this session runs on environment {record['name']!r}, fixed when its first "
                    f"sandbox started; to use {name!r}, start a new session (another session "
                    f"name), or leave out `image` to go on on {record['name']!r}"
                )
            return image_of(await self._by_digest(record["digest"]))
        chosen = name or DEFAULT_NAME
        env: Environment | None = await asyncio.to_thread(self.store.get, chosen)
        if env is None or not self.allowed(owner.principal, chosen):
            names = [e.name for e in await asyncio.to_thread(self.store.list)]
            usable = [n for n in names if self.allowed(owner.principal, n)]
            raise InvalidRequestError(
                f"no environment {chosen!r} you may use; choose one of {', '.join(usable)} "
                "(list_environments describes them)"
            )
        self._write(owner, {"name": env.name, "digest": env.digest})
        return image_of(env)

    async def _by_digest(self, digest: str) -> Environment:
        if digest in self._found:
            return self._found[digest]
        try:
            env = await self.store.ensure(digest)
        except EnvironmentsError as exc:
            raise SandboxUnavailableError(f"this session's environment is missing: {exc}") from exc
        self._found[digest] = env
        return env

    def session_environment(self, owner: Owner) -> Environment | None:
        """The session's environment when it is not the default (None: the default, or not
        chosen yet). Raises SandboxUnavailableError when it is not on this replica (for_call
        brings it first)."""
        record = self.recorded(owner)
        if record is None or record["digest"] == DEFAULT.digest:
            return None
        env = self._found.get(record["digest"]) or self.store.by_digest(record["digest"])
        if env is None:
            raise SandboxUnavailableError(
                f"this session's environment {record['name']!r} is not on this replica: "
                "retry the call (it is fetched by the session's first call here)"
            )
        self._found[record["digest"]] = env
        return env

    def describe(self, principal: str, default_languages: list[str]) -> list[dict[str, Any]]:
        """The environments `principal` may use: name, description, languages (run_code's;
        the default's are the runtime's), size. (File work: call it from a thread.)"""
        return [
            {
                "name": e.name,
                "description": e.description,
                "languages": default_languages if e.is_default else e.languages,
                "size_mb": round(e.size_bytes / 2**20),
            }
            for e in self.store.list()
            if self.allowed(principal, e.name)
        ]
