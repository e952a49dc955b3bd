"""Legacy-era (2025) replies as plain JSON unless they need a stream.

The MCP library's legacy transport answers every POST of a session the same way, either as
an SSE stream or as a JSON body, fixed when the session is made. A stream costs the server a
task group and an event per reply, and the official client cannot reuse its connection after
one, so every call paid for a new TCP connection. Here each request is answered on its own
terms, as the 2026-07-28 era already does:

- a request that asks for progress (a `progressToken`) gets the stream, as before;
- any other gets a JSON body if its reply comes within `DEFER` seconds; past that the reply
  turns into a stream: a priming event (when an event store makes streams resumable), pings
  that keep proxies from closing an idle connection, then the reply as an SSE event. A
  client must accept both (the 406 for one that does not is unchanged).

Only our tools and the hosted servers' relay run behind this. None of our tools sends a
message about a request that asked for no progress (no logging, no server-to-client
requests), which is what makes a JSON body complete; the relay sends a hosted server's
logging of such a request on the session's standalone stream instead.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from typing import Any, cast

import anyio
import pydantic_core
from mcp.server.streamable_http import (
    MCP_PROTOCOL_VERSION_HEADER,
    MCP_SESSION_ID_HEADER,
    StreamableHTTPServerTransport,
    check_accept_headers,
)
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.requests import Request
from starlette.routing import BaseRoute
from starlette.types import Message, Receive, Scope, Send

from sandbox_runtime.supervisor import Supervisor

DEFER = 3.0  # seconds a reply may take and still come as a JSON body
PING = 15.0  # seconds between keep-alive comments on a reply that turned into a stream

# The task answering a request plainly. A task, not a flag: a context can outlive its request
# (uvicorn may start the next request's task from inside this one's `send`, copying its context),
# and only this task, not one that inherited its context, may see JSON mode.
_plain: contextvars.ContextVar[asyncio.Task[Any] | None] = contextvars.ContextVar(
    "srt_plain_reply", default=None
)


def answer_plainly_where_possible(routes: list[BaseRoute], supervisor: Supervisor) -> None:
    """Make the legacy sessions of the MCP app with these routes answer per request (its
    lifespan must be running: the session manager is made there). A reply that turns into a
    stream is written by a task of `supervisor`."""
    answer_plainly(_session_manager(routes), supervisor)


def answer_plainly(manager: StreamableHTTPSessionManager, supervisor: Supervisor) -> None:
    """Make the legacy sessions of `manager` answer per request."""
    admit = manager._admit_session

    def admit_session(requestor: Any) -> StreamableHTTPServerTransport | None:
        transport = admit(requestor)
        if transport is not None:
            transport.__class__ = PlainWhenQuick
            cast(PlainWhenQuick, transport).supervisor = supervisor
        return transport

    manager._admit_session = admit_session  # type: ignore[method-assign]


def _session_manager(routes: list[BaseRoute]) -> StreamableHTTPSessionManager:
    for route in routes:
        endpoint = getattr(route, "endpoint", None)
        for app in (endpoint, getattr(endpoint, "app", None)):
            manager = getattr(app, "session_manager", None)
            if isinstance(manager, StreamableHTTPSessionManager):
                return manager
    raise RuntimeError("the MCP app has no streamable HTTP session manager (is it running?)")


class PlainWhenQuick(StreamableHTTPServerTransport):
    """A legacy session's transport that picks JSON or SSE per request (module docstring)."""

    supervisor: Supervisor

    @property
    def is_json_response_enabled(self) -> bool:
        task = _plain.get()
        if task is None:
            return False
        try:
            return task is asyncio.current_task()
        except RuntimeError:  # (no running loop)
            return False

    @is_json_response_enabled.setter
    def is_json_response_enabled(self, value: bool) -> None:
        pass  # (chosen per request)

    async def _handle_post_request(
        self, scope: Scope, request: Request, receive: Receive, send: Send
    ) -> None:
        if not await _may_answer_plainly(request):
            await super()._handle_post_request(scope, request, receive, send)
            return
        reply = _DeferredReply(self, request, send)
        streaming: list[asyncio.Task[None]] = []

        def turn() -> None:
            streaming.append(self.supervisor.spawn("streamed legacy reply", reply.stream()))

        token = _plain.set(asyncio.current_task())
        # (a timer, not a task per request: most replies come long before it)
        timer = asyncio.get_running_loop().call_later(DEFER, turn)
        try:
            await super()._handle_post_request(scope, request, receive, reply.send)
        finally:
            _plain.reset(token)
            timer.cancel()
            for task in streaming:
                task.cancel()


