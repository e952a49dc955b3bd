"""The file tools and resources: workspace files in and out without running code."""

from __future__ import annotations

import base64
from functools import partial
from typing import Annotated, Any
from urllib.parse import quote, unquote

from fastmcp import Context, FastMCP
from fastmcp.exceptions import ResourceError, ToolError
from fastmcp.resources import ResourceContent, ResourceResult, ResourceSecurity
from fastmcp.server.dependencies import get_http_request
from fastmcp.tools.base import ToolResult
from mcp.types import ImageContent
from pydantic import BaseModel, Field

from sandbox_runtime.app.services import Root
from sandbox_runtime.server.replies import reply
from sandbox_runtime.server.resources import RESOURCE_TEMPLATE, THIS_SESSION
from sandbox_runtime.server.screens import read_screen
from sandbox_runtime.server.tools import SessionArg, call, owner_of, session_name
from sandbox_runtime.sessions.models import SessionReset

IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")

PathArg = Annotated[str, Field(description="Relative to /workspace, or absolute inside it.")]


class Usage(BaseModel):
    bytes_used: int | None = None
    bytes_limit: int | None = Field(None, description="The workspace's quota (None: none).")
    files_used: int | None = None
    files_limit: int | None = None


class InSession(BaseModel):
    session: str = Field("default", description="The session the call ran in.")
    session_reset: SessionReset | None = None


class WriteResult(InSession):
    path: str
    size: int
    usage: Usage


class ReadResult(InSession):
    path: str
    size: int = Field(description="The whole file's size.")
    offset: int
    length: int = Field(description="Bytes in this reply.")
    eof: bool = Field(description="This reply reaches the end of the file.")
    encoding: str = Field(description="utf-8 (content is the text) or base64.")
    content: str
    mime_type: str


class FileEntry(BaseModel):
    path: str
    type: str = Field(description="file, directory, symlink, fifo, socket or device.")
    size: int
    mtime: float
    target: str | None = Field(None, description="A symlink's target (never followed).")


class ListResult(InSession):
    path: str
    entries: list[FileEntry]
    count: int
    truncated: bool = Field(description="More entries exist: raise limit or list deeper paths.")
    usage: Usage


class DeleteResult(InSession):
    path: str
    deleted: str = Field(description="What it was: file, directory, symlink, ...")
    usage: Usage


class FileUrl(InSession):
    url: str = Field(description="Plain HTTP, no token needed: GET (Range allowed) or PUT.")
    method: str
    path: str
    expires_at: int = Field(description="Unix time after which the URL is refused.")
    size: int | None = None


def public_base(settings_url: str | None) -> str:
    """Where clients reach this server: SANDBOX_PUBLIC_URL, else what the request says."""
    if settings_url:
        return settings_url.rstrip("/")
    try:
        request = get_http_request()
    except RuntimeError:
        return "http://localhost"
    headers = request.headers
    proto = headers.get("x-forwarded-proto", request.url.scheme).split(",")[0].strip()
    host = headers.get("x-forwarded-host", headers.get("host", "localhost")).split(",")[0].strip()
    if proto not in ("http", "https"):
        proto = "http"
    return f"{proto}://{host}"


