"""The internal channel: HTTP calls from a replica to a session's home, on a listener of their own.

A forwarded call is one signed POST to `/cluster/v1/call` on the home's cluster address
(never the public port, so nothing of it is reachable through nginx). The home answers with
newline-delimited JSON as the operation runs: `{"progress": [seq, text]}` lines while it
waits, an empty line every KEEPALIVE_SECONDS (so a caller notices a home that froze), then
one answer, `{"result": ...}`, `{"error": ...}` or `{"not_home": ...}`, with a proof made
with the call's nonce (`answer_mac`: a replica that redirected the call through a forged
Redis record cannot forge the answer). A caller that goes away closes the connection, and
the home stops waiting for it (the execution itself runs on, as it does for a local caller
that disconnects). The listener checks a call's signature header before it reads the body,
and reads the body against a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx2
from loguru import logger
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_runtime.errors import OwnerUnavailableError, SandboxRuntimeError
from sandbox_runtime.sessions.control import raise_error_reply
from sandbox_runtime.sessions.operations import Progress
from sandbox_runtime.sessions.signing import (
    ClockSkewError,
    ClusterSigner,
    SignatureError,
    describe_skew,
    nonce_of,
)

CALL_PATH = "/cluster/v1/call"
SIGNATURE_HEADER = "x-srt-cluster-signature"
SKEW_REFUSAL = "clock-skew"  # a 403's body: `clock-skew <seconds the caller's clock is ahead>`
MAX_CALL_BYTES = 16 * 1024 * 1024  # a forwarded call carries one tool call's arguments
CONNECT_TIMEOUT = 2.0
BODY_TIMEOUT = 10.0
KEEPALIVE_SECONDS = 5.0
READ_TIMEOUT = 3 * KEEPALIVE_SECONDS  # a home silent this long is taken for frozen
POOL_TIMEOUT = 10.0
WAIT_SLACK_SECONDS = 30.0  # past the operation's own deadline, for the home to answer


class Served(Protocol):
    """What the cluster listener serves: the router's signer and its forwarded-call handler."""

    signer: ClusterSigner | None

    def serve_forwarded(
        self, call: dict[str, Any], progress: Progress | None
    ) -> Awaitable[dict[str, Any]]: ...


class HomeMovedError(SandboxRuntimeError):
    """The replica called is not (or no longer) the session's home: look it up again."""


class HomeUnreachableError(OwnerUnavailableError):
    """The home replica's cluster address refused or timed out before taking the call."""


class HomeFrozenError(OwnerUnavailableError):
    """The home took the call, then went silent (frozen, cut off): the outcome is unknown."""


