"""E2B sandboxes' lives over our sessions: create, find, end (kill or timeout), pause, resume.

Ending a sandbox runs `end_session` on its session's home (the router finds it from any
replica): its running executions are cancelled, its interpreters stopped, its workspace
removed. A pause is a snapshot of the workspace (not of memory: processes and interpreter
state do not survive it) taken on the home, then the session is ended; a resume restores the
snapshot into the session. Timeouts are swept every second by every replica: with Redis, the
replica that takes a sandbox out of `e2b:ends` first ends it (or pauses it: autoPause).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from loguru import logger

from sandbox_runtime.e2b.sandboxes import (
    MAX_METADATA,
    MAX_VALUE_CHARS,
    E2BSandbox,
    MemorySandboxStore,
    RedisSandboxStore,
    SandboxStore,
    new_sandbox_id,
    valid_sandbox_id,
)
from sandbox_runtime.errors import InvalidRequestError, LimitExceededError

MAX_TIMEOUT_SECONDS = 24 * 3600
DEFAULT_TIMEOUT_SECONDS = 300
SWEEP_INTERVAL = 1.0
TRANSITION_SECONDS = 600  # a pause's or resume's claim lapses after this (a replica died)
TRANSITION_WAIT = 120.0  # how long a request waits for another's pause or resume


def store_for(services: Any) -> SandboxStore:
    """The records' store: the cluster's Redis if there is one, else memory."""
    store = getattr(services.cluster, "store", None)
    redis = getattr(store, "redis", None)
    if redis is not None:
        return RedisSandboxStore(redis)
    return MemorySandboxStore()


def checked_timeout(value: object, default: int = DEFAULT_TIMEOUT_SECONDS) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError("timeout must be a whole number of seconds >= 0")
    if value > MAX_TIMEOUT_SECONDS:
        raise InvalidRequestError(f"timeout must be at most {MAX_TIMEOUT_SECONDS} seconds")
    return value


def checked_map(value: object, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise InvalidRequestError(f"{name} must be an object of at most {MAX_METADATA} entries")
    for k, v in value.items():
        if not isinstance(v, str) or len(k) > 256 or len(v) > MAX_VALUE_CHARS:
            raise InvalidRequestError(
                f"{name}: every value must be a string (keys up to 256, values up to "
                f"{MAX_VALUE_CHARS} characters)"
            )
    return dict(value)


class SandboxGoneError(Exception):
    """The sandbox was killed while a change of it was under way."""


class TransitionBusyError(LimitExceededError):
    """Another pause or resume of the sandbox did not end within TRANSITION_WAIT."""


class Sandboxes:
    """The E2B sandboxes of this deployment (records in `store`, sessions via the router)."""

    def __init__(self, services: Any, store: SandboxStore | None = None) -> None:
        self.services = services
        self.store = store or store_for(services)

    def start(self) -> None:
        self.services.supervisor.every("e2b sandbox timeouts", SWEEP_INTERVAL, self.sweep)

    async def create(
        self,
        principal: str,
        template: str,
        alias: str,
        seconds: int,
        metadata: dict[str, str],
        env_vars: dict[str, str],
        auto_pause: bool,
        allow_internet: bool = True,
    ) -> E2BSandbox:
        limit = self.services.settings.e2b_max_sandboxes
        now = time.time()
        sandbox = E2BSandbox(
            sandbox_id=new_sandbox_id(),
            principal=principal,
            template=template,
            alias=alias,
            access_token=secrets.token_urlsafe(24),
            traffic_token=secrets.token_urlsafe(24),
            started_at=now,
            end_at=now + seconds,
            timeout=seconds,
            metadata=metadata,
            env_vars=env_vars,
            auto_pause=auto_pause,
            allow_internet=allow_internet,
        )
        if not await self.store.add(sandbox, limit):
            raise LimitExceededError(
                f"this key already has {limit} sandboxes (running or paused; "
                "SANDBOX_E2B_MAX_SANDBOXES): kill one first"
            )
        return sandbox

    async def find(self, principal: str, sandbox_id: str) -> E2BSandbox | None:
        """The principal's sandbox `sandbox_id` (None: no such sandbox, or another's)."""
        if not valid_sandbox_id(sandbox_id):
            return None
        found = await self.store.get(sandbox_id)
        if found is None or found.principal != principal:
            return None
        if found.expired():
            await self._timed_out(found)
            return await self.find_live(sandbox_id, principal)
        return found

    async def find_live(self, sandbox_id: str, principal: str) -> E2BSandbox | None:
        found = await self.store.get(sandbox_id)
        return found if found is not None and found.principal == principal else None

    async def by_token(self, sandbox_id: str, token: str, traffic: str = "") -> E2BSandbox | None:
        """The sandbox whose envd access token is `token`, or (`traffic`, the code
        interpreter's port only) whose traffic access token is `traffic`. None for any
        mismatch: the same answer whether the sandbox exists or not."""
        if not valid_sandbox_id(sandbox_id):
            return None
        found = await self.store.get(sandbox_id)
        if found is None:
            return None
        access = _same(found.access_token, token)
        by_traffic = bool(found.traffic_token) and _same(found.traffic_token, traffic)
        if not (access or by_traffic):
            return None
        if found.expired():
            await self._timed_out(found)
            return await self.store.get(sandbox_id)
        return found

    async def with_traffic_token(self, sandbox: E2BSandbox) -> E2BSandbox:
        """The sandbox with a traffic access token (minted for a record an older server
        wrote, before it is handed out by connect)."""
        if not sandbox.traffic_token:
            sandbox.traffic_token = secrets.token_urlsafe(24)
            await self._replace(sandbox)
        return sandbox

    async def _replace(self, sandbox: E2BSandbox) -> None:
        """Write a changed record back, unless the sandbox was killed meanwhile (a kill is
        final: a pause, resume or timeout that was under way must not bring it back)."""
        if not await self.store.replace(sandbox):
            raise SandboxGoneError(sandbox.sandbox_id)

    @contextlib.asynccontextmanager
    async def transition(self, sandbox_id: str) -> AsyncIterator[None]:
        """One pause or resume of a sandbox at a time, across replicas: the next waits for
        it (and then reads the record again: two resumes restored the snapshot twice, the
        second over files written after the first)."""
        owner = secrets.token_hex(8)
        deadline = time.monotonic() + TRANSITION_WAIT
        while not await self.store.claim(sandbox_id, owner, TRANSITION_SECONDS):
            if time.monotonic() > deadline:
                raise TransitionBusyError(
                    f"a pause or resume of sandbox {sandbox_id} is still under way: retry shortly"
                )
            await asyncio.sleep(0.05)
        try:
            yield
        finally:
            await self.store.release(sandbox_id, owner)

    async def set_timeout(self, sandbox: E2BSandbox, seconds: int) -> None:
        sandbox.end_at = time.time() + seconds
        sandbox.timeout = seconds
        await self._replace(sandbox)

    async def kill(self, sandbox: E2BSandbox) -> bool:
        """End the sandbox: its record at once (nothing reaches it after this returns), then,
        in the background, its session's processes, interpreters and files. Whether this
        call ended it (false: already gone)."""
        removed = await self.store.delete(sandbox)
        if removed and sandbox.state == "running":
            self.services.supervisor.spawn(
                "end an e2b sandbox", self._end_session(sandbox.sandbox_id, sandbox.owner)
            )
        return removed

    async def _end_session(self, sandbox_id: str, owner: Any) -> None:
        try:
            await self.services.router.run(owner, "end_session", {})
        except Exception as exc:  # (its retention removes the workspace in the end)
            logger.warning("e2b sandbox {}: ending its session failed: {}", sandbox_id, exc)

    async def pause(self, sandbox: E2BSandbox) -> None:
        taken = await self.services.router.run(sandbox.owner, "snapshot", {})
        sandbox.snapshot_id = str(taken.get("snapshot_id") or taken.get("id") or "")
        await self.services.router.run(sandbox.owner, "end_session", {})
        sandbox.state = "paused"
        await self._replace(sandbox)  # (its snapshot, if killed meanwhile, ages out)

    async def resume(self, sandbox: E2BSandbox, seconds: int) -> None:
        if sandbox.snapshot_id:
            await self.services.router.run(
                sandbox.owner, "restore", {"snapshot_id": sandbox.snapshot_id}
            )
        sandbox.state = "running"
        sandbox.started_at = time.time()
        sandbox.end_at = time.time() + seconds
        sandbox.timeout = seconds
        try:
            await self._replace(sandbox)
        except SandboxGoneError:  # (killed while its files came back: they go again)
            await self._end_session(sandbox.sandbox_id, sandbox.owner)
            raise

    async def list(self, principal: str) -> list[E2BSandbox]:
        out = []
        for sandbox in await self.store.of_principal(principal):
            if sandbox.expired():
                await self._timed_out(sandbox)
                continue
            out.append(sandbox)
        return out

    async def sweep(self) -> None:
        """End (or pause: autoPause) the sandboxes whose time is up."""
        for sandbox in await self.store.expired(time.time(), 100):
            await self._timed_out(sandbox)

    async def _timed_out(self, sandbox: E2BSandbox) -> None:
        """End a sandbox whose time is up: paused (autoPause), or killed, also when its pause
        fails (a workspace too large to keep, a snapshot store down): a timeout always ends
        it, it does not run on while the pause is retried."""
        try:
            if sandbox.auto_pause and self.services.snapshots.enabled:
                try:
                    async with self.transition(sandbox.sandbox_id):
                        now = await self.store.get(sandbox.sandbox_id)
                        if now is None or not now.expired():  # (resumed, extended, ended)
                            return
                        sandbox = now
                        await self.pause(sandbox)
                except (SandboxGoneError, TransitionBusyError):  # (killed; another's resume)
                    return
                except Exception as exc:
                    logger.warning(
                        "e2b sandbox {}: its pause at its timeout failed, killed instead: {}",
                        sandbox.sandbox_id,
                        exc,
                    )
                    sandbox.state = "running"  # (its session is ended with it)
                    await self.kill(sandbox)
            else:
                await self.kill(sandbox)
            logger.info("e2b sandbox {} timed out", sandbox.sandbox_id)
        except Exception as exc:
            logger.warning(
                "e2b sandbox {}: ending it at its timeout failed: {}", sandbox.sandbox_id, exc
            )


def _same(known: str, offered: str) -> bool:
    """Whether `offered` is the token `known`, in constant time (an empty one never is)."""
    if not known or not offered:
        return False
    return secrets.compare_digest(known.encode(), offered.encode("utf-8", "surrogateescape"))
