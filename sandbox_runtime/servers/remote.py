"""A remote Streamable HTTP MCP server, called on a principal's behalf: our token in (checked
at our endpoint), the entry's headers out (secrets resolved here, never shown).

One remote session per instance owner (as a stdio instance is one process), initialized on
first use. Replies come as a JSON body or an SSE stream; both are read with the same bounds
as a stdio instance's messages, and notifications on the stream go to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

import httpx2

from sandbox_runtime.servers.catalog import Entry, resolve_secret
from sandbox_runtime.servers.instance import (
    INITIALIZE,
    PROTOCOL_VERSION,
    START_TIMEOUT,
    InstanceError,
    LogSink,
    Notify,
    RemoteError,
    with_own_token,
)

MAX_IN_FLIGHT = 64


class RemoteInstance:
    """A session with a remote server; the same face as a stdio Instance."""

    def __init__(self, entry: Entry, log: LogSink, environ: Mapping[str, str] | None = None):
        self.name = entry.name
        self.url = entry.url
        self.max_message = entry.max_message_kb * 1024
        self.call_timeout = entry.call_timeout
        self.log = log
        self.headers = {k: resolve_secret(v, environ) for k, v in entry.headers.items()}
        self.headers["accept"] = "application/json, text/event-stream"
        self.headers["content-type"] = "application/json"
        self.http = httpx2.AsyncClient(timeout=httpx2.Timeout(entry.call_timeout, connect=10.0))
        self.session_id: str | None = None
        self.protocol = PROTOCOL_VERSION
        self.started_at = self.last_used = time.monotonic()
        self.ended: str | None = None
        self._ended = asyncio.Event()
        self._next_id = 0
        self._in_flight = 0

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
        self._in_flight += 1
        self.last_used = time.monotonic()
        try:
            async with asyncio.timeout(limit):
                return await self._post(message, request_id, listener)
        except TimeoutError:
            await self._cancel(request_id, "timed out")
            raise InstanceError(
                f"server {self.name} ({self.url}) did not answer {method} within {limit:g} s"
            ) from None
        except asyncio.CancelledError:
            await asyncio.shield(self._cancel(request_id, "cancelled by the client"))
            raise
        except httpx2.HTTPError as exc:
            raise InstanceError(f"server {self.name} ({self.url}): {exc}") from None
        finally:
            self._in_flight -= 1
            self.last_used = time.monotonic()

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        with contextlib.suppress(httpx2.HTTPError):
            message = {"jsonrpc": "2.0", "method": method, "params": params}
            response = await self.http.post(self.url, json=message, headers=self._headers())
            await response.aclose()

    async def _cancel(self, request_id: int, reason: str) -> None:
        if self.alive:
            await self.notify(
                "notifications/cancelled", {"requestId": request_id, "reason": reason}
            )

    def _headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.session_id is not None:
            headers["mcp-session-id"] = self.session_id
            headers["mcp-protocol-version"] = self.protocol
        return headers

    async def _post(
        self, message: dict[str, Any], request_id: int, listener: Notify | None
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
            if response.status_code >= 400:
                text = (await _read_capped(response, 2000, cut=True)).decode("utf-8", "replace")
                raise InstanceError(
                    f"server {self.name} ({self.url}) answered HTTP {response.status_code}: "
                    f"{text.strip()[:300]}"
                )
            if message["method"] == "initialize":
                self.session_id = response.headers.get("mcp-session-id")
            kind = response.headers.get("content-type", "").split(";")[0].strip()
            if kind == "application/json":
                answer = json.loads(await _read_capped(response, self.max_message))
                return self._result(answer, request_id)
            if kind == "text/event-stream":
                return await self._from_stream(response, request_id, listener)
            raise InstanceError(f"server {self.name} answered with {kind or 'no content type'}")
        finally:
            await response.aclose()

    async def _from_stream(
        self, response: httpx2.Response, request_id: int, listener: Notify | None
    ) -> dict[str, Any]:
        data: list[str] = []
        size = 0
        async for line in response.aiter_lines():
            size += len(line)
            if size > self.max_message:
                raise InstanceError(
                    f"server {self.name} sent an event over {self.max_message // 1024} KiB"
                )
            if line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
                continue
            if line or not data:
                continue
            event, data, size = "\n".join(data), [], 0
            try:
                message = json.loads(event)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            if message.get("id") == request_id and "method" not in message:
                return self._result(message, request_id)
            if "method" in message and "id" not in message and listener is not None:
                with contextlib.suppress(Exception):
                    await listener(message)
        raise InstanceError(f"server {self.name} ended its reply without an answer")

    def _result(self, answer: Any, request_id: int) -> dict[str, Any]:
        if not isinstance(answer, dict) or answer.get("id") != request_id:
            raise InstanceError(f"server {self.name} sent a malformed response")
        if isinstance(answer.get("error"), dict):
            raise RemoteError(answer["error"])
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
                    await self.http.delete(self.url, headers=self._headers())
        self._end("stopped")
        await self.http.aclose()


async def _read_capped(response: httpx2.Response, limit: int, cut: bool = False) -> bytes:
    """The body, at most `limit` bytes: cut there (`cut`), else refused."""
    out = bytearray()
    async for chunk in response.aiter_bytes():
        out += chunk
        if len(out) > limit:
            if cut:
                return bytes(out[:limit])
            raise InstanceError(f"a reply over {limit // 1024} KiB")
    return bytes(out)
