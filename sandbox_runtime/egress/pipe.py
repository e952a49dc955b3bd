"""A proxied connection's bytes: copied both ways, bounded in time and in bytes.

The two directions and an idle watchdog run as tasks scoped to `pipe`: it returns once the
origin is done (nothing more can come back), a direction fails, or neither side has carried
anything for `idle` seconds, and it cancels and waits for whatever still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from sandbox_runtime.supervisor import scoped

CHUNK = 256 * 1024


async def pipe(
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    origin: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    *,
    idle: float,
    body_length: int | None,
    count: Callable[[int], bool],
    on_limit: Callable[[], None],
) -> None:
    """Copy both ways until both are done, a side is idle too long or the byte budget is
    spent: `count(n)` adds n bytes and says whether the budget still holds (if not,
    `on_limit()`, and that direction fails). `body_length` (plain HTTP): only that many bytes
    go from the sandbox out."""
    reader, writer = client
    out_reader, out_writer = origin
    last = [time.monotonic()]

    async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, limit: int | None) -> None:
        left = limit
        while left is None or left > 0:
            size = CHUNK if left is None else min(CHUNK, left)
            data = await src.read(size)
            if not data:
                break
            last[0] = time.monotonic()
            if not count(len(data)):
                on_limit()
                raise ConnectionAbortedError("byte limit")
            dst.write(data)
            await dst.drain()
            if left is not None:
                left -= len(data)
        # A plain HTTP request (`limit`) is whole at its length: no half-close after it, which
        # some servers and mirrors take for an aborted request and answer with a reset.
        with contextlib.suppress(OSError):
            if limit is None and dst.can_write_eof():
                dst.write_eof()

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(min(idle, 5.0))
            if time.monotonic() - last[0] > idle:
                return

    up = scoped(copy(reader, out_writer, body_length))
    down = scoped(copy(out_reader, writer, None))
    dog = scoped(watchdog())
    try:
        pending = {up, down}
        while pending:
            done, pending = await asyncio.wait(pending | {dog}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(dog)
            if dog in done:
                break
            if any(t.exception() is not None for t in done if not t.cancelled()):
                break
            if down in done:
                break  # the origin is done: nothing more can come back
    finally:
        for task in (up, down, dog):
            task.cancel()
        await asyncio.gather(up, down, dog, return_exceptions=True)