async def _may_answer_plainly(request: Request) -> bool:
    """Whether the request may get a JSON body: the client takes both kinds of reply, and it
    is not a request that asked for progress (nor something unreadable: the library answers)."""
    has_json, has_sse = check_accept_headers(request)
    if not (has_json and has_sse):
        return False
    body = await request.body()  # (kept by the request: the library reads it again)
    if b'"progressToken"' not in body and b"\\u" not in body:
        return True  # (without escapes, a progress token would be spelled so)
    try:
        message = pydantic_core.from_json(body)
    except ValueError:
        return False
    if not isinstance(message, dict):
        return False
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return not (isinstance(meta, dict) and meta.get("progressToken") is not None)


class _DeferredReply:
    """The `send` of one request answered as JSON, unless `stream` turns it into an
    SSE stream first; then the JSON reply, when it comes, goes out as the stream's event."""

    def __init__(self, transport: StreamableHTTPServerTransport, request: Request, send: Send):
        self.transport = transport
        self.request = request
        self.downstream = send
        self.lock = anyio.Lock()
        self.started = False  # something was sent downstream
        self.streaming = False
        self.ended = False  # the stream's last part was sent

    async def _out(self, body: bytes, more: bool = True) -> None:
        self.ended = not more
        await self.downstream({"type": "http.response.body", "body": body, "more_body": more})

    async def send(self, message: Message) -> None:
        async with self.lock:
            if not self.streaming:
                self.started = True
                await self.downstream(message)
                return
            if message["type"] != "http.response.body":
                return  # (the JSON reply's status line and headers: the stream has its own)
            if body := message.get("body", b""):
                await self._out(b"event: message\r\ndata: " + body + b"\r\n\r\n")
            if not message.get("more_body", False):
                await self._out(b"", more=False)

    async def stream(self) -> None:
        async with self.lock:
            if self.started:
                return
            self.streaming = True
            headers = [
                (b"content-type", b"text/event-stream"),
                (b"cache-control", b"no-cache, no-transform"),
                (b"x-accel-buffering", b"no"),
            ]
            if session_id := self.transport.mcp_session_id:
                headers.append((MCP_SESSION_ID_HEADER.encode(), session_id.encode()))
            await self.downstream(
                {"type": "http.response.start", "status": 200, "headers": headers}
            )
            if priming := await self._priming_event():
                await self._out(priming)
        while not self.ended:
            await anyio.sleep(PING)
            async with self.lock:
                if not self.ended:
                    await self._out(b": ping\r\n\r\n")

    async def _priming_event(self) -> bytes:
        """The stream's first event: an event id the client can resume after (with an event
        store; a stream without one cannot be resumed, as before)."""
        try:
            message = json.loads(await self.request.body())
            request_id = str(message["id"])
        except (ValueError, KeyError, TypeError):
            return b""
        version = self.request.headers.get(MCP_PROTOCOL_VERSION_HEADER, "")
        event = await self.transport._mint_priming_event(request_id, version)
        if event is None:
            return b""
        out = f"id: {event['id']}\r\ndata: \r\n"
        if "retry" in event:
            out += f"retry: {event['retry']}\r\n"
        return (out + "\r\n").encode()
