"""What a hosted server's instance says to one caller while its request runs (progress, and
logging for an instance that is not shared): queued for that caller and delivered by a task of
its own, so the reader of the instance's output never waits on a caller, and a caller that
does not read its stream holds up no one else. Bounded: past MAX_QUEUED_NOTIFICATIONS waiting,
the oldest waiting is dropped for the new one and counted (each is a glimpse of progress, the
newest the truest; the answer always goes), as the cluster listener bounds progress lines
(sessions/listener.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from loguru import logger

from sandbox_runtime.supervisor import scoped

MAX_QUEUED_NOTIFICATIONS = 32
NOTIFY_FLUSH = 1.0  # seconds an answer waits for its caller's notifications to go before it

Notify = Callable[[dict[str, Any]], Awaitable[None]]


class Outbox:
    """One caller's notifications: `put` never waits; a task of its own (started by the
    first: most calls have none, and pay for no task) delivers them in order until `close`."""

    def __init__(self, listener: Notify) -> None:
        self.listener = listener
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(MAX_QUEUED_NOTIFICATIONS)
        self.dropped = 0
        self._task: asyncio.Future[None] | None = None

    def put(self, message: dict[str, Any]) -> None:
        if self.queue.full():
            self.queue.get_nowait()
            self.queue.task_done()
            self.dropped += 1
        self.queue.put_nowait(message)
        if self._task is None:
            self._task = scoped(self._deliver_all())

    async def flush(self, within: float) -> None:
        """Until what waits has been delivered, at most `within` seconds."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self.queue.join()

    def close(self, server: str) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.dropped:
            logger.info(
                "hosted server {}: {} notifications dropped for a caller that did not take them",
                server,
                self.dropped,
            )

    async def _deliver_all(self) -> None:
        while True:
            message = await self.queue.get()
            try:
                await self.listener(message)
            except Exception as exc:  # (a client gone: its notifications have nowhere to go)
                logger.debug("a hosted server's notification was not delivered: {}", exc)
            self.queue.task_done()
