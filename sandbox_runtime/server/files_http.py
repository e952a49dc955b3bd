"""`/files/{token}/{name}`: plain HTTP transfers of workspace files through signed URLs.

GET (with one byte Range) and HEAD stream a file out; PUT streams a body into a new file
beside the target and renames it over the target at the end (bounded by
SANDBOX_MAX_UPLOAD_MB and the workspace's quota; an upload that fails or is cut off leaves
nothing). The token alone authorises the transfer: no bearer token, no cookies.

Downloads are attachments with `nosniff` and a `sandbox` Content-Security-Policy: HTML or SVG
that sandboxed code wrote never runs on this origin. Any replica answers: a URL of a session
homed elsewhere is streamed to and from the home's cluster listener by the cluster transport
(`ChannelClient.stream`, sessions/channel.py), its method and path signed with the cluster
secret (the file's bytes themselves are not signed between replicas: keep the cluster network
private, as DEPLOYMENT.md says).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import AsyncIterator, Callable
from email.utils import formatdate
from typing import Any
from urllib.parse import quote

import httpx2
from loguru import logger
from starlette.types import Receive, Scope, Send

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import (
    DiskFullError,
    FileAccessError,
    FileMissingError,
    InvalidRequestError,
    LimitExceededError,
    OwnerUnavailableError,
    PolicyViolationError,
    SandboxRuntimeError,
    WorkspaceFullError,
)
from sandbox_runtime.files.operations import mime_type_of
from sandbox_runtime.files.urls import FileGrant, FileUrlSigner, UrlRefusedError
from sandbox_runtime.sessions.channel import FILES_PREFIX, SIGNATURE_HEADER
from sandbox_runtime.sessions.router import Router
from sandbox_runtime.sessions.signing import SignatureError
from sandbox_runtime.supervisor import scoped
from sandbox_runtime.workspaces.fsops import CHUNK, Upload

PUBLIC_PREFIX = "/files/"
GRANT_KEY = "srt.file_grant"  # (read by server/audit_calls.py)
CLUSTER_PREFIX = FILES_PREFIX  # on the cluster listener: transfers forwarded by a replica
METHODS = ("GET", "HEAD", "PUT")
HOME_CHECK_SECONDS = 5.0  # asking the store, after an upload, whether this is still the home
# Types a browser could run as a document: always served as bytes.
ACTIVE_TYPES = re.compile(r"^(text/html|application/xhtml|image/svg|text/xml|application/xml)")
RANGE = re.compile(r"bytes=(\d*)-(\d*)")  # fullmatch
# Headers a forwarded transfer carries each way.
REQUEST_HEADERS = ("range", "content-length", "content-type", "if-none-match")
RESPONSE_HEADERS = (
    "content-type",
    "content-length",
    "content-range",
    "content-disposition",
    "accept-ranges",
    "etag",
    "last-modified",
    "cache-control",
)
STATIC_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"sandbox; default-src 'none'"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"private, no-store"),
]


class FilesApp:
    """ASGI app of `/files/...` (public port) and `/cluster/v1/files/...` (cluster port)."""

    def __init__(self, router: Callable[[], Router], signer: Callable[[], FileUrlSigner]) -> None:
        # Looked up per request: both live in the app's lifespan.
        self.router = router
        self.signer = signer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        from_peer = path.startswith(CLUSTER_PREFIX)
        rest = path[len(CLUSTER_PREFIX if from_peer else PUBLIC_PREFIX) :]
        token, _, name = rest.partition("/")
        method = scope["method"]
        if method not in METHODS:
            await _text(send, 405, "GET, HEAD or PUT\n", [(b"allow", b"GET, HEAD, PUT")])
            return
        try:
            router = self.router()
        except SandboxRuntimeError:
            await _text(send, 503, "starting or stopping\n")
            return
        if from_peer and not self._from_peer(router, scope):
            await _text(send, 403, "forbidden\n")
            return
        try:
            grant = self.signer().verify(token, method)
        except (UrlRefusedError, SandboxRuntimeError) as exc:
            await _text(send, 403, f"{exc}\n")
            return
        scope[GRANT_KEY] = grant  # (for its audit line: server/audit_calls.py)
        if name != grant.path.rsplit("/", 1)[-1]:  # (the ASGI path is already decoded)
            await _text(send, 404, "this URL names another file\n")
            return
        owner = Owner(grant.principal, grant.session_id)
        try:
            placement = await router.place(owner)
            if placement.reset is not None:  # the session's next tool call is told
                router.owe(owner, placement.reset)
            if not placement.local:
                if from_peer:  # the home moved since the caller looked: it looks again
                    await _text(send, 503, "not this session's home; retry\n")
                    return
                await self._forward(scope, receive, send, router, placement, path)
                return
            if method == "PUT":
                await self._put(scope, receive, send, router, owner, grant)
            else:
                await self._get(scope, receive, send, router, owner, grant, method == "HEAD")
        except SandboxRuntimeError as exc:
            await _text(send, _status(exc), f"{exc}\n")

    def _from_peer(self, router: Router, scope: Scope) -> bool:
        """Whether a cluster-port request carries a valid peer signature (over its path)."""
        if router.signer is None:
            return False
        header = dict(scope["headers"]).get(SIGNATURE_HEADER.encode(), b"").decode("latin-1")
        try:
            router.signer.check_call_head(header or None, scope["method"], scope["path"], None)
        except SignatureError as exc:
            logger.warning("cluster file transfer refused: {}", exc)
            return False
        return True

    # -- serving a session homed here ----------------------------------------------------------

    async def _get(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        router: Router,
        owner: Owner,
        grant: FileGrant,
        head: bool,
    ) -> None:
        workspaces = router.manager.workspaces
        name = workspace_name(owner)
        await workspaces.ensure(name, owner.principal)
        with workspaces.hold(name):
            fd, st = await asyncio.to_thread(workspaces.files(name).open_read, grant.path)
            try:
                size = st.st_size
                etag = f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"'
                mime = mime_type_of(grant.path)
                if ACTIVE_TYPES.match(mime):
                    mime = "application/octet-stream"
                headers = [
                    (b"content-type", mime.encode()),
                    (b"content-disposition", _disposition(grant.path)),
                    (b"accept-ranges", b"bytes"),
                    (b"etag", etag.encode()),
                    (b"last-modified", formatdate(st.st_mtime, usegmt=True).encode()),
                    *STATIC_HEADERS,
                ]
                request_headers = dict(scope["headers"])
                if request_headers.get(b"if-none-match", b"").decode("latin-1") == etag:
                    await _start(send, 304, headers)
                    await send({"type": "http.response.body", "body": b""})
                    return
                status, start, length = 200, 0, size
                wanted = request_headers.get(b"range", b"").decode("latin-1").strip()
                if wanted:
                    span = _range(wanted, size)
                    if span is None:
                        headers.append((b"content-range", f"bytes */{size}".encode()))
                        await _text(send, 416, "range not satisfiable\n", headers)
                        return
                    if span != (0, size):
                        start, length = span
                        status = 206
                        end = start + length - 1
                        headers.append((b"content-range", f"bytes {start}-{end}/{size}".encode()))
                headers.append((b"content-length", str(length).encode()))
                await _start(send, status, headers)
                if head:
                    await send({"type": "http.response.body", "body": b""})
                    return
                await _stream_file(fd, start, length, receive, send)
            finally:
                os.close(fd)

    async def _put(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        router: Router,
        owner: Owner,
        grant: FileGrant,
    ) -> None:
        settings = router.manager.settings
        limit = settings.upload_limit_bytes()
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _text(send, 413, f"uploads are limited to {limit} bytes\n")
            return
        workspaces = router.manager.workspaces
        name = workspace_name(owner)
        await workspaces.ensure(name, owner.principal)
        with workspaces.hold(name):
            free = workspaces.free_bytes(name)
            if declared is not None and free is not None and declared > free:
                raise WorkspaceFullError(
                    f"the workspace has {free} bytes free; this upload is {declared} bytes"
                )
            files = workspaces.files(name)
            upload: Upload = await asyncio.to_thread(files.open_upload, grant.path, True)
            try:
                received = 0
                async for chunk in _body_chunks(receive):
                    received += len(chunk)
                    if received > limit:
                        await asyncio.to_thread(upload.abort)  # gone before the answer
                        await _text(send, 413, f"uploads are limited to {limit} bytes\n")
                        return
                    await asyncio.to_thread(upload.write, chunk)
                if declared is not None and received != declared:
                    await asyncio.to_thread(upload.abort)
                    await _text(send, 400, "the body is shorter than its Content-Length\n")
                    return
                size = await asyncio.to_thread(upload.commit)
            except _Disconnected:
                return  # nothing is left behind (abort below)
            finally:
                await asyncio.to_thread(upload.abort)
        if not await _still_home(router, owner):
            # (This replica was frozen or cut off past its heartbeat and the session moved:
            # the file went into a workspace the session no longer has.)
            await _text(send, 409, MOVED_DURING_UPLOAD)
            return
        body = json.dumps({"path": grant.path, "size": size}).encode()
        await _start(send, 201, [(b"content-type", b"application/json"), *_length(body)])
        await send({"type": "http.response.body", "body": body})

    # -- forwarding to the home ----------------------------------------------------------------

    async def _forward(
        self, scope: Scope, receive: Receive, send: Send, router: Router, placement: Any, path: str
    ) -> None:
        if router.channel is None:
            raise OwnerUnavailableError("this session lives on another replica")
        target = CLUSTER_PREFIX + path[len(PUBLIC_PREFIX) :]
        method = scope["method"]
        limit = router.manager.settings.upload_limit_bytes()
        if method == "PUT" and (_content_length(scope) or 0) > limit:
            # Refused before reading the body, as the home would: forwarded, the client had to
            # send all of it first (the home's early answer waits behind the request's body).
            await _text(send, 413, f"uploads are limited to {limit} bytes\n")
            return
        incoming = dict(scope["headers"])
        headers = {
            key: incoming[key.encode()].decode("latin-1")
            for key in REQUEST_HEADERS
            if key.encode() in incoming
        }
        content = _body_chunks(receive) if method == "PUT" else None
        try:
            async with router.channel.stream(
                placement.home,
                placement.incarnation,
                placement.address,
                method,
                target,
                headers,
                content,
            ) as resp:
                out = [
                    (k.encode(), v.encode("latin-1"))
                    for k, v in resp.headers.items()
                    if k.lower() in RESPONSE_HEADERS
                ]
                await _start(send, resp.status_code, [*out, *_static_missing(out)])
                async for chunk in resp.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except _Disconnected:
            return
        except httpx2.HTTPError as exc:
            logger.warning("file transfer to replica {} failed: {}", placement.home, exc)
            with contextlib.suppress(Exception):  # (if nothing was sent yet)
                await _text(send, 502, f"the session's home replica failed: {type(exc).__name__}\n")


MOVED_DURING_UPLOAD = (
    "the session moved to another replica while this upload ran (this one had lost its "
    "heartbeat); the file is not in the session: upload it again\n"
)


async def _still_home(router: Router, owner: Owner) -> bool:
    """Whether this replica is still the session's home after an upload (the store down:
    assumed so, as for any call it serves without the store)."""
    if router.cluster.evicted is not None:
        return False
    if not router.cluster.shared:
        return True  # (alone: every session's home)
    try:
        return await asyncio.wait_for(router.fence.is_home(owner), HOME_CHECK_SECONDS)
    except Exception:  # the store is down or slow: the home it last knew is this one
        return True


class _Disconnected(Exception):
    """The client went away mid-transfer."""


async def _body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """A request's body in chunks of up to ~1 MiB (raises _Disconnected)."""
    pending: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected()
        chunk = message.get("body", b"")
        if chunk:
            pending.append(chunk)
            size += len(chunk)
        if size >= CHUNK or (not message.get("more_body") and pending):
            yield b"".join(pending)
            pending, size = [], 0
        if not message.get("more_body"):
            return


