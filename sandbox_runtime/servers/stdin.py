"""What the host writes to a hosted server instance's stdin, bounded in time and in bytes.

A caller's message (a request, a notification) is written under that caller's deadline, one at
a time: once what came before it is in the pipe, and then until it is in the pipe too. So at
most one message's bytes wait for the server, besides SIDE_QUEUE_BYTES of the host's own
messages (answers to the server's requests, cancellations), which never wait: past that bound
they are dropped. Bytes the server leaves unread for its call timeout end it, whoever waits on
them (nobody, for a cancelled call's or an answer's): a server that stops reading holds
nothing of the host's for longer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sandbox_runtime.supervisor import Supervisor

SIDE_QUEUE_BYTES = 64 * 1024


class Stdin:
    """An instance's stdin. `write` raises ConnectionError, OSError or RuntimeError when the
    pipe is closed; `on_unread(why)` is told when the server leaves input unread too long."""

    def __init__(
        self,
        stdin: asyncio.StreamWriter,
        name: str,
        unread_for: float,
        supervisor: Supervisor,
        on_unread: Callable[[str], None],
        note: Callable[[str], None],
    ) -> None:
        self.stdin = stdin
        self.name = name
        self.unread_for = unread_for
        self.supervisor = supervisor
        self.on_unread = on_unread
        self.note = note
        self.dropped = 0  # the host's own messages dropped
        self._lock = asyncio.Lock()
        self._writing = 0  # bytes of the caller's message being written
        self._watch: asyncio.Task[None] | None = None
        # drain() then waits until every byte is in the pipe: what the host still holds for
        # the server is exactly what it has not taken.
        stdin.transport.set_write_buffer_limits(high=0)

    @property
    def unread(self) -> int:
        """Bytes written that the server has not taken yet (beyond what its pipe holds)."""
        return self.stdin.transport.get_write_buffer_size()

    async def write(self, data: bytes, sent: Callable[[], None] | None = None) -> None:
        """Write a caller's message (`sent()` once it is handed over) and wait until it is in
        the pipe. Bound it by the caller's deadline."""
        async with self._lock:
            # What a cancelled write left goes first: at most one message's bytes wait.
            await self.stdin.drain()
            self._writing = len(data)
            try:
                self.stdin.write(data)
                if sent is not None:
                    sent()
                self._watch_unread()
                await self.stdin.drain()
            finally:
                self._writing = 0

    def post(self, data: bytes) -> None:
        """Write a message of the host's own without waiting, or drop it (the server leaves
        more than SIDE_QUEUE_BYTES of such unread besides the message being written)."""
        if self.unread - self._writing + len(data) > SIDE_QUEUE_BYTES:
            self.dropped += 1
            if self.dropped == 1:
                self.note("its input is not read: the host's answers and cancels are dropped")
            return
        self.stdin.write(data)
        self._watch_unread()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    def _watch_unread(self) -> None:
        if self.unread and (self._watch is None or self._watch.done()):
            self._watch = self.supervisor.spawn(f"server {self.name} stdin", self._taken())

    async def _taken(self) -> None:
        try:
            # (Again while more came before this task saw the pipe take the last of it.)
            while self.unread:
                async with asyncio.timeout(self.unread_for):
                    await self.stdin.drain()
        except TimeoutError:
            self.on_unread(f"it did not read its input within {self.unread_for:g} s")
        except (ConnectionError, RuntimeError, OSError):
            pass  # (it ended: its exit says how)
