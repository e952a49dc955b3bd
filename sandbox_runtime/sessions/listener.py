"""The cluster listener's app: what other replicas call over the cluster transport (channel.py).

Two signed POSTs (a forwarded session-bound operation, CALL_PATH; stdin or cancel for an
execution running here, CONTROL_PATH) and the file transfers under FILES_PREFIX (their own
app checks their signatures); everything else is 404. A POST's head proof (signing.py: method,
path, time, nonce, Content-Length and this process's incarnation) is checked before any byte
of its body is read: without the secret nothing makes this replica read or hold a body (403,
and the connection is closed). A proof for an earlier process of this replica is 403
`restarted`, a clock too far off 403 `clock-skew N`. Then the body is bounded (MAX_CALL_BYTES),
waits for room among the bodies being read at once (MAX_BODY_BYTES_IN_FLIGHT), is read against
a deadline (BODY_TIMEOUT) and checked against its own proof. The nonce is remembered, so a
copy played again is refused. The answer streams as NDJSON (channel.py), a keepalive line
every KEEPALIVE_SECONDS, and ends with a signed answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from loguru import logger
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_runtime.errors import ExecutionNotFoundError, SandboxRuntimeError
from sandbox_runtime.sessions.answers import error_reply
from sandbox_runtime.sessions.channel import (
    BODY_TIMEOUT,
    CALL_PATH,
    CONTROL_PATH,
    KEEPALIVE_SECONDS,
    MAX_CALL_BYTES,
    RESTARTED_REFUSAL,
    SIGNATURE_HEADER,
    SKEW_REFUSAL,
    HomeMovedError,
)
from sandbox_runtime.sessions.control import ControlChannel
from sandbox_runtime.sessions.operations import Progress
from sandbox_runtime.sessions.signing import (
    ClockSkewError,
    ClusterSigner,
    SignatureError,
    StaleIncarnationError,
)
from sandbox_runtime.supervisor import scoped

PATHS = (CALL_PATH, CONTROL_PATH)
# Progress lines waiting for a caller that reads slowly: past this, new ones are dropped (each
# is a glimpse of output the caller can still read in full by polling; the answer always goes).
MAX_QUEUED_PROGRESS = 32
# Bytes of signed bodies read and held at once, across connections (a body waits for room up
# to ROOM_WAIT_SECONDS, then is refused 503): four calls of the largest size.
MAX_BODY_BYTES_IN_FLIGHT = 4 * MAX_CALL_BYTES
ROOM_WAIT_SECONDS = BODY_TIMEOUT  # (as long as a body being read may take)


class BodyBudget:
    """Bytes of bodies being read at once: a call holds its Content-Length while it reads."""

    def __init__(self, limit: int = MAX_BODY_BYTES_IN_FLIGHT) -> None:
        self.limit = limit
        self.held = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, size: int, wait_seconds: float) -> AsyncIterator[bool]:
        """Holds `size` bytes while inside; yields False (nothing held) if there was no room
        within `wait_seconds`."""
        async with self._changed:
            try:
                async with asyncio.timeout(wait_seconds):
                    await self._changed.wait_for(lambda: self.held + size <= self.limit)
            except TimeoutError:
                held = False
            else:
                held = True
                self.held += size
        try:
            yield held
        finally:
            if held:
                async with self._changed:
                    self.held -= size
                    self._changed.notify_all()


class Served(Protocol):
    """What the cluster listener serves: the router's signer, its forwarded-call handler and
    its control of the executions running here (None: no shared store, none to control)."""

    signer: ClusterSigner | None
    control: ControlChannel | None

    def serve_forwarded(
        self, call: dict[str, Any], progress: Progress | None
    ) -> Awaitable[dict[str, Any]]: ...


class ClusterApp:
    """ASGI app of the cluster listener: signed calls and control, file streams, else 404."""

    def __init__(
        self, served: Callable[[], Served], streams: dict[str, ASGIApp] | None = None
    ) -> None:
        self.served = served  # looked up per call: the router lives in the app's lifespan
        self.streams = streams or {}  # path prefix -> app checking its own signatures
        self.budget = BodyBudget()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        for prefix, app in self.streams.items():
            if scope["path"].startswith(prefix):
                await app(scope, receive, send)
                return
        path = scope["path"]
        if path not in PATHS or scope["method"] != "POST":
            await _plain(send, 404, b"not found\n")
            return
        try:
            served = self.served()
        except SandboxRuntimeError:  # starting or stopping
            await _plain(send, 503, b"not serving\n")
            return
        if served.signer is None:
            await _plain(send, 403, b"no cluster secret configured\n")
            return
        admitted = await self._admit(served, served.signer, scope, receive, send)
        if admitted is None:
            if path == CONTROL_PATH and served.control is not None:
                served.control.metrics.control_refused.inc()
            return
        nonce, call = admitted
        if path == CONTROL_PATH:
            await _answer(send, receive, served.signer, nonce, lambda _: _control(served, call))
        else:
            wants = bool(call.get("progress"))
            await _answer(
                send,
                receive,
                served.signer,
                nonce,
                lambda progress: served.serve_forwarded(call, progress if wants else None),
            )

    async def _admit(
        self, served: Served, signer: ClusterSigner, scope: Scope, receive: Receive, send: Send
    ) -> tuple[str, dict[str, Any]] | None:
        """The nonce and the call of a POST signed for this replica (None: refused, and the
        refusal sent). The head's proof is checked before any of the body is read."""
        headers = dict(scope["headers"])
        header = headers.get(SIGNATURE_HEADER.encode(), b"").decode("latin-1") or None
        try:
            length = int(headers.get(b"content-length", b"-1"))
        except ValueError:
            length = -1
        try:  # (-1, no Content-Length: no signed length is "-1")
            proof = signer.check_call_head(header, scope["method"], scope["path"], length)
        except StaleIncarnationError as exc:  # (genuine, made before this process began)
            logger.warning("cluster call refused: {}", exc)
            await _plain(send, 403, f"{RESTARTED_REFUSAL}\n".encode())
            return None
        except ClockSkewError as exc:  # (told to the caller: it is not a wrong secret)
            logger.warning("cluster call refused: {}", exc)
            await _plain(send, 403, f"{SKEW_REFUSAL} {exc.skew:.3f}\n".encode())
            return None
        except SignatureError as exc:
            logger.warning("cluster call refused: {}", exc)
            await _plain(send, 403, b"forbidden\n")
            return None
        if not 0 <= length <= MAX_CALL_BYTES:
            await _plain(send, 413, b"a Content-Length up to 16 MiB is required\n")
            return None
        async with self.budget.hold(length, ROOM_WAIT_SECONDS) as held:
            if not held:
                await _plain(send, 503, b"too many call bodies being read; retry\n")
                return None
            try:
                async with asyncio.timeout(BODY_TIMEOUT):
                    body = await _read_body(receive, length)
            except TimeoutError:
                body = None
            if body is None:
                await _plain(send, 400, b"incomplete body\n")
                return None
            try:
                signer.check_call_body(proof, body)
                call = json.loads(body)
                if not isinstance(call, dict):
                    raise ValueError("not an object")
            except (SignatureError, ValueError) as exc:
                logger.warning("cluster call refused: {}", exc)
                await _plain(send, 403, b"forbidden\n")
                return None
        return proof.nonce, call


