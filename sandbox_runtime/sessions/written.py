"""Read your writes across replicas: a call that started or waited for an execution answers
once what it did is in the shared store.

The mirror writes executions out behind the calls (sessions/mirror.py), a few milliseconds
later. A client whose next call reaches another replica (an api replica forwards to the
worker that ran it, and reads from the store) must find the execution there: without this it
could be told `execution ... not found` for the one it was just given, or read it running
after it was told completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.sessions.mirror import Mirror

RECHECK_SECONDS = 0.05  # a wait looks again at the store's state at least this often
WITHIN_SECONDS = 2.0  # the most a call waits for it (the store slow): then it answers


async def until_written(mirror: Mirror, execution: Execution, within: float) -> None:
    """Until a flush that began after now (so with `execution` as it is now) has succeeded,
    or the mirror has nothing of it left to write (written, or refused by the store).
    At once while the store is unreachable or writes are held: a slow store never holds calls
    long (at most `within` seconds), as before, only the read elsewhere may miss it. Woken by
    the end of each flush, and the flush loop does not pause for a batch to form meanwhile."""
    mirror.mark(execution)
    target = mirror.flushes.begun + 1  # (a flush takes every dirty execution as it begins)
    deadline = time.monotonic() + within
    while mirror.flushes.written < target and mirror.behind(execution.execution_id):
        left = deadline - time.monotonic()
        if left <= 0 or not mirror.connected or mirror.lapsed():
            return
        ended = mirror.flushes.next_end()
        mirror.flushes.hurry()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ended.wait(), min(left, RECHECK_SECONDS))
