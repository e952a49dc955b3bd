"""Server-sent events read from raw bytes, bounded as they are read.

A remote server's reply stream is hostile input: a line or an event is never buffered past
the limit (the reader refuses the byte that would cross it, so an endless line costs the
limit, not the stream), and lines end only where SSE says they do (CRLF, LF or CR, as
bytes). Splitting decoded text on every Unicode line break would cut a JSON string that
holds a raw U+2028, U+2029 or U+0085, which JSON allows.
"""

from __future__ import annotations

import re

from sandbox_runtime.servers.instance import InstanceError

TERMINATOR = re.compile(rb"\r\n?|\n")
BOM = b"\xef\xbb\xbf"


class EventTooLargeError(InstanceError):
    """A line or an event of the stream crossed the reader's limit."""


class EventReader:
    """Feed it the stream's chunks; it returns each complete event's data (its `data:`
    lines joined by LF). Raises EventTooLargeError as soon as the current event (its lines
    so far plus the line being read) would pass `limit` bytes."""

    def __init__(self, limit: int, who: str = "the server") -> None:
        self.limit = limit
        self.who = who
        self._line = bytearray()
        self._data: list[bytes] = []
        self._size = 0  # the current event's complete lines, each counted with its LF
        self._after_cr = False  # the last chunk ended in CR: an LF first in the next is its
        self._first = True  # the stream's first line (a leading BOM is dropped)

    def feed(self, chunk: bytes) -> list[bytes]:
        events: list[bytes] = []
        start = 1 if self._after_cr and chunk[:1] == b"\n" else 0
        if chunk:
            self._after_cr = chunk[-1:] == b"\r"
        for end in TERMINATOR.finditer(chunk, start):
            self._take(chunk, start, end.start())
            event = self._line_done()
            if event is not None:
                events.append(event)
            start = end.end()
        self._take(chunk, start, len(chunk))
        return events

    def _take(self, chunk: bytes, start: int, stop: int) -> None:
        if self._size + len(self._line) + (stop - start) > self.limit:
            self._line.clear()
            self._data.clear()
            raise EventTooLargeError(
                f"{self.who} sent an event over {self.limit // 1024} KiB (max_message_kb)"
            )
        self._line += chunk[start:stop]

    def _line_done(self) -> bytes | None:
        line = bytes(self._line)
        self._line.clear()
        if self._first:
            self._first = False
            line = line.removeprefix(BOM)
        if not line:  # a blank line ends the event
            data, self._data, self._size = self._data, [], 0
            return b"\n".join(data) if data else None
        self._size += len(line) + 1
        if line.startswith(b":"):  # a comment
            return None
        field, _, value = line.partition(b":")
        if field == b"data":
            self._data.append(value.removeprefix(b" "))
        return None
