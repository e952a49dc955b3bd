"""When the mirror's writes end, for a call that waits on one (sessions/written.py).

A waiting call also cuts short the pause between flushes (FLUSH_INTERVAL, which lets batches
form while output streams): it wants the write now, not after the next batch has formed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Flushes:
    def __init__(self) -> None:
        self._ended = asyncio.Event()
        self._hurry = asyncio.Event()

    async def around(self, write: Awaitable[T]) -> T:
        """Await one flush's write; whatever its outcome, wake those waiting for its end (they
        run once the flush's bookkeeping, which does not await, is done)."""
        try:
            return await write
        finally:
            ended, self._ended = self._ended, asyncio.Event()
            ended.set()

    def next_end(self) -> asyncio.Event:
        """Set when the write in progress, or else the next one, ends."""
        return self._ended

    def hurry(self) -> None:
        self._hurry.set()

    async def pause(self, seconds: float) -> None:
        """The pause between flushes: `seconds`, or none when a call waits for a write."""
        if not self._hurry.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), seconds)
        self._hurry.clear()
