"""The audit log's lines at the edge: one per MCP tool call (a middleware around every
tools/call, whatever the tool does inside), one per use of a signed file URL, one per call of
a hosted server's tool. What only the tool knows (the session it resolved) it adds with
`note`. Never a token, never an argument's or a file's contents: sizes only."""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from fastmcp.server.dependencies import get_access_token
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import ToolResult
from mcp import types as mt
from mcp.server.context import CallNext as ServerCallNext
from mcp.server.context import HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_runtime.app.services import Root
from sandbox_runtime.audit.log import AuditLog, now
from sandbox_runtime.audit.records import argument_sizes, clip, who
from sandbox_runtime.domain.identity import ANONYMOUS, Identity, identity_of, token_id
from sandbox_runtime.domain.owner import SESSION_RE, session_name
from sandbox_runtime.server.files_http import GRANT_KEY
from sandbox_runtime.server.session_path import SCOPE_KEY as SESSION_KEY

# Where the hosted endpoint puts the caller's Identity in the request's scope.
IDENTITY_KEY = "srt.identity"
UNKNOWN_TOOL = "(unknown)"
INVALID = "(invalid)"

_record: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "srt_audit_record", default=None
)


def note(**fields: Any) -> None:
    """Add to the current call's audit line (nothing outside an audited call)."""
    record = _record.get()
    if record is not None:
        record.update(fields)


def caller() -> Identity:
    """The current request's verified caller (ANONYMOUS when the server takes no token)."""
    token = get_access_token()
    return ANONYMOUS if token is None else identity_of(token.claims, token.client_id)


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)


