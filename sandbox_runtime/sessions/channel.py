"""The cluster transport: every call from one replica to another, over one signed HTTP client.

Replicas reach each other only on their cluster listeners (listener.py; never the public
port, so nothing of it is reachable through nginx), through one `ChannelClient` (one pool of
kept-alive connections, one signer), for all three kinds of call:

- a session-bound operation forwarded to the session's home: a signed POST to CALL_PATH;
- stdin or cancel for an execution another replica runs (control.py): a signed POST to
  CONTROL_PATH on that replica;
- a file transfer through a signed URL of a session homed elsewhere (server/files_http.py):
  streamed to and from FILES_PREFIX on the home, its method and path signed.

A POST's answer is newline-delimited JSON as the operation runs: `{"progress": [seq, text]}`
lines while it waits, an empty line every KEEPALIVE_SECONDS (so a caller notices a replica
that froze), then one answer, `{"result": ...}`, `{"error": ...}` or `{"not_home": ...}`,
with a proof made with the call's nonce (`answer_mac`: a replica that redirected the call
through a forged Redis record cannot forge the answer). A caller that goes away closes the
connection, and the callee stops waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx2

from sandbox_runtime.errors import OwnerUnavailableError, SandboxRuntimeError
from sandbox_runtime.sessions.answers import raise_error_reply
from sandbox_runtime.sessions.operations import Progress
from sandbox_runtime.sessions.signing import (
    ClusterSigner,
    SignatureError,
    describe_skew,
    nonce_of,
)

CALL_PATH = "/cluster/v1/call"
CONTROL_PATH = "/cluster/v1/control"
FILES_PREFIX = "/cluster/v1/files/"
SIGNATURE_HEADER = "x-srt-cluster-signature"
SKEW_REFUSAL = "clock-skew"  # a 403's body: `clock-skew <seconds the caller's clock is ahead>`
RESTARTED_REFUSAL = "restarted"  # a 403's body: the proof named an earlier process of the callee
MAX_CALL_BYTES = 16 * 1024 * 1024  # a forwarded call carries one tool call's arguments
CONNECT_TIMEOUT = 2.0
BODY_TIMEOUT = 10.0
KEEPALIVE_SECONDS = 5.0
READ_TIMEOUT = 3 * KEEPALIVE_SECONDS  # a home silent this long is taken for frozen
POOL_TIMEOUT = 10.0
WAIT_SLACK_SECONDS = 30.0  # past the operation's own deadline, for the home to answer
# A file transfer: no keepalives in a file's bytes, so a longer silence is allowed.
STREAM_TIMEOUT = httpx2.Timeout(60.0, connect=CONNECT_TIMEOUT, pool=POOL_TIMEOUT)


class HomeMovedError(SandboxRuntimeError):
    """The replica called is not (or no longer) the session's home: look it up again."""


class HomeUnreachableError(OwnerUnavailableError):
    """The home replica's cluster address refused or timed out before taking the call."""


class _Unstarted(Exception):
    """The connection broke before the other replica's response began (see ChannelClient)."""


class HomeFrozenError(OwnerUnavailableError):
    """The home took the call, then went silent (frozen, cut off): the outcome is unknown."""


