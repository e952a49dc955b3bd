"""An instance's stdin (servers/stdin.py) and a caller's notifications (servers/outbox.py) on
real pipes nobody reads, and callers that never take what they are given: what the host holds
stays bounded and nothing waits past its deadline."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp_harness import eventually

from sandbox_runtime.servers.outbox import MAX_QUEUED_NOTIFICATIONS, Outbox
from sandbox_runtime.servers.stdin import SIDE_QUEUE_BYTES, Stdin
from sandbox_runtime.supervisor import Supervisor

pytestmark = pytest.mark.integration


class Pipe:
    """A real pipe whose write end is an asyncio StreamWriter (as an instance's stdin is)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> asyncio.StreamWriter:
        loop = asyncio.get_running_loop()
        protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
        pipe = os.fdopen(self.write_fd, "wb", buffering=0)
        transport, _ = await loop.connect_write_pipe(lambda: protocol, pipe)
        self.writer = asyncio.StreamWriter(transport, protocol, None, loop)
        return self.writer

    def read_all(self) -> int:
        os.set_blocking(self.read_fd, False)
        taken = 0
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 16)
            except BlockingIOError:
                return taken
            taken += len(chunk)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
        os.close(self.read_fd)


@pytest.fixture
async def pipe() -> AsyncIterator[Pipe]:
    pipe = Pipe()
    try:
        yield pipe
    finally:
        pipe.close()


async def test_unread_input_is_bounded_and_ends_the_server(pipe: Pipe) -> None:
    supervisor, ended, notes = Supervisor(), [], []
    stdin = Stdin(await pipe.open(), "t", 1.0, supervisor, ended.append, notes.append)
    try:
        # A caller's 400 KB message to a server that reads nothing: its deadline ends it.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await stdin.write(b"x" * 400_000 + b"\n")
        held = stdin.unread
        assert 0 < held <= 400_001, held
        # The host's own messages past the bound are dropped, never queued.
        for _ in range(10_000):
            stdin.post(b'{"jsonrpc":"2.0","id":1,"result":{}}\n')
        assert stdin.unread <= held + SIDE_QUEUE_BYTES, (held, stdin.unread)
        assert stdin.dropped > 9_000 and len(notes) == 1, (stdin.dropped, notes)
        # The next caller's write waits for what came before it, within its own deadline.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await stdin.write(b"y\n")
        await eventually(lambda: ended, 5, "the end of a server that does not read")
        assert ended == ["it did not read its input within 1 s"], ended
    finally:
        stdin.close()
        await supervisor.aclose()


async def test_input_a_server_reads_ends_nothing(pipe: Pipe) -> None:
    supervisor, ended = Supervisor(), []
    stdin = Stdin(await pipe.open(), "t", 1.0, supervisor, ended.append, lambda _: None)
    try:
        write = asyncio.ensure_future(stdin.write(b"x" * 400_000 + b"\n"))
        taken = 0

        def reads() -> bool:  # (a reader taking a pipe's worth at a time)
            nonlocal taken
            taken += pipe.read_all()
            return write.done()

        await eventually(reads, 5, "the write", interval=0.01)
        await write
        stdin.post(b"z" * 100_000)  # (more than SIDE_QUEUE_BYTES at once: dropped whole)
        stdin.post(b"ping answer\n")
        await eventually(lambda: stdin.unread == 0, 5, "the answer taken")
        assert taken + pipe.read_all() == 400_001 + len(b"ping answer\n")
        assert ended == [] and stdin.dropped == 1
    finally:
        stdin.close()
        await supervisor.aclose()


async def test_a_caller_that_never_takes_its_notifications_holds_a_bounded_queue() -> None:
    taken: list[Any] = []
    blocked = asyncio.Event()

    async def never_done(message: dict[str, Any]) -> None:
        taken.append(message)
        await blocked.wait()  # (a stream nobody reads)

    outbox = Outbox(never_done)
    for n in range(10_000):
        outbox.put({"n": n})  # never waits
    await outbox.flush(0.2)  # (bounded: returns though nothing more is taken)
    assert len(taken) == 1 and outbox.queue.qsize() == MAX_QUEUED_NOTIFICATIONS - 1
    assert outbox.dropped == 10_000 - MAX_QUEUED_NOTIFICATIONS
    # (The oldest waiting were dropped for the newer: what is kept is the newest.)
    assert taken[0] == {"n": 10_000 - MAX_QUEUED_NOTIFICATIONS}, taken
    outbox.close("t")
    blocked.set()