def file_url(base: str, token: str, path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return f"{base}/files/{token}/{quote(name, safe='')}"


def register_file_tools(mcp: FastMCP, root: Root) -> None:
    """Add write_file, read_file, list_files, delete_file, create_file_url and the
    workspace:// resource template to `mcp`."""

    async def run(ctx: Context, session: str | None, op: str, args: dict[str, Any]) -> dict:
        s = root.services
        owner = owner_of(ctx, session)
        result = await call(s, lambda: s.router.run(owner, op, args, None), op)
        return {**result, "session": session_name(owner)}

    @mcp.tool
    async def write_file(
        ctx: Context,
        path: PathArg,
        content: Annotated[str, Field(description="The file's content, as `encoding` says.")],
        encoding: Annotated[
            str, Field(description="utf-8 (content is text) or base64 (binary).")
        ] = "utf-8",
        overwrite: Annotated[bool, Field(description="Replace an existing file.")] = True,
        session: SessionArg = None,
    ) -> WriteResult:
        """Write a file into the session's workspace (parent directories are made). Up to a
        few MiB inline; larger files go through create_file_url(method="PUT")."""
        args = {"path": path, "content": content, "encoding": encoding, "overwrite": overwrite}
        return WriteResult.model_validate(await run(ctx, session, "write_file", args))

    @mcp.tool(output_schema=ReadResult.model_json_schema())
    async def read_file(
        ctx: Context,
        path: PathArg,
        encoding: Annotated[
            str | None,
            Field(description="utf-8 or base64; default: text if it is UTF-8, else base64."),
        ] = None,
        offset: Annotated[int, Field(description="First byte to read.")] = 0,
        length: Annotated[
            int | None, Field(description="Bytes to read; default 512 KiB (at most a few MiB).")
        ] = None,
        session: SessionArg = None,
    ) -> ToolResult:
        """Read a file of the session's workspace: text, or base64 for binary; images also
        come back as images. Large files: read parts with offset/length, or create_file_url."""
        args = {"path": path, "encoding": encoding, "offset": offset, "length": length}
        result = await run(ctx, session, "read_file", args)
        structured = ReadResult.model_validate(result).model_dump(mode="json")
        content: list[Any] = []
        if result["mime_type"] in IMAGE_TYPES and result["eof"] and not result["offset"]:
            data = result["content"]
            if result["encoding"] != "base64":
                data = base64.b64encode(data.encode()).decode()
            content.append(ImageContent(type="image", data=data, mime_type=result["mime_type"]))
        screen = partial(read_screen, structured, structured.get("session"))
        return reply(structured, content, screen=screen)

    @mcp.tool
    async def list_files(
        ctx: Context,
        path: Annotated[str, Field(description="Directory to list, in /workspace.")] = ".",
        depth: Annotated[int, Field(description="Levels to descend (1: its entries).")] = 1,
        limit: Annotated[int, Field(description="Most entries to return (<= 10000).")] = 1000,
        session: SessionArg = None,
    ) -> ListResult:
        """List the session's workspace: type, size and modification time of each entry
        (symlinks are shown, never followed), and the workspace's quota use."""
        args = {"path": path, "depth": depth, "limit": limit}
        return ListResult.model_validate(await run(ctx, session, "list_files", args))

    @mcp.tool
    async def delete_file(
        ctx: Context,
        path: PathArg,
        recursive: Annotated[bool, Field(description="Delete a directory and all in it.")] = False,
        session: SessionArg = None,
    ) -> DeleteResult:
        """Delete a file, a symlink (not its target) or a directory of the session's workspace."""
        args = {"path": path, "recursive": recursive}
        return DeleteResult.model_validate(await run(ctx, session, "delete_file", args))

    @mcp.tool
    async def create_file_url(
        ctx: Context,
        path: PathArg,
        method: Annotated[
            str, Field(description="GET to download the file, PUT to upload to the path.")
        ] = "GET",
        expires_in_seconds: Annotated[
            int, Field(description="Life of the URL (default 15 minutes; the server caps it).")
        ] = 900,
        session: SessionArg = None,
    ) -> FileUrl:
        """A signed URL for one plain HTTP transfer of any size, e.g. `curl -o out URL` or
        `curl -T file URL`; it works for this one path and method until it expires."""
        args = {"path": path, "method": method, "expires_in_seconds": expires_in_seconds}
        result = await run(ctx, session, "create_file_url", args)
        base = public_base(root.services.settings.public_url)
        result["url"] = file_url(base, result.pop("token"), result["path"])
        return FileUrl.model_validate(result)

    @mcp.resource(
        RESOURCE_TEMPLATE,
        name="workspace_file",
        description="A file of a session's workspace: workspace://{session}/{path}, where "
        "{session} is a session name, or ~ for this connection's own session.",
        security=ResourceSecurity(exempt_params={"session"}),
    )
    async def workspace_file(session: str, path: str, ctx: Context) -> ResourceResult:
        name = unquote(session)
        try:
            owner = owner_of(ctx, None if name == THIS_SESSION else name)
            s = root.services
            args = {"path": path, "offset": 0, "length": s.settings.max_inline_bytes}
            result = await call(s, lambda: s.router.run(owner, "read_file", args, None), "read")
        except ToolError as exc:
            raise ResourceError(str(exc)) from None
        if not result["eof"]:
            raise ResourceError(
                f"{result['path']} is {result['size']} bytes, more than a resource read returns; "
                "use read_file with offset/length, or create_file_url"
            )
        data: str | bytes = result["content"]
        if result["encoding"] == "base64":
            data = base64.b64decode(result["content"])
        return ResourceResult([ResourceContent(data, mime_type=result["mime_type"])])
