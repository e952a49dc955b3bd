"""Reading an execution's output a page at a time: the cursor, the bounds of a page."""

from __future__ import annotations

from dataclasses import dataclass

from sandbox_runtime.domain.models import ExecutionInfo, OutputEvent
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.execution.execution import Execution

MAX_EVENTS_PER_READ = 1000
# JSON bytes of events per page. A tool reply carries them twice (structured content, and its
# JSON text escaped once more: up to 3x in all) and the official MCP client refuses an SSE
# event over 1 MiB, so a page stays well below a third of that.
MAX_BYTES_PER_READ = 256 * 1024


@dataclass
class OutputPage:
    info: ExecutionInfo
    events: list[OutputEvent]
    next_cursor: int
    has_more: bool
    first_available: int


def checked_read(
    after: object, limit: object, wait: object, max_wait: float
) -> tuple[int, int, float]:
    """A read's cursor, page size and wait, bounded. Raises InvalidRequestError."""
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise InvalidRequestError("the cursor (after / last_event_id) must be an integer >= 0")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidRequestError("limit must be a positive integer")
    return after, min(limit, MAX_EVENTS_PER_READ), min(max(0.0, float(wait or 0)), max_wait)  # type: ignore[arg-type]


async def read_page(execution: Execution, after: int, limit: int, wait: float) -> OutputPage:
    """The events after the cursor (waiting up to `wait` seconds for the first new one)."""
    if wait:
        await execution.wait_for_events(after, wait)
    events, has_more = execution.events_after(after, limit, MAX_BYTES_PER_READ)
    next_cursor = events[-1].seq if events else max(after, execution.first_seq - 1)
    next_cursor = min(next_cursor, execution.info.last_seq)
    return OutputPage(
        info=execution.info,
        events=events,
        next_cursor=next_cursor,
        has_more=has_more,
        first_available=execution.first_seq,
    )
