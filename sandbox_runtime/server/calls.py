"""What every MCP tool does around its operation: name the caller's owner (the token's
principal and the session), run the operation with the call counted and logged in context,
domain errors turned into tool errors, and progress notifications while it waits."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastmcp import Context
from fastmcp.exceptions import FastMCPError
from fastmcp.server.dependencies import get_access_token, get_context, get_http_request
from fastmcp.server.middleware import Middleware, MiddlewareContext
from loguru import logger
from mcp.shared.exceptions import MCPError
from pydantic import Field

from sandbox_runtime.app.services import Root, Services
from sandbox_runtime.domain.identity import identity_of
from sandbox_runtime.domain.owner import DEFAULT_SESSION, SESSION_RE, Owner
from sandbox_runtime.domain.owner import session_name as public_name
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.oauth.policy import Policy, refusal_text
from sandbox_runtime.oauth.scopes import FILES, server_scope, tool_scope
from sandbox_runtime.server.audit_calls import note
from sandbox_runtime.server.replies import ToolFailure
from sandbox_runtime.server.session_path import SCOPE_KEY
from sandbox_runtime.supervisor import scoped

ANONYMOUS = "anonymous"

T = TypeVar("T")

SessionArg = Annotated[
    str | None,
    Field(description="Workspace, interpreters and executions; omitted: 'default'. One per agent."),
]


def session_name(owner: Owner) -> str:
    """The session as callers name it."""
    return public_name(owner.session_id)


def _owner_of(ctx: Context, session: str | None) -> Owner:
    """The caller's owner key: the token's principal and the session it names, else `default`
    (in both protocol eras: a client that opens a transport session per call keeps its state)."""
    token = get_access_token()
    principal = token.client_id if token is not None else ANONYMOUS
    if session is not None:
        if not isinstance(session, str) or not SESSION_RE.fullmatch(session):
            raise ToolFailure(
                "session must be 1-128 characters of letters, digits and ._:@- (not only dots)"
            )
    with contextlib.suppress(RuntimeError):
        bound = get_http_request().scope.get(SCOPE_KEY)
        if bound is not None:  # /s/{session}/mcp
            if session is not None and session != bound:
                raise ToolFailure(
                    f"this endpoint is bound to session {bound!r}; the session argument "
                    f"{session!r} disagrees (drop it, or use /s/{session}/mcp)"
                )
            session = bound
    if session is None or session == DEFAULT_SESSION:
        return Owner(principal, DEFAULT_SESSION)
    return Owner(principal, f"s:{session}")


def owner_of(ctx: Context, session: str | None) -> Owner:
    """The caller's owner key (see _owner_of); remembered for this call's log context."""
    owner = _owner_of(ctx, session)
    _owner.set(owner)
    note(session=session_name(owner))
    return owner


class ScopeCheck(Middleware):
    """Every tools/call and resources/read checked against the caller's scopes (the scope
    table, oauth/scopes.py), code mode's `servers=[...]` included: a refusal is a tool error
    naming the scope. (The HTTP edge answers most refusals first with the spec's 403; this
    catches what it cannot read: a body past its limit.)"""

    # Its hooks are per-method ones only (no on_message/on_request): the direct tools/call
    # path (dispatch.py) runs its on_call_tool as the library would.
    TOOL_CALL_HOOKS_ONLY = True

    def __init__(self, root: Root, policy: Policy | None = None) -> None:
        self.root = root
        self.policy = policy  # (for the refusal: which groups would give the scope)

    async def on_call_tool(self, context: MiddlewareContext[Any], call_next: Any) -> Any:
        name = context.message.name
        args = context.message.arguments or {}
        self._require(tool_scope(name))
        servers = args.get("servers")
        if isinstance(servers, list) and servers:
            named = self._require_servers([s for s in servers if isinstance(s, str)])
            if named is not None:  # ("*": those the scopes cover, not all the catalog's)
                args["servers"] = named
        return await call_next(context)

    async def on_read_resource(self, context: MiddlewareContext[Any], call_next: Any) -> Any:
        self._require(FILES)
        return await call_next(context)

    def _require(self, needed: str) -> None:
        token = get_access_token()
        if token is None or not needed:
            return
        identity = identity_of(token.claims, token.client_id)
        if not identity.allows(needed):
            raise ToolFailure(refusal_text(needed, identity.principal, self.policy), "scope")

    def _require_servers(self, names: list[str]) -> list[str] | None:
        """Code mode: each named server's scope; `*` only with servers:*, and then it stands
        for the servers whose scopes the caller has (an entry's own required_scope is not
        covered by servers:*): the names to use instead (None: as given)."""
        token = get_access_token()
        if token is None:
            return None
        identity = identity_of(token.claims, token.client_id)
        if identity.scopes is None:
            return None
        every = "*" in names
        if every:
            self._require(server_scope("*"))
        catalog = self.root.services.servers.catalog() if self.root.running else None
        named = [n for n in names if n != "*"]
        for name in named:
            entry = catalog.get(name) if catalog is not None else None
            self._require(server_scope(name, entry.required_scope if entry else None))
        if not every or catalog is None:
            return None
        covered = [
            e.name
            for e in catalog.for_principal(token.client_id)
            if identity.allows(server_scope(e.name, e.required_scope))
        ]
        return list(dict.fromkeys([*named, *covered]))


def may_use_server(name: str, required_scope: str = "") -> bool:
    """Whether the caller's scopes cover the hosted server `name` (list_servers and
    search_tools show only those)."""
    token = get_access_token()
    if token is None:
        return True
    return identity_of(token.claims, token.client_id).allows(server_scope(name, required_scope))


ERROR_KINDS = {
    "ExecutionNotFoundError": "not_found",
    "ExecutionFinishedError": "finished",
    "InvalidRequestError": "invalid",
    "PolicyViolationError": "policy",
    "LimitExceededError": "limit",
    "OwnerUnavailableError": "owner_unavailable",
    "SandboxUnavailableError": "sandbox_unavailable",
    "SandboxSpawnError": "spawn_failed",
    "FileAccessError": "file",
    "FileMissingError": "not_found",
    "WorkspaceFullError": "quota",
    "DiskFullError": "disk_full",
    "WorkspaceDamagedError": "workspace_damaged",
}
_owner: contextvars.ContextVar[Owner | None] = contextvars.ContextVar("srt_owner", default=None)


async def call(
    services: Services, op: Callable[[], Awaitable[T]], tool: str, count: bool = True
) -> T:
    """Run a manager operation, turning domain errors into tool errors with their message.

    Counts the call, and logs with the request id, session and tool as context.
    """
    metrics = services.manager.metrics
    if count:
        metrics.tool_calls.labels(tool).inc()
    owner = _owner.get()
    request_id = "-"
    with contextlib.suppress(Exception):  # outside a request (tests calling tools directly)
        request_id = str(get_context().request_id)
    with logger.contextualize(
        tool=tool, request_id=request_id, session=owner.session_id if owner else "-"
    ):
        try:
            return await op()
        except SandboxRuntimeError as exc:
            kind = ERROR_KINDS.get(type(exc).__name__, "error")
            metrics.tool_errors.labels(tool, kind).inc()
            logger.info("tool {} refused: {}: {}", tool, type(exc).__name__, exc)
            raise ToolFailure(str(exc), kind) from None
        except (FastMCPError, MCPError):
            raise
        except Exception as exc:  # a bug of ours: said so, with where its traceback is
            metrics.tool_errors.labels(tool, "internal").inc()
            logger.opt(exception=exc).error(
                "tool {} failed (request id {}): {}", tool, request_id, type(exc).__name__
            )
            raise ToolFailure(
                f"the server failed on this call ({type(exc).__name__}: a bug, logged with its "
                "traceback); it may not have completed: check its effect and retry",
                "internal",
            ) from None


class CallProgress:
    """MCP progress notifications for one waiting call: its output as it comes, and a beat
    every `interval` seconds when there is none, so that a client that resets its request
    timeout on progress survives a program that prints nothing. The progress value counts the
    notifications (the protocol wants it to increase)."""

    def __init__(self, ctx: Context, interval: float) -> None:
        self.ctx = ctx
        self.interval = interval
        self.sent = 0
        self.last = time.monotonic()
        self.began = self.last

    async def report(self, _seq: int, text: str) -> None:
        await self._send(text)

    async def _send(self, text: str) -> None:
        self.sent += 1
        self.last = time.monotonic()
        with contextlib.suppress(Exception):  # a caller that went away must not stop the wait
            await self.ctx.report_progress(self.sent, None, text)

    async def beat(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.last + self.interval - time.monotonic()))
            if time.monotonic() - self.last >= self.interval:
                await self._send(f"waiting: {time.monotonic() - self.began:.0f} s")


@contextlib.asynccontextmanager
async def progress_of(
    ctx: Context, waits: bool, interval: float
) -> AsyncIterator[CallProgress | None]:
    """The progress sink of a call that `waits`, if the caller asked for progress (sent a
    progressToken); None otherwise (report_progress would send nothing: spare the work)."""
    rc = ctx.request_context
    meta = rc.meta if rc is not None else None
    if not waits or meta is None or meta.get("progressToken") is None:
        yield None
        return
    progress = CallProgress(ctx, interval)
    beat = scoped(progress.beat())
    try:
        yield progress
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
