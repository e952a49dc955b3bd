"""The descriptors a sandbox starts with: the pipes between the server and bwrap (stdio, the
JSON status, the options), and the server's asyncio streams over its ends of them."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandbox_runtime.sandbox.process import close_streams

F_SETPIPE_SZ = 1031
PIPE_DEFAULT = 65536  # a pipe's size unless it is made bigger


@dataclass
class SandboxFds:
    """A sandbox's descriptors, as `sandbox_fds` makes them."""

    ours: list[int]  # the server's ends: [stdin_w,] stdout_r, stderr_r, status_r
    theirs: list[int]  # bwrap's fds 0..5 [, 6: the stub's command], the options' write end


def sandbox_fds(
    interactive: bool,
    seccomp: Path,
    options_size: int,
    command_r: int | None,
    give: Callable[[int], None],
) -> SandboxFds:
    """Make the fds a sandbox's bwrap starts with (see argv.SECCOMP_FD...): stdin (a pipe when
    `interactive`, else /dev/null), stdout, stderr, the seccomp program, the status pipe, the
    options pipe (big enough for `options_size` bytes: the spawner's write must not block),
    and `command_r` (consumed) as the stub's fd; `give` hands a stdio pipe end to the
    sandbox user. Raises OSError, having closed all it made and `command_r`."""
    ours: list[int] = []
    theirs: list[int] = []
    try:
        if interactive:
            stdin_r, stdin_w = os.pipe()
            ours.append(stdin_w)
            theirs.append(stdin_r)
            give(stdin_r)
        else:
            theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        for _ in range(2):  # stdout, stderr
            r, w = os.pipe()
            ours.append(r)
            theirs.append(w)
            give(w)
        theirs.append(os.open(seccomp, os.O_RDONLY | os.O_CLOEXEC))
        status_r, status_w = os.pipe()
        ours.append(status_r)
        theirs.append(status_w)
        args_r, args_w = os.pipe()
        theirs.append(args_r)
        if command_r is not None:
            theirs.append(command_r)
            command_r = None  # (closed with theirs from here)
        theirs.append(args_w)
        if options_size > PIPE_DEFAULT:  # all of it must fit: the spawner's write must not block
            fcntl.fcntl(args_w, F_SETPIPE_SZ, options_size)
    except BaseException:
        close_all(ours + theirs + ([command_r] if command_r is not None else []))
        raise
    return SandboxFds(ours, theirs)


def write_at_once(fd: int, payload: bytes) -> None:
    """Write all of `payload` into the empty pipe `fd` without blocking (made big enough for
    it first: the reader reads only once it is all there). Raises OSError (BlockingIOError:
    the pipe could not be made big enough)."""
    if len(payload) > PIPE_DEFAULT:
        fcntl.fcntl(fd, F_SETPIPE_SZ, len(payload))
    os.set_blocking(fd, False)
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view) :]


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# A sandbox's stdout, stderr and (interactive) stdin, as the server sees them.
Streams = tuple[asyncio.StreamReader, asyncio.StreamReader, asyncio.StreamWriter | None]


async def open_streams(stdout_r: int, stderr_r: int, stdin_w: int | None) -> Streams:
    """Streams over the server's ends of a sandbox's stdio pipes (the fds are consumed; on
    failure everything is closed)."""
    loop = asyncio.get_running_loop()
    # closefd=False: the transport closes the fd (libuv, under uvloop); uvloop then also
    # closes the file object it was given, expecting EBADF. A file object that owned the fd
    # would close that number a second time, and by then another thread (a ZeroMQ I/O
    # thread of an interpreter's client) may have been given it: that thread's fd would go.
    # (asyncio's own loop closes only the file object: there it must own the fd.)
    owns = not type(loop).__module__.startswith("uvloop")
    fds = [stdout_r, stderr_r, *([stdin_w] if stdin_w is not None else [])]
    files = [os.fdopen(fd, "rb" if i < 2 else "wb", 0, closefd=owns) for i, fd in enumerate(fds)]
    readers: list[asyncio.StreamReader] = []
    stdin: asyncio.StreamWriter | None = None
    try:
        for f in files[:2]:
            readers.append(await _reader(loop, f))
        if stdin_w is not None:
            stdin = await _writer(loop, files[2])
    except BaseException:
        close_streams(*readers, stdin)
        if owns:
            for f in files:  # (a file object a transport closed already is left as it is)
                f.close()
        else:
            close_all(fds[len(readers) + (1 if stdin is not None else 0) :])  # no transport's
        raise
    return readers[0], readers[1], stdin


async def _reader(loop: asyncio.AbstractEventLoop, pipe: object) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=256 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader


async def _writer(loop: asyncio.AbstractEventLoop, pipe: object) -> asyncio.StreamWriter:
    protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
    transport, _ = await loop.connect_write_pipe(lambda: protocol, pipe)
    return asyncio.StreamWriter(transport, protocol, None, loop)
