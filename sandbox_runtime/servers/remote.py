"""A remote Streamable HTTP MCP server, called on a principal's behalf: our token in (checked
at our endpoint), the entry's headers out (secrets resolved here, never shown).

One remote session per instance owner (as a stdio instance is one process), initialized on
first use. Replies come as a JSON body or an SSE stream; both are read as raw bytes with the
same bounds as a stdio instance's messages (an SSE line or event is refused as it crosses
them, see sse.py), and notifications on the stream go to the caller. Every wait on the remote
has a deadline; a cancellation is sent in the background, never holding the caller. Errors
show the URL as principals may see it (no user, password or query) and never a header's
value.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Mapping
from typing import Any

import httpx2

from sandbox_runtime.servers.catalog import Entry, resolve_secret, shown_url, url_secrets
from sandbox_runtime.servers.instance import (
    INITIALIZE,
    PROTOCOL_VERSION,
    START_TIMEOUT,
    InstanceError,
    Notify,
    RemoteError,
    with_own_token,
)
from sandbox_runtime.servers.log_sink import LogSink
from sandbox_runtime.servers.outbox import NOTIFY_FLUSH, Outbox
from sandbox_runtime.servers.sse import EventReader
from sandbox_runtime.supervisor import Supervisor

MAX_IN_FLIGHT = 64
# A notification (a cancellation, `initialized`) or the closing DELETE waits this long for
# the remote's answer's headers; the answer's body is never read.
NOTIFY_TIMEOUT = 5.0
MAX_ERROR_TEXT = 300  # characters of a remote's HTTP error body shown in an error
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


class RemoteInstance:
    """A session with a remote server; the same face as a stdio Instance."""

    def __init__(
        self,
        entry: Entry,
        log: LogSink,
        supervisor: Supervisor,
        environ: Mapping[str, str] | None = None,
    ):
        self.name = entry.name
        self.supervisor = supervisor
        self.url = entry.url
        self.shown = shown_url(entry.url)  # (what errors show)
        self.max_message = entry.max_message_kb * 1024
        self.call_timeout = entry.call_timeout
        self.log = log
        self.headers = {k: resolve_secret(v, environ) for k, v in entry.headers.items()}
        # Never shown in an error (the remote may echo them; httpx may quote them)
        self._hidden = [
            *(v for v in url_secrets(entry.url) if len(v) >= 4),
            *(v for v in self.headers.values() if len(v) >= 8),
        ]
        self.headers["accept"] = "application/json, text/event-stream"
        self.headers["content-type"] = "application/json"
        self.headers["accept-encoding"] = "identity"  # (bytes read are bytes held)
        self.http = httpx2.AsyncClient(timeout=httpx2.Timeout(entry.call_timeout, connect=10.0))
        self.session_id: str | None = None
        self.protocol = PROTOCOL_VERSION
        self.started_at = self.last_used = time.monotonic()
        self.ended: str | None = None
        self._ended = asyncio.Event()
        self._next_id = 0
        self._in_flight = 0
        self._background: set[asyncio.Task[None]] = set()

    @property
    def alive(self) -> bool:
        return self.ended is None

    @property
    def busy(self) -> int:
        return self._in_flight

    async def exited(self) -> str:
        await self._ended.wait()
        return self.ended or "stopped"

    async def initialize(self) -> None:
        result = await self.request(
            "initialize",
            dict(INITIALIZE),
            within=min(START_TIMEOUT, max(self.call_timeout, 5.0)),
        )
        version = result.get("protocolVersion")
        self.protocol = version if isinstance(version, str) else PROTOCOL_VERSION
        await self.notify("notifications/initialized", {})

    async def request(
        self,
        method: str,
        params: dict[str, Any] | None,
        *,
        listener: Notify | None = None,
        within: float | None = None,
    ) -> dict[str, Any]:
        if not self.alive:
            raise InstanceError(f"server {self.name}: {self.ended}")
        if self._in_flight >= MAX_IN_FLIGHT:
            raise InstanceError(f"server {self.name} has {MAX_IN_FLIGHT} requests waiting")
        self._next_id += 1
        request_id = self._next_id
        params = with_own_token(params, request_id if listener is not None else None)
        message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        limit = within if within is not None else self.call_timeout
        # (The caller's notifications wait in its own bounded queue: reading the remote's
        # stream never waits on a caller that does not read.)
        outbox = Outbox(listener) if listener is not None else None
        self._in_flight += 1
        self.last_used = time.monotonic()
        try:
            async with asyncio.timeout(limit):
                result = await self._post(message, request_id, outbox)
            if outbox is not None:  # (the caller's progress goes before its answer)
                await outbox.flush(NOTIFY_FLUSH)
            return result
        except TimeoutError:
            self._cancel(request_id, "timed out")
            raise InstanceError(
                f"server {self.name} ({self.shown}) did not answer {method} within {limit:g} s"
            ) from None
        except asyncio.CancelledError:
            self._cancel(request_id, "cancelled by the client")
            raise
        except httpx2.InvalidURL:  # (its text may quote a password's characters)
            raise InstanceError(f"server {self.name}: its URL does not parse") from None
        except httpx2.HTTPError as exc:
            raise InstanceError(
                f"server {self.name} ({self.shown}): {self._scrub(f'{type(exc).__name__}: {exc}')}"
            ) from None
        finally:
            if outbox is not None:
                outbox.close(self.name)
            self._in_flight -= 1
            self.last_used = time.monotonic()

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        """Best effort, within NOTIFY_TIMEOUT: the answer's status is all that is awaited."""
        message = {"jsonrpc": "2.0", "method": method, "params": params}
        body = json.dumps(message, separators=(",", ":")).encode()
        await self._send_only("POST", body)

    async def _send_only(self, method: str, body: bytes | None = None) -> None:
        with contextlib.suppress(Exception):  # (best effort: its failure is not the caller's)
            async with asyncio.timeout(NOTIFY_TIMEOUT):
                request = self.http.build_request(
                    method, self.url, content=body, headers=self._headers()
                )
                response = await self.http.send(request, stream=True)
                await response.aclose()  # (unread: whatever it sends is not held)

    def _cancel(self, request_id: int, reason: str) -> None:
        """Tell the remote, in the background: the caller is not held by a remote that
        does not answer (the notification has its own deadline)."""
        if not self.alive or len(self._background) >= MAX_IN_FLIGHT:
            return  # (best effort: past that many unanswered, the remote is not listening)
        params = {"requestId": request_id, "reason": reason}
        task = self.supervisor.spawn(
            f"server {self.name} cancel", self.notify("notifications/cancelled", params)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _scrub(self, text: str) -> str:
        """`text` without the URL's credentials and query, or a header's value."""
        for value in self._hidden:
            text = text.replace(value, "…")
        return URL_IN_TEXT.sub(lambda m: shown_url(m.group(0)), text)

    def _headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.session_id is not None:
            headers["mcp-session-id"] = self.session_id
            headers["mcp-protocol-version"] = self.protocol
        return headers

    async def _post(
        self, message: dict[str, Any], request_id: int, outbox: Outbox | None
    ) -> dict[str, Any]:
        body = json.dumps(message, separators=(",", ":")).encode()
        request = self.http.build_request("POST", self.url, content=body, headers=self._headers())
        response = await self.http.send(request, stream=True)
        try:
            if response.status_code == 404 and self.session_id is not None:
                self._end("stopped")  # (not a crash: the next call starts a new session)
                raise InstanceError(
                    f"server {self.name}: the remote server ended its session; retry"
                )
            encoding = response.headers.get("content-encoding", "").strip().lower() or "identity"
            if response.status_code >= 400:
                text = ""
                if encoding == "identity":
                    raw = await _read_capped(response, 2000, cut=True)
                    text = self._scrub(raw.decode("utf-8", "replace").strip())
                raise InstanceError(
                    f"server {self.name} ({self.shown}) answered HTTP {response.status_code}: "
                    f"{text[:MAX_ERROR_TEXT]}"
                )
            if encoding != "identity":  # (asked for identity: a decoded body is unbounded)
                raise InstanceError(
                    f"server {self.name} sent a {encoding[:40]}-encoded reply (asked for none)"
                )
            if message["method"] == "initialize":
                self.session_id = response.headers.get("mcp-session-id")
            kind = response.headers.get("content-type", "").split(";")[0].strip()
            if kind == "application/json":
                answer = _json(
                    await _read_capped(response, self.max_message, who=f"server {self.name}")
                )
                if answer is None:
                    raise InstanceError(f"server {self.name} sent a reply that is not JSON")
                return self._result(answer, request_id)
            if kind == "text/event-stream":
                return await self._from_stream(response, request_id, outbox)
            raise InstanceError(
                f"server {self.name} answered with {kind[:60] or 'no content type'}"
            )
        finally:
            await response.aclose()

    async def _from_stream(
        self, response: httpx2.Response, request_id: int, outbox: Outbox | None
    ) -> dict[str, Any]:
        events = EventReader(self.max_message, f"server {self.name}")
        async for chunk in response.aiter_raw():
            for event in events.feed(chunk):
                message = _json(event)
                if not isinstance(message, dict):
                    continue
                if message.get("id") == request_id and "method" not in message:
                    return self._result(message, request_id)
                if "method" in message and "id" not in message and outbox is not None:
                    outbox.put(message)
        raise InstanceError(f"server {self.name} ended its reply without an answer")

    def _result(self, answer: Any, request_id: int) -> dict[str, Any]:
        if not isinstance(answer, dict) or answer.get("id") != request_id:
            raise InstanceError(f"server {self.name} sent a malformed response")
        if isinstance(answer.get("error"), dict):
            error = dict(answer["error"])  # (its words may echo what it was sent: a key)
            if isinstance(error.get("message"), str):
                error["message"] = self._scrub(error["message"])
            if "data" in error:
                try:
                    error["data"] = json.loads(self._scrub(json.dumps(error["data"])))
                except (TypeError, ValueError, RecursionError):
                    del error["data"]
            raise RemoteError(error)
        if not isinstance(answer.get("result"), dict):
            raise InstanceError(f"server {self.name} sent a malformed response")
        return answer["result"]

    def _end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
        self._ended.set()

    async def aclose(self, grace: float = 1.0) -> None:
        if self.session_id is not None and self.ended is None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(grace):
                    await self._send_only("DELETE")
        self._end("stopped")
        for task in list(self._background):
            task.cancel()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(grace):
                await self.http.aclose()


async def _read_capped(
    response: httpx2.Response, limit: int, cut: bool = False, who: str = "the server"
) -> bytes:
    """The body, at most `limit` bytes: cut there (`cut`), else refused before it is held."""
    out = bytearray()
    async for chunk in response.aiter_raw():
        if len(out) + len(chunk) > limit:
            if cut:
                return bytes(out + chunk[: limit - len(out)])
            raise InstanceError(f"{who} sent a reply over {limit // 1024} KiB")
        out += chunk
    return bytes(out)


def _json(data: bytes) -> Any:
    """The JSON value in `data` (None: not JSON, or nested past the parser's depth)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None