class ChannelClient:
    """Calls other replicas' cluster listeners over kept-alive HTTP connections."""

    def __init__(self, signer: ClusterSigner) -> None:
        self.signer = signer
        # Two pools on the one transport: a burst of forwarded file transfers must not keep
        # forwarded calls and control waiting for a connection, nor the other way round.
        self.http, self.files = (
            httpx2.AsyncClient(
                trust_env=False,  # never through a proxy from the environment
                timeout=httpx2.Timeout(
                    READ_TIMEOUT, connect=CONNECT_TIMEOUT, write=BODY_TIMEOUT, pool=POOL_TIMEOUT
                ),
                # An idle connection is closed here well before the listener's keep-alive
                # (75 s) ends it, so a call is never sent on one the other side is closing.
                limits=httpx2.Limits(
                    max_connections=256, max_keepalive_connections=32, keepalive_expiry=30.0
                ),
            )
            for _ in range(2)
        )

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.files.aclose()

    async def call(
        self,
        target: str,
        address: str,
        incarnation: str,
        call: dict[str, Any],
        progress: Progress | None,
        wait_seconds: float,
    ) -> dict[str, Any]:
        """Run `call` on replica `target` (its process `incarnation`) at `address`; its result.

        Raises HomeMovedError (look the session up again), HomeUnreachableError (the call
        never reached it), OwnerUnavailableError (it failed mid-call) or the domain error the
        home answered with.
        """
        reply = await self._post(
            (target, incarnation),
            address,
            CALL_PATH,
            {**call, "progress": progress is not None},
            progress,
            wait_seconds + WAIT_SLACK_SECONDS,
            f"the session's home replica {target}",
        )
        if "result" in reply:
            return dict(reply["result"])
        if "not_home" in reply:
            raise HomeMovedError(str(reply["not_home"]))
        error = reply.get("error")
        raise_error_reply(error if isinstance(error, dict) else {})
        raise AssertionError("unreachable")

    async def control(
        self,
        target: tuple[str, str],
        address: str,
        request: dict[str, Any],
        wait_seconds: float,
        who: str,
    ) -> dict[str, Any]:
        """Send a control request (control.py) to replica `target` (id, incarnation) at
        `address` and wait for
        its answer at most `wait_seconds`: `{"result": ...}` or `{"error": {...}}`.

        Raises OwnerUnavailableError (or a subclass) when no answer came: `who` names the
        replica in its message.
        """
        return await self._post(target, address, CONTROL_PATH, request, None, wait_seconds, who)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        target: str,
        incarnation: str,
        address: str,
        method: str,
        path: str,
        headers: dict[str, str],
        content: AsyncIterable[bytes] | None,
    ) -> AsyncIterator[httpx2.Response]:
        """A file transfer to replica `target`'s (process `incarnation`'s) `path` (under
        FILES_PREFIX), its method and path signed (the bytes are not: the transfer streams
        them). Yields the response, its body not read yet. Raises what httpx2 raises."""
        signed = {SIGNATURE_HEADER: self.signer.sign_call(target, incarnation, method, path, None)}
        # The path is decoded: encoded again, a name with %, ? or # reaches the home as is.
        url = f"http://{address}{quote(path)}"
        async with self.files.stream(
            method, url, headers={**headers, **signed}, content=content, timeout=STREAM_TIMEOUT
        ) as response:
            yield response

    async def _post(
        self,
        peer: tuple[str, str],
        address: str,
        path: str,
        call: dict[str, Any],
        progress: Progress | None,
        wait_seconds: float,
        who: str,
    ) -> dict[str, Any]:
        """POST `call` to `path` on replica `peer` (id, incarnation); its signed answer."""
        target = peer[0]
        body = json.dumps(call).encode()
        url = f"http://{address}{path}"
        try:
            async with asyncio.timeout(wait_seconds):
                try:
                    return await self._exchange(peer, url, path, body, progress)
                except _Unstarted:
                    # A kept-alive connection the other side closed as this call went out on
                    # it (a replica stopping closes its idle ones): no response began, and the
                    # listener begins it before it runs the call, so nothing ran. Once more,
                    # on a new connection, signed anew.
                    return await self._exchange(peer, url, path, body, progress)
        except _Unstarted as exc:
            raise OwnerUnavailableError(
                f"the call to {who} broke off before it began ({exc.__cause__!r}); retry shortly"
            ) from None
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
            raise HomeUnreachableError(
                f"{who} ({address}) does not answer ({type(exc).__name__})"
            ) from exc
        except httpx2.PoolTimeout:
            raise OwnerUnavailableError(
                "too many calls are waiting on other replicas right now; retry shortly"
            ) from None
        except httpx2.ReadTimeout:
            raise HomeFrozenError(
                f"{who} stopped answering mid-call (no sign of life for {READ_TIMEOUT:g} s); "
                "the call's outcome is unknown: check list_executions"
            ) from None
        except (ValueError, TypeError, KeyError) as exc:  # a garbled answer
            raise OwnerUnavailableError(
                f"replica {target} answered a forwarded call with something unreadable ({exc})"
            ) from None
        except httpx2.HTTPError as exc:
            raise OwnerUnavailableError(
                f"the call to {who} broke off ({type(exc).__name__}); the operation's outcome "
                "is unknown: check list_executions"
            ) from exc
        except TimeoutError:
            raise OwnerUnavailableError(
                f"{who} did not answer within {wait_seconds:g} s"
                if path == CONTROL_PATH
                else f"{who} did not answer in time"
            ) from None

    async def _exchange(
        self, peer: tuple[str, str], url: str, path: str, body: bytes, progress: Progress | None
    ) -> dict[str, Any]:
        """One signed POST and its answer. Raises _Unstarted when the connection broke before
        a response began, HomeMovedError (a forwarded call) or OwnerUnavailableError for a
        refusal, and what httpx2 raises."""
        target, incarnation = peer
        signature = self.signer.sign_call(target, incarnation, "POST", path, body)
        headers = {SIGNATURE_HEADER: signature, "content-type": "application/json"}
        async with contextlib.AsyncExitStack() as stack:
            try:
                resp = await stack.enter_async_context(
                    self.http.stream("POST", url, content=body, headers=headers)
                )
            except (httpx2.RemoteProtocolError, httpx2.ReadError, httpx2.WriteError) as exc:
                raise _Unstarted from exc
            refusal = await _refusal(resp) if resp.status_code == 403 else []
            if len(refusal) == 2 and refusal[0] == SKEW_REFUSAL:
                raise OwnerUnavailableError(
                    f"replica {target} refused a forwarded call: "
                    + describe_skew(float(refusal[1]), "this replica's", f"{target}'s")
                )
            if refusal == [RESTARTED_REFUSAL]:  # (the lookup was older than its process)
                restarted = f"replica {target} restarted since it was looked up"
                if path == CALL_PATH:
                    raise HomeMovedError(restarted)
                raise OwnerUnavailableError(f"{restarted}; retry")
            if resp.status_code != 200:
                raise OwnerUnavailableError(
                    f"replica {target} refused a forwarded call (HTTP {resp.status_code}): are "
                    "both replicas given the same SANDBOX_CLUSTER_SECRET?"
                )
            answer: dict[str, Any] | None = None
            # (Read to the body's end, which comes with the answer: a response left unread
            # closes its connection, and the next call would open another.)
            async for raw in resp.aiter_lines():
                if not raw:
                    continue  # a keepalive
                if answer is not None:
                    raise ValueError("more after the answer")
                message = json.loads(raw)
                if "progress" in message:
                    if progress is not None:
                        seq, text = message["progress"]
                        with contextlib.suppress(Exception):
                            await progress(int(seq), str(text))
                    continue
                answer = message
            if answer is None:
                raise OwnerUnavailableError(
                    f"replica {target} ended a forwarded call without an answer"
                )
            return self._answer(target, nonce_of(signature), answer)

    def _answer(self, target: str, nonce: str, message: dict[str, Any]) -> dict[str, Any]:
        """A replica's signed answer, once its proof is checked."""
        answer = str(message["answer"]).encode()
        try:
            self.signer.verify_answer(target, nonce, answer, str(message.get("answer_mac", "")))
        except SignatureError:
            raise OwnerUnavailableError(
                f"the answer from replica {target} carries no valid proof: the session's home "
                "record may have been tampered with; refusing it"
            ) from None
        reply = json.loads(answer)
        if not isinstance(reply, dict):
            raise ValueError("not an object")
        return reply


async def _refusal(resp: httpx2.Response) -> list[str]:
    """The words of a replica's reason to refuse a call ([]: none that could be read). A
    clock skew: [SKEW_REFUSAL, seconds]; an earlier process named: [RESTARTED_REFUSAL]."""
    try:
        words = (await resp.aread())[:200].decode("ascii").split()
        if len(words) == 2 and words[0] == SKEW_REFUSAL:
            float(words[1])
        return words
    except (UnicodeDecodeError, ValueError, httpx2.HTTPError):
        return []
