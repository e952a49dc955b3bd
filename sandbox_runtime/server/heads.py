"""A deadline on every request's head: a connection that sends its request line and headers
too slowly (slowloris) is closed, on the public port and the cluster listener alike.

uvicorn bounds a head's size and times out idle kept-alive connections, but not a head that
trickles in: thousands of half-sent heads were held for minutes. This protocol (uvicorn's own,
httptools or h11) starts a clock when a connection opens or the next request's first bytes
arrive after a response, and closes the connection unless a whole head has come within
HEAD_TIMEOUT_SECONDS. Bodies have their own deadlines (the cluster listener's BODY_TIMEOUT).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

HEAD_TIMEOUT_SECONDS = 10.0  # a peer, nginx or a client sends its head at once


class HeadTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol with a deadline on each request's head."""

    head_timeout = HEAD_TIMEOUT_SECONDS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_of: Any = None  # the request (cycle) answered when the clock started

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_head_clock()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._between_requests():
            self._start_head_clock()
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._head_of:
            self._head_timer.cancel()  # a whole head came: its request is under way
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or bool(self.cycle.response_complete)

    def _start_head_clock(self) -> None:
        self._head_of = self.cycle
        self._head_timer = asyncio.get_running_loop().call_later(
            self.head_timeout, self._head_expired
        )

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.cycle is self._head_of and not self.transport.is_closing():
            self.transport.close()


# What a 401's status line says. httpx puts the reason phrase in its HTTPStatusError ("Client
# error '401 ...' for url ..."), and that error is all the 1.x Python client shows of a refused
# token: LangChain's adapters and pydantic-ai on it never read the body. uvicorn takes the
# phrase from a table per status code, so it is one for every 401 (the MCP endpoints', the
# metrics endpoint's): it says what any of them means.
REFUSED_PHRASE = b"Unauthorized: invalid token, or none (send Authorization: Bearer <token>)"


def say_why_in_401s() -> None:
    """Make uvicorn's status line of a 401 say what was wrong and how to fix it (any reason
    phrase is valid HTTP/1.1; clients must not act on it)."""
    from uvicorn.protocols.http import h11_impl

    h11_impl.STATUS_PHRASES[401] = REFUSED_PHRASE
    try:
        from uvicorn.protocols.http import httptools_impl
    except ImportError:  # (no httptools: uvicorn speaks h11)
        return
    httptools_impl.STATUS_LINE[401] = b"HTTP/1.1 401 " + REFUSED_PHRASE + b"\r\n"