class ClusterApp:
    """ASGI app of the cluster listener: signed forwarded calls only, everything else 404."""

    def __init__(
        self, served: Callable[[], Served], streams: dict[str, ASGIApp] | None = None
    ) -> None:
        self.served = served  # looked up per call: the router lives in the app's lifespan
        self.streams = streams or {}  # path prefix -> app checking its own signatures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        for prefix, app in self.streams.items():
            if scope["path"].startswith(prefix):
                await app(scope, receive, send)
                return
        if scope["path"] != CALL_PATH or scope["method"] != "POST":
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
        headers = dict(scope["headers"])
        header = headers.get(SIGNATURE_HEADER.encode(), b"").decode("latin-1") or None
        try:
            length = int(headers.get(b"content-length", b"-1"))
            served.signer.check_call_header(header)  # before reading anything more
        except ClockSkewError as exc:  # (told to the caller: it is not a wrong secret)
            logger.warning("cluster call refused: {}", exc)
            await _plain(send, 403, f"{SKEW_REFUSAL} {exc.skew:.3f}\n".encode())
            return
        except (SignatureError, ValueError) as exc:
            logger.warning("cluster call refused: {}", exc)
            await _plain(send, 403, b"forbidden\n")
            return
        if not 0 <= length <= MAX_CALL_BYTES:
            await _plain(send, 413, b"a Content-Length up to 16 MiB is required\n")
            return
        try:
            async with asyncio.timeout(BODY_TIMEOUT):
                body = await _read_body(receive, length)
        except TimeoutError:
            body = None
        if body is None:
            await _plain(send, 400, b"incomplete body\n")
            return
        try:
            nonce = served.signer.verify_call(header, CALL_PATH, body)
            call = json.loads(body)
            if not isinstance(call, dict):
                raise ValueError("not an object")
        except (SignatureError, ValueError) as exc:
            logger.warning("cluster call refused: {}", exc)
            await _plain(send, 403, b"forbidden\n")
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/x-ndjson")],
            }
        )
        lines: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def progress(seq: int, text: str) -> None:
            lines.put_nowait(_line({"progress": [seq, text]}))

        async def run() -> None:
            try:
                result = await served.serve_forwarded(
                    call, progress if call.get("progress") else None
                )
                reply: dict[str, Any] = {"result": result}
            except HomeMovedError as exc:
                reply = {"not_home": str(exc)}
            except SandboxRuntimeError as exc:
                reply = {"error": {"error": type(exc).__name__, "message": str(exc)}}
            except Exception as exc:  # the boundary of a forwarded call: answer, log once
                logger.exception("forwarded call failed")
                reply = {"error": {"error": "SandboxRuntimeError", "message": str(exc)}}
            answer = json.dumps(reply, ensure_ascii=False).encode()
            mac = served.signer.sign_answer(nonce, answer) if served.signer else ""
            lines.put_nowait(
                json.dumps({"answer": answer.decode(), "answer_mac": mac}).encode() + b"\n"
            )
            lines.put_nowait(None)

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        worker = asyncio.get_running_loop().create_task(run())
        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        try:
            while True:
                getter = asyncio.ensure_future(lines.get())
                done, _ = await asyncio.wait(
                    {getter, watcher},
                    timeout=KEEPALIVE_SECONDS,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:  # still working: tell the caller we are alive
                    getter.cancel()
                    await send({"type": "http.response.body", "body": b"\n", "more_body": True})
                    continue
                if getter not in done:  # the caller went away: stop serving it
                    getter.cancel()
                    break
                line = getter.result()
                if line is None:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    break
                await send({"type": "http.response.body", "body": line, "more_body": True})
        finally:
            for task in (worker, watcher):
                task.cancel()
            await asyncio.gather(worker, watcher, return_exceptions=True)


class ChannelClient:
    """Calls other replicas' cluster listeners over kept-alive HTTP connections."""

    def __init__(self, signer: ClusterSigner) -> None:
        self.signer = signer
        self.http = httpx2.AsyncClient(
            trust_env=False,  # never through a proxy from the environment
            timeout=httpx2.Timeout(
                READ_TIMEOUT, connect=CONNECT_TIMEOUT, write=BODY_TIMEOUT, pool=POOL_TIMEOUT
            ),
            limits=httpx2.Limits(max_connections=256, max_keepalive_connections=32),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def call(
        self,
        target: str,
        address: str,
        call: dict[str, Any],
        progress: Progress | None,
        wait_seconds: float,
    ) -> dict[str, Any]:
        """Run `call` on replica `target` at `address`; its result.

        Raises HomeMovedError (look the session up again), HomeUnreachableError (the call
        never reached it), OwnerUnavailableError (it failed mid-call) or the domain error the
        home answered with.
        """
        body = json.dumps({**call, "progress": progress is not None}).encode()
        signature = self.signer.sign_call(target, CALL_PATH, body)
        headers = {SIGNATURE_HEADER: signature, "content-type": "application/json"}
        url = f"http://{address}{CALL_PATH}"
        try:
            async with asyncio.timeout(wait_seconds + WAIT_SLACK_SECONDS):
                async with self.http.stream("POST", url, content=body, headers=headers) as resp:
                    if resp.status_code == 403 and (skew := await _refused_skew(resp)):
                        raise OwnerUnavailableError(
                            f"replica {target} refused a forwarded call: "
                            + describe_skew(skew, "this replica's", f"{target}'s")
                        )
                    if resp.status_code != 200:
                        raise OwnerUnavailableError(
                            f"replica {target} refused a forwarded call (HTTP "
                            f"{resp.status_code}): are both replicas given the same "
                            "SANDBOX_CLUSTER_SECRET?"
                        )
                    async for raw in resp.aiter_lines():
                        if not raw:
                            continue  # a keepalive
                        message = json.loads(raw)
                        if "progress" in message:
                            if progress is not None:
                                seq, text = message["progress"]
                                with contextlib.suppress(Exception):
                                    await progress(int(seq), str(text))
                            continue
                        return self._answer(target, nonce_of(signature), message)
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
            raise HomeUnreachableError(
                f"the session's home replica {target} ({address}) does not answer "
                f"({type(exc).__name__})"
            ) from exc
        except httpx2.PoolTimeout:
            raise OwnerUnavailableError(
                "too many calls are waiting on other replicas right now; retry shortly"
            ) from None
        except httpx2.ReadTimeout:
            raise HomeFrozenError(
                f"the session's home replica {target} stopped answering mid-call (no sign of "
                f"life for {READ_TIMEOUT:g} s); the call's outcome is unknown: check "
                "list_executions"
            ) from None
        except (ValueError, TypeError, KeyError) as exc:  # a garbled answer
            raise OwnerUnavailableError(
                f"replica {target} answered a forwarded call with something unreadable ({exc})"
            ) from None
        except httpx2.HTTPError as exc:
            raise OwnerUnavailableError(
                f"the call to the session's home replica {target} broke off "
                f"({type(exc).__name__}); the operation's outcome is unknown: check "
                "list_executions"
            ) from exc
        except TimeoutError:
            raise OwnerUnavailableError(
                f"the session's home replica {target} did not answer in time"
            ) from None
        raise OwnerUnavailableError(f"replica {target} ended a forwarded call without an answer")

    def _answer(self, target: str, nonce: str, message: dict[str, Any]) -> dict[str, Any]:
        """The result in a home's signed answer, or the error it answered with."""
        answer = str(message["answer"]).encode()
        try:
            self.signer.verify_answer(target, nonce, answer, str(message.get("answer_mac", "")))
        except SignatureError:
            raise OwnerUnavailableError(
                f"the answer from replica {target} carries no valid proof: the session's home "
                "record may have been tampered with; refusing it"
            ) from None
        reply = json.loads(answer)
        if "result" in reply:
            return dict(reply["result"])
        if "not_home" in reply:
            raise HomeMovedError(str(reply["not_home"]))
        error = reply.get("error")
        raise_error_reply(error if isinstance(error, dict) else {})
        raise AssertionError("unreachable")


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


async def _refused_skew(resp: httpx2.Response) -> float | None:
    """The clock skew a home gave as its reason to refuse a call (None: another reason)."""
    try:
        words = (await resp.aread())[:200].decode("ascii").split()
        if len(words) == 2 and words[0] == SKEW_REFUSAL:
            return float(words[1])
    except (UnicodeDecodeError, ValueError):
        pass
    return None


async def _plain(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
