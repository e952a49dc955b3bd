"""envd's `GET /files` and `POST /files` (multipart or octet-stream, optionally gzip) over the
signed-URL file app (server/files_http.py): the transfer streams to and from the session's
workspace on its home replica (forwarded from any replica), within SANDBOX_MAX_UPLOAD_MB and
the workspace's quota, with its safe path handling. Nothing is held whole in memory: an
octet-stream body streams straight through (decompressed as it comes), a multipart body's
files are spooled to a temporary file first (the parts' boundaries are only known once read).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import quote

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_runtime.e2b import wire
from sandbox_runtime.e2b.paths import to_e2b, to_workspace
from sandbox_runtime.e2b.sandboxes import E2BSandbox
from sandbox_runtime.errors import (
    DiskFullError,
    FileAccessError,
    FileMissingError,
    InvalidRequestError,
    LimitExceededError,
    OwnerUnavailableError,
    SandboxRuntimeError,
    WorkspaceFullError,
)

CHUNK = 1024 * 1024
MAX_PARTS = 100
MAX_ERROR_BODY = 64 * 1024
SPOOL_DIR = "e2b-uploads"  # in the state directory


def status_of(exc: Exception) -> int:
    if isinstance(exc, FileMissingError):
        return 404
    if isinstance(exc, WorkspaceFullError | DiskFullError):
        return 507
    if isinstance(exc, InvalidRequestError | FileAccessError):
        return 400
    if isinstance(exc, LimitExceededError):
        return 429
    if isinstance(exc, OwnerUnavailableError):
        return 503
    return 500


class Delegated:
    """An ASGI callable: the request, re-addressed to a signed file URL, answered by the file
    app (`receive` replaced by `body` when given)."""

    def __init__(
        self,
        files: ASGIApp,
        method: str,
        token: str,
        path: str,
        body: Callable[[], AsyncIterator[bytes]] | None = None,
    ) -> None:
        self.files, self.method, self.token, self.path, self.body = files, method, token, path, body

    def scope_for(self, scope: Scope) -> Scope:
        name = self.path.rsplit("/", 1)[-1]
        path = f"/files/{self.token}/{name}"
        keep = (b"range", b"if-none-match") if self.method == "GET" else ()
        headers = [(k, v) for k, v in scope["headers"] if k in keep]
        return {
            **scope,
            "method": self.method,
            "path": path,
            "raw_path": f"/files/{self.token}/{quote(name)}".encode(),
            "root_path": "",
            "query_string": b"",
            "headers": headers,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.files(self.scope_for(scope), self._receive(receive), send)

    def _receive(self, receive: Receive) -> Receive:
        if self.body is None:
            return receive
        chunks = self.body()

        async def next_message() -> Message:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": chunk, "more_body": True}

        return next_message


async def _captured(app: Delegated, scope: Scope, receive: Receive) -> tuple[int, bytes]:
    """Run `app` and keep its answer (status, a bounded body) instead of sending it."""
    status = 500
    body = bytearray()

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and len(body) < MAX_ERROR_BODY:
            body.extend(message.get("body", b""))

    await app(scope, receive, send)
    return status, bytes(body)


def _gunzip(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    async def out() -> AsyncIterator[bytes]:
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        total = 0
        async for chunk in chunks:
            while chunk:
                try:
                    data = inflate.decompress(chunk, CHUNK)
                except zlib.error:
                    raise InvalidRequestError("the body is not valid gzip") from None
                chunk = inflate.unconsumed_tail
                total += len(data)
                if total > limit:  # (a bomb stops here: the file app's limit is the same)
                    raise InvalidRequestError(f"the decompressed upload is over {limit} bytes")
                if data:
                    yield data
        rest = inflate.flush()
        if rest:
            yield rest

    return out()


class FilesEndpoint:
    def __init__(self, services: Any, files: ASGIApp) -> None:
        self.services = services
        self.files = files

    async def __call__(self, request: Request, sandbox: E2BSandbox) -> Any:
        try:
            if request.method == "GET":
                return await self._download(request, sandbox)
            if request.method == "POST":
                return await self._upload(request, sandbox)
        except _Refused as exc:
            return wire.error(exc.status, exc.message)
        except SandboxRuntimeError as exc:
            return wire.error(status_of(exc), str(exc))
        return wire.error(405, "GET or POST")

    async def _grant(self, sandbox: E2BSandbox, path: str, method: str) -> dict[str, Any]:
        args = {"path": path, "method": method}
        return await self.services.router.run(sandbox.owner, "create_file_url", args)

    async def _download(self, request: Request, sandbox: E2BSandbox) -> Any:
        path = to_workspace(request.query_params.get("path"))
        grant = await self._grant(sandbox, path, "GET")
        return Delegated(self.files, "GET", grant["token"], grant["path"])

    async def _upload(self, request: Request, sandbox: E2BSandbox) -> Any:
        limit = self.services.settings.upload_limit_bytes()
        content_type, options = parse_options_header(request.headers.get("content-type", ""))
        chunks: AsyncIterator[bytes] = request.stream()
        if request.headers.get("content-encoding", "").lower() == "gzip":
            chunks = _gunzip(chunks, limit)
        elif request.headers.get("content-encoding", "identity").lower() != "identity":
            return wire.error(415, "Content-Encoding must be gzip or none")
        query_path = request.query_params.get("path")
        if content_type == b"multipart/form-data":
            boundary = options.get(b"boundary")
            if not boundary:
                return wire.error(400, "a multipart body needs a boundary")
            return await self._multipart(request, sandbox, chunks, boundary, query_path, limit)
        if not query_path:
            return wire.error(400, "an octet-stream upload needs ?path=")
        written = await self._put(request, sandbox, to_workspace(query_path), lambda: chunks)
        return JSONResponse([written])

    async def _put(
        self,
        request: Request,
        sandbox: E2BSandbox,
        path: str,
        body: Callable[[], AsyncIterator[bytes]],
    ) -> dict[str, Any]:
        grant = await self._grant(sandbox, path, "PUT")
        app = Delegated(self.files, "PUT", grant["token"], grant["path"], body)
        status, answer = await _captured(app, request.scope, request.receive)
        if status >= 300:
            raise _Refused(status, answer.decode(errors="replace").strip())
        e2b_path = to_e2b(grant["path"])
        return {"name": e2b_path.rsplit("/", 1)[-1], "type": "file", "path": e2b_path}

    async def _multipart(
        self,
        request: Request,
        sandbox: E2BSandbox,
        chunks: AsyncIterator[bytes],
        boundary: bytes,
        query_path: str | None,
        limit: int,
    ) -> Any:
        spool = Spool(self.services.settings.state_dir, limit)
        try:
            parser = MultipartParser(boundary, spool.callbacks())  # type: ignore[arg-type]
            async for chunk in chunks:
                await asyncio.to_thread(parser.write, chunk)
                if spool.error is not None:
                    return wire.error(spool.error[0], spool.error[1])
            parser.finalize()
            if not spool.parts:
                return wire.error(400, "the multipart body holds no file")
            written = []
            for name, file_path in spool.parts:
                target = query_path if query_path and len(spool.parts) == 1 else name
                if not target:
                    return wire.error(400, "a file part has no name: pass ?path=")
                written.append(
                    await self._put(request, sandbox, to_workspace(target), spool.reader(file_path))
                )
            return JSONResponse(written)
        except _Refused as exc:
            return wire.error(exc.status, exc.message)
        except MultipartParseError as exc:  # (its own bounds: a part's headers, the boundary)
            return wire.error(400, f"the multipart body is malformed: {exc}")
        finally:
            spool.close()


class _Refused(SandboxRuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Spool:
    """The files of a multipart body, each written to a temporary file as it is parsed
    (bounded: `limit` bytes in all, MAX_PARTS files)."""

    def __init__(self, state_dir: Any, limit: int) -> None:
        base = os.path.join(str(state_dir), SPOOL_DIR)
        os.makedirs(base, mode=0o700, exist_ok=True)
        self.dir = tempfile.mkdtemp(dir=base)
        self.limit = limit
        self.total = 0
        self.parts: list[tuple[str, str]] = []
        self.error: tuple[int, str] | None = None
        self._fd: int | None = None
        self._headers: dict[bytes, bytes] = {}
        self._field = b""
        self._value = b""

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: setattr(self, "_field", self._field + d[s:e]),
            "on_header_value": lambda d, s, e: setattr(self, "_value", self._value + d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_done,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }

    def _begin(self) -> None:
        self._headers = {}

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"filename") or b""
        if len(self.parts) >= MAX_PARTS:
            self.error = (400, f"at most {MAX_PARTS} files in one upload")
            return
        path = os.path.join(self.dir, str(len(self.parts)))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.parts.append((name.decode(errors="replace"), path))

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._fd is None or self.error is not None:
            return
        self.total += end - start
        if self.total > self.limit:
            self.error = (413, f"uploads are limited to {self.limit} bytes")
            return
        view = memoryview(data)[start:end]
        while view:
            view = view[os.write(self._fd, view) :]

    def _end(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def reader(self, path: str) -> Callable[[], AsyncIterator[bytes]]:
        async def chunks() -> AsyncIterator[bytes]:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                while data := await asyncio.to_thread(os.read, fd, CHUNK):
                    yield data
            finally:
                os.close(fd)

        return chunks

    def close(self) -> None:
        self._end()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
