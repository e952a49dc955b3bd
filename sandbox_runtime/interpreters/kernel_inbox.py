"""What a kernel sent that the host holds: bounded, and only what a caller waits for.

Everything a kernel (code the server does not trust) sends is read at once, for its whole life.
Messages answering a request that is awaited (`want`) are queued raw, per channel, within
QUEUED_MAX_BYTES in all: decoded JSON may be twenty times larger, so a message is decoded only
when its taker takes it. Whatever answers nothing awaited (output of a cell that has returned,
messages with a made-up parent) is counted and dropped unparsed; a kernel that sends more of it
than UNSOLICITED_MAX_BYTES within UNSOLICITED_WINDOW is reported as flooding (its kernel stops
it: reading and dropping it costs the server CPU, and no program needs it). No process here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sandbox_runtime.interpreters.kernel_wire import DropNote, Message
from sandbox_runtime.supervisor import scoped

QUEUED_MAX_BYTES = 16 * 1024 * 1024  # messages of waiting requests not yet taken, all channels
UNSOLICITED_MAX_BYTES = 64 * 1024 * 1024
UNSOLICITED_WINDOW = 10.0
FLOODED = (
    f"the interpreter was stopped: it sent more than {UNSOLICITED_MAX_BYTES // 2**20} MiB of "
    f"messages outside its calls within {UNSOLICITED_WINDOW:g} s; its state is lost"
)
SIZE = "srt_size"  # (a taken message's cost, in the dict a kernel's next message is)
QUEUED_CHANNELS = ("iopub", "shell", "stdin")  # (control's answers are never awaited)

OnDropped = Callable[[str, int], None]  # (unsolicited | over_bound, bytes)
OnFlood = Callable[[int, float], None]  # (bytes outside calls, within seconds)
Queued = tuple[list[bytes], int, str]  # a waiting message: its frames, its cost, its parent


class Inbox:
    """The queues of one kernel's awaited answers, their bounds and the drop counts."""

    def __init__(self, on_dropped: OnDropped | None, on_flood: OnFlood) -> None:
        self.on_dropped = on_dropped
        self.on_flood = on_flood
        # Messages (with their size) answering requests in `wanted`, per channel.
        self.queues: dict[str, asyncio.Queue[Queued]] = {
            name: asyncio.Queue() for name in QUEUED_CHANNELS
        }
        self.wanted: set[str] = set()  # ids of the requests whose answers are awaited
        self.queued_bytes = 0
        self.dropped_bytes = 0  # answers dropped because the queues were full (QUEUED_MAX_BYTES)
        self._window_start = 0.0
        self._window_bytes = 0

    def want(self, msg_id: str) -> None:
        """Answers to request `msg_id` are awaited: queue them."""
        self.wanted.add(msg_id)

    def release(self, *msg_ids: str | None) -> None:
        """Requests no longer awaited: their answers still queued are dropped (they would
        hold the queue bound against the next request's)."""
        self.wanted.difference_update(msg_ids)
        queued = 0
        for queue in self.queues.values():
            kept = []
            while not queue.empty():
                item = queue.get_nowait()
                if item[2] in self.wanted:
                    kept.append(item)
                    queued += item[1]
            for item in kept:
                queue.put_nowait(item)
        self.queued_bytes = queued

    def clear(self) -> None:
        """Drop everything queued (the kernel is stopping: what waited for a call is not held
        on)."""
        for queue in self.queues.values():
            while not queue.empty():
                queue.get_nowait()
        self.queued_bytes = 0

    def offer(self, message: Message, parent: str | None) -> None:
        """A message from the kernel, whose parent request is `parent`: queued if that is
        awaited and the bound allows, else counted and dropped."""
        queue = self.queues.get(message.channel)
        if queue is None or parent is None or parent not in self.wanted:
            self.unsolicited(message.size)
            return
        if self.queued_bytes + message.size > QUEUED_MAX_BYTES:
            self.over_bound(message.size)
            return
        self.queued_bytes += message.size
        queue.put_nowait((message.frames, message.size, parent))

    def noted(self, note: DropNote) -> None:
        """The relay's note of a message it dropped: the note itself answers nothing; the
        message counts against its call if that is awaited."""
        self.unsolicited(note.cost)
        if note.parent is not None and note.parent in self.wanted:
            self.over_bound(note.size)
        else:
            self.unsolicited(note.size)

    def over_bound(self, size: int) -> None:
        self.dropped_bytes += size  # (the call reading them says so)
        if self.on_dropped is not None:
            self.on_dropped("over_bound", size)

    def unsolicited(self, size: int) -> None:
        """Count a dropped message that answered nothing awaited; report a flood."""
        if self.on_dropped is not None:
            self.on_dropped("unsolicited", size)
        now = time.monotonic()
        if now - self._window_start > UNSOLICITED_WINDOW:
            self._window_start, self._window_bytes = now, 0
        self._window_bytes += size
        if self._window_bytes > UNSOLICITED_MAX_BYTES:
            self.on_flood(self._window_bytes, now - self._window_start)

    async def take(
        self, channel: str, wait: float | None, alive: Callable[[], bool], died: asyncio.Event
    ) -> Queued | None:
        """The next queued message of a channel, within `wait` seconds (TimeoutError); None
        when the kernel is gone (`alive()` false with nothing queued, or `died` set)."""
        queue = self.queues[channel]
        if not queue.empty():  # (most messages: no futures, no wait)
            item = queue.get_nowait()
        else:
            if not alive():
                return None
            get = scoped(queue.get())
            dying: asyncio.Future[Any] = scoped(died.wait())
            try:
                done, _ = await asyncio.wait(
                    {get, dying}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
            except BaseException:  # (cancelled: a message the get took already is dropped)
                dying.cancel()
                if get.done() and not get.cancelled() and get.exception() is None:
                    self.queued_bytes -= get.result()[1]
                get.cancel()
                raise
            dying.cancel()
            if not get.done():
                get.cancel()  # a queue get: cancelling it loses nothing
            if get in done:
                item = get.result()
            elif dying in done:
                return None
            else:
                raise TimeoutError
        self.queued_bytes -= item[1]
        return item