class AuditedCalls(Middleware):
    """One audit line per tools/call: outermost, so that it sees refusals of every kind
    (unknown tool, invalid arguments, domain errors) as the error results the caller gets."""

    # Its hooks are per-method ones only (no on_message/on_request): the direct tools/call
    # path (dispatch.py) runs its on_call_tool as the library would.
    TOOL_CALL_HOOKS_ONLY = True

    def __init__(self, root: Root) -> None:
        self.root = root
        self.known: frozenset[str] | None = None  # the tools' names (fixed at startup)

    async def _tool(self, context: MiddlewareContext[mt.CallToolRequestParams]) -> str:
        """The tool's name, or `(unknown)` for a name that is none of ours (a caller's text)."""
        if self.known is None and context.fastmcp_context is not None:
            tools = await context.fastmcp_context.fastmcp.list_tools(run_middleware=False)
            self.known = frozenset(t.name for t in tools)
        name = context.message.name
        return name if self.known is not None and name in self.known else UNKNOWN_TOOL

    async def on_call_tool(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        if not self.root.running:
            return await call_next(context)
        audit = self.root.services.audit
        args = context.message.arguments or {}
        session = args.get("session")
        record: dict[str, Any] = {
            "time": now(),
            "event": "tool_call",
            **who(caller()),
            "tool": await self._tool(context),
            "session": _named(session),
            "execution_id": None,
            "outcome": "internal",
            "duration_ms": 0.0,
            "argument_bytes": argument_sizes(args),
        }
        mark = _record.set(record)
        started = time.perf_counter()
        try:
            result = await call_next(context)
            structured = result.structured_content or {}
            if result.is_error:
                record["outcome"] = str(structured.get("error_type", "error"))
            else:
                record["outcome"] = "ok"
            found = args.get("execution_id") or structured.get("execution_id")
            if isinstance(found, str):
                record["execution_id"] = clip(found)
            return result
        except asyncio.CancelledError:
            record["outcome"] = "cancelled"
            raise
        finally:
            _record.reset(mark)
            record["duration_ms"] = _ms(started)
            audit.write(record)


def refused_call(
    audit: Callable[[], AuditLog | None],
) -> Callable[[Scope, Identity, bytes], None]:
    """The line of a tools/call refused at the HTTP edge (403 insufficient_scope: it never
    reaches the tools), read from the request's body (JSON-RPC, at most the edge's peek)."""

    def refused(scope: Scope, identity: Identity, body: bytes) -> None:
        log = audit()
        if log is None or not log.enabled:
            return
        try:
            params = json.loads(body).get("params") or {}
            name, args = params.get("name"), params.get("arguments") or {}
        except (ValueError, AttributeError):
            params, name, args = {}, None, {}
        if not isinstance(args, Mapping):
            args = {}
        session = scope.get(SESSION_KEY) or args.get("session")
        log.write(
            {
                "time": now(),
                "event": "tool_call",
                **who(identity),
                "tool": clip(name) if isinstance(name, str) else UNKNOWN_TOOL,
                "session": _named(session),
                "execution_id": None,
                "outcome": "scope",
                "duration_ms": 0.0,
                "argument_bytes": argument_sizes(args),
            }
        )

    return refused


class AuditedFiles:
    """One audit line per request to a signed file URL (the public edge's: a transfer
    forwarded to the session's home is said once, here): who the URL was made for, the URL's
    id (never the URL), the method, the status and the bytes each way."""

    def __init__(self, app: ASGIApp, audit: Any) -> None:
        self.app = app
        self.audit = audit  # () -> AuditLog | None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        audit: AuditLog | None = self.audit()
        if scope["type"] != "http" or audit is None or not audit.enabled:
            await self.app(scope, receive, send)
            return
        counts = {"status": 0, "received": 0, "sent": 0}

        async def counted_receive() -> Message:
            message = await receive()
            counts["received"] += len(message.get("body", b""))
            return message

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                counts["status"] = message["status"]
            elif message["type"] == "http.response.body":
                counts["sent"] += len(message.get("body", b""))
            await send(message)

        started = time.perf_counter()
        record: dict[str, Any] = {"time": now(), "event": "file_url"}
        try:
            await self.app(scope, counted_receive, counted_send)
        finally:
            grant = scope.get(GRANT_KEY)
            url_token = scope["path"].split("/")[2] if scope["path"].count("/") >= 2 else ""
            status = counts["status"]
            record |= {
                "principal": getattr(grant, "principal", None),
                "token_id": token_id(url_token, "url"),
                "client_id": None,
                "tool": f"file_url.{str(scope.get('method', '')).lower()}",
                "session": _session(getattr(grant, "session_id", None)),
                "outcome": "ok" if 0 < status < 400 else f"http_{status}",
                "status": status,
                "duration_ms": _ms(started),
                "bytes_in": counts["received"],
                "bytes_out": counts["sent"],
            }
            audit.write(record)


def _named(session: Any) -> str:
    """A session argument as a line keeps it: a valid name, else `(invalid)` (it is the
    caller's text: not its contents, nor its size, belong in the line)."""
    if session is None:
        return "default"
    return session if isinstance(session, str) and SESSION_RE.fullmatch(session) else INVALID


def _session(session_id: str | None) -> str | None:
    return None if session_id is None else session_name(session_id)


def hosted_refused(audit: AuditLog, identity: Identity, server: str) -> None:
    """The line of a request to a hosted server refused for want of its scope (403)."""
    record = {"time": now(), "event": "hosted_call", **who(identity), "server": server}
    audit.write(record | {"tool": None, "session": None, "outcome": "scope", "duration_ms": 0.0})


class AuditedHostedCalls:
    """One audit line per tools/call to a hosted server (before the relay, which passes it
    on): the server, its tool, the argument sizes, the outcome (`ok`, `tool_error` for a
    result with isError, `error <code>` for a JSON-RPC error)."""

    def __init__(self, audit: AuditLog, server: str) -> None:
        self.audit = audit
        self.server = server

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: ServerCallNext
    ) -> HandlerResult:
        if ctx.method != "tools/call":
            return await call_next(ctx)
        request = ctx.request
        scope: Mapping[str, Any] = getattr(request, "scope", {}) if request is not None else {}
        identity = scope.get(IDENTITY_KEY)
        params = ctx.params if isinstance(ctx.params, Mapping) else {}
        arguments = params.get("arguments")
        record: dict[str, Any] = {
            "time": now(),
            "event": "hosted_call",
            **who(identity if isinstance(identity, Identity) else ANONYMOUS),
            "server": self.server,
            "tool": clip(params.get("name", "")),
            "session": scope.get(SESSION_KEY) or "default",
            "outcome": "internal",
            "duration_ms": 0.0,
            "argument_bytes": argument_sizes(arguments if isinstance(arguments, Mapping) else {}),
        }
        started = time.perf_counter()
        try:
            result = await call_next(ctx)
            record["outcome"] = "tool_error" if getattr(result, "is_error", False) else "ok"
            return result
        except MCPError as exc:
            record["outcome"] = f"error {exc.code}"
            raise
        except asyncio.CancelledError:
            record["outcome"] = "cancelled"
            raise
        finally:
            record["duration_ms"] = _ms(started)
            self.audit.write(record)
