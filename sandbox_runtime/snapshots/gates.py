"""Gates: while a session's workspace is being replaced (a restore), its calls wait, and a
snapshot taken across the replacement is not kept."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Gates:
    def __init__(self) -> None:
        self._open: dict[str, asyncio.Event] = {}
        self._replaced: dict[str, int] = {}  # name -> how many times a gate opened

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """While held, `settled(name)` waits: the workspace is being replaced."""
        while (other := self._open.get(name)) is not None:
            await other.wait()
        event = self._open[name] = asyncio.Event()
        if len(self._replaced) > 10_000:
            self._replaced.clear()
        self._replaced[name] = self._replaced.get(name, 0) + 1
        try:
            yield
        finally:
            del self._open[name]
            event.set()

    async def settled(self, name: str) -> None:
        while (event := self._open.get(name)) is not None:
            await event.wait()

    def is_open(self, name: str) -> bool:
        return name in self._open

    def replaced(self, name: str) -> int:
        """How many times the workspace began to be replaced (a change means: since then)."""
        return self._replaced.get(name, 0)
