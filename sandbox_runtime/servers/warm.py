"""Shared entries with `warm = 1`: their instance is started ahead of the first call, so no
call pays a cold start (a Python server's imports alone take most of a second).

It is started when the server starts, when the entry appears in the catalog (or changes),
and again after it ended unasked (a crash: once its backoff has passed). Bounded: one start
in flight per entry; each waits out its instance's backoff, so a server that keeps failing is
tried at most once per backoff (1 s doubling to 30 s) and once per sweep; a start never makes
room for itself (at SANDBOX_MAX_SERVER_INSTANCES it waits for a sweep that finds room, and
calls' own starts may still stop a warm instance that is idle); and none starts once the host
is closing. A warm instance is not stopped for being idle: that is what warm is for.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from loguru import logger

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.servers.catalog import Entry
from sandbox_runtime.servers.learned import SHARED, Key, owner_of
from sandbox_runtime.supervisor import Supervisor


def warm_key(entry: Entry) -> Key:
    return (owner_of(entry, SHARED, ""), entry.name)


class WarmStarts:
    """The starts ahead in flight, one per warm entry."""

    def __init__(
        self,
        supervisor: Supervisor,
        start: Callable[[Entry, Owner], Awaitable[Any]],
        wanted: Callable[[Key, Entry], bool],
        backoff: Callable[[Key], float],
    ) -> None:
        self.supervisor = supervisor
        self._start = start  # the host's start-or-get (under the instance's lock)
        self._wanted = wanted  # whether a start ahead may go now (not running, room left)
        self._backoff = backoff  # seconds the instance's crashes hold its next start back
        self._pending: dict[Key, asyncio.Task[None]] = {}
        self._closed = False

    def fill(self, entries: Iterable[Entry]) -> None:
        """Start ahead (in the background) each warm entry's instance that is not running."""
        if self._closed or self.supervisor.closed:
            return
        for entry in entries:
            if not entry.warm or entry.scope != "shared":
                continue
            key = warm_key(entry)
            if key in self._pending or not self._wanted(key, entry):
                continue
            task = self.supervisor.spawn(f"server {entry.name} warm start", self._warm(key, entry))
            self._pending[key] = task
            task.add_done_callback(functools.partial(self._done, key))

    def _done(self, key: Key, task: asyncio.Task[None]) -> None:
        if self._pending.get(key) is task:
            del self._pending[key]

    async def _warm(self, key: Key, entry: Entry) -> None:
        wait = self._backoff(key)
        if wait > 0:
            await asyncio.sleep(wait)
        if self._closed:
            return
        try:
            await self._start(entry, key[0])
        except (SandboxRuntimeError, OSError) as exc:
            # (The host kept the failure: its backoff holds the next try, from a sweep.)
            logger.warning("hosted server {} was not started ahead: {}", entry.name, exc)

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def aclose(self) -> None:
        """No more starts ahead; those in flight are cancelled and waited for."""
        self._closed = True
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