async def _control(served: Served, call: dict[str, Any]) -> dict[str, Any]:
    if served.control is None:  # (no shared store: no other replica sees its executions)
        raise ExecutionNotFoundError(f"execution {call.get('execution_id')} not found")
    return await served.control.serve(call)


async def _answer(
    send: Send,
    receive: Receive,
    signer: ClusterSigner,
    nonce: str,
    handler: Callable[[Progress], Awaitable[dict[str, Any]]],
) -> None:
    """Run `handler`, streaming its progress, keepalives and finally its signed answer; stop
    waiting for it if the caller goes away."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/x-ndjson")],
        }
    )
    # (line, whether it is the last): the answer ends the body in the same write, so the
    # caller reads the whole response with it and its connection is kept for the next call.
    lines: asyncio.Queue[tuple[bytes, bool]] = asyncio.Queue()

    async def progress(seq: int, text: str) -> None:
        if lines.qsize() < MAX_QUEUED_PROGRESS:
            lines.put_nowait((_line({"progress": [seq, text]}), False))

    async def run() -> None:
        try:
            reply: dict[str, Any] = {"result": await handler(progress)}
        except HomeMovedError as exc:
            reply = {"not_home": str(exc)}
        except SandboxRuntimeError as exc:
            reply = {"error": error_reply(exc)}
        except Exception as exc:  # the boundary of a forwarded call: answer, log once
            logger.exception("forwarded call failed")
            reply = {"error": {"error": "SandboxRuntimeError", "message": str(exc)}}
        answer = json.dumps(reply, ensure_ascii=False).encode()
        mac = signer.sign_answer(nonce, answer)
        lines.put_nowait(
            (json.dumps({"answer": answer.decode(), "answer_mac": mac}).encode() + b"\n", True)
        )

    async def watch_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    worker = scoped(run())
    watcher: asyncio.Future[Any] = scoped(watch_disconnect())
    try:
        while True:
            getter = scoped(lines.get())
            done, _ = await asyncio.wait(
                {getter, watcher}, timeout=KEEPALIVE_SECONDS, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:  # still working: tell the caller we are alive
                getter.cancel()
                await send({"type": "http.response.body", "body": b"\n", "more_body": True})
                continue
            if getter not in done:  # the caller went away: stop serving it
                getter.cancel()
                break
            line, last = getter.result()
            await send({"type": "http.response.body", "body": line, "more_body": not last})
            if last:
                break
    finally:
        for task in (worker, watcher):
            task.cancel()
        await asyncio.gather(worker, watcher, return_exceptions=True)


def _line(message: dict[str, Any]) -> bytes:  # progress lines (unsigned: output only)
    return json.dumps(message, ensure_ascii=False).encode() + b"\n"


async def _read_body(receive: Receive, length: int) -> bytes | None:
    """Exactly `length` bytes of body (None: more, fewer, or the client left)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > length:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks) if size == length else None


async def _plain(send: Send, status: int, body: bytes) -> None:
    """A short refusal; the connection is closed after it (a body left unread goes nowhere)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