async def _stream_file(fd: int, start: int, length: int, receive: Receive, send: Send) -> None:
    """Send `length` bytes of `fd` from `start`, stopping if the client goes away."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = scoped(watch())
    try:
        position, left = start, length
        while left > 0 and not gone.is_set():
            chunk = await asyncio.to_thread(os.pread, fd, min(CHUNK, left), position)
            if not chunk:
                break  # the file shrank meanwhile: the client sees a short body
            position += len(chunk)
            left -= len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
        if left > 0 and not gone.is_set():
            await send({"type": "http.response.body", "body": b""})
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def _range(header: str, size: int) -> tuple[int, int] | None:
    """(start, length) of a single byte range, (0, size) for one not understood (the whole
    file is sent, as HTTP allows); None: not satisfiable."""
    match = RANGE.fullmatch(header)
    if match is None:
        return 0, size
    first, last = match.groups()
    if not first and not last:
        return 0, size
    if not first:  # the last N bytes
        count = int(last)
        return (max(0, size - count), min(count, size)) if count > 0 and size > 0 else None
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or end < start:
        return None
    return start, end - start + 1


def _disposition(path: str) -> bytes:
    name = path.rsplit("/", 1)[-1]
    plain = "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in name)
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{quote(name, safe='')}".encode()


def _content_length(scope: Scope) -> int | None:
    raw = dict(scope["headers"]).get(b"content-length")
    if raw is None:
        return None
    try:
        return max(0, int(raw))
    except ValueError:
        raise InvalidRequestError("bad Content-Length") from None


def _status(exc: SandboxRuntimeError) -> int:
    if isinstance(exc, WorkspaceFullError | DiskFullError):
        return 507
    if isinstance(exc, FileMissingError):
        return 404
    if isinstance(exc, FileAccessError):
        return 409
    if isinstance(exc, InvalidRequestError | PolicyViolationError):
        return 400
    if isinstance(exc, LimitExceededError):
        return 429
    return 503


def _static_missing(present: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    names = {k.lower() for k, _ in present}
    return [(k, v) for k, v in STATIC_HEADERS if k not in names]


def _length(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-length", str(len(body)).encode())]


async def _start(send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def _text(
    send: Send, status: int, text: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = text.encode()
    base = [(b"content-type", b"text/plain; charset=utf-8"), *_length(body), *STATIC_HEADERS]
    extra = [(k, v) for k, v in headers or [] if k not in (b"content-type", b"content-length")]
    await _start(send, status, base + extra)
    await send({"type": "http.response.body", "body": body})
