"""The mirror's flushes as a call that waits on one sees them (sessions/written.py): how many
began and how many were written, and when each ends.

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
        self.begun = self.written = 0  # (counts of flushes)
        self._ended = asyncio.Event()
        self._hurry = asyncio.Event()

    async def around(self, write: Awaitable[T]) -> T:
        """Await one flush's write (its batch taken just before: no await since), counted as
        begun now and as written once it succeeds; whatever its outcome, wake those waiting
        for its end (they run once the flush's bookkeeping, which does not await, is done)."""
        self.begun = begun = self.begun + 1
        try:
            result = await write
            self.written = max(self.written, begun)
            return result
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
