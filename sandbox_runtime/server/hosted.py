"""`/servers/{name}/mcp`: a hosted server's MCP endpoint, behind this server's auth.

Each catalog entry gets its own MCP server object (its name, its instructions) and its own
Streamable HTTP session manager, so both protocol eras, sessions, SSE and the 2026 era's
stateless requests are the library's. Every request other than the handshake is passed on,
raw, to the caller's instance through the Router (which runs it on the instance's home
replica, forwarding when that is another one): the instance's results and errors come back
as they are, its progress and logging notifications are relayed to the caller, and a
cancelled request is cancelled in the instance.

A transport session belongs to the principal whose token opened it, as on /mcp: the
request's scope carries that principal as the library's authenticated user, and the session
manager answers another principal's requests naming the session 404 "Session not found".
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import re
from collections.abc import Mapping
from typing import Any

from loguru import logger
from mcp import types as mt
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from sandbox_runtime.app.services import Root, Services
from sandbox_runtime.config import Settings
from sandbox_runtime.domain.identity import identity_of
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.oauth.metadata import ResourceMetadata
from sandbox_runtime.oauth.policy import refusal_text
from sandbox_runtime.oauth.scopes import server_scope
from sandbox_runtime.server.audit_calls import IDENTITY_KEY, AuditedHostedCalls, hosted_refused
from sandbox_runtime.server.auth import CallerVerifier
from sandbox_runtime.server.calls import ANONYMOUS
from sandbox_runtime.server.oauth_edge import insufficient_scope
from sandbox_runtime.server.plain_replies import answer_plainly
from sandbox_runtime.server.session_path import SCOPE_KEY as SESSION_KEY
from sandbox_runtime.server.session_path import public_path
from sandbox_runtime.servers.catalog import Entry
from sandbox_runtime.servers.learned import owner_of

PATH = re.compile(r"/servers/(?P<name>[a-z0-9][a-z0-9_-]{0,47})/mcp/?")
PRINCIPAL_KEY = "srt.principal"
RESERVED_META = "io.modelcontextprotocol/"
# Requests passed on to the instance (the handshake is answered here), and the type of
# their results: the library fills in what each protocol era's result carries besides.
PASSED_ON: dict[str, type[BaseModel]] = {
    "tools/list": mt.ListToolsResult,
    "tools/call": mt.CallToolResult,
    "resources/list": mt.ListResourcesResult,
    "resources/templates/list": mt.ListResourceTemplatesResult,
    "resources/read": mt.ReadResourceResult,
    "prompts/list": mt.ListPromptsResult,
    "prompts/get": mt.GetPromptResult,
    "completion/complete": mt.CompleteResult,
}


async def _unused(ctx: Any, params: Any) -> Any:
    # (Registered so initialize advertises tools, resources and prompts; the middleware
    # answers every such request before it gets here.)
    raise MCPError(-32603, "not reached")


class HostedServers:
    """The ASGI app for `/servers/{name}/mcp` (auth, then the entry's session manager)."""

    def __init__(
        self,
        settings: Settings,
        root: Root,
        security: TransportSecuritySettings | None,
        verifier: CallerVerifier | None = None,
        metadata: ResourceMetadata | None = None,
    ) -> None:
        self.settings = settings
        self.root = root
        self.security = security
        self._verifier = verifier  # (/mcp's: static tokens, OAuth, the policy's scopes)
        self.metadata = metadata
        self._apps: dict[str, tuple[Entry, StreamableHTTPASGIApp, asyncio.Event]] = {}
        self._lock = asyncio.Lock()

    async def principal(self, scope: Scope) -> str | AccessToken | None:
        """The bearer token, as /mcp's auth finds it (its client_id is the principal; None:
        refused; ANONYMOUS when the server has no tokens)."""
        if self._verifier is None:
            return ANONYMOUS
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return None
                return await self._verifier.verify_token(token.strip())
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PATH.fullmatch(scope["path"])
        if match is None:
            await _plain(send, 404, "no such endpoint: hosted servers are at /servers/NAME/mcp")
            return
        token = await self.principal(scope)
        if token is None:
            await _plain(send, 401, "invalid token")  # (PlainAuthErrors words it)
            return
        principal = token if isinstance(token, str) else token.client_id
        if not self.root.running:
            await _plain(send, 503, "the server is starting or stopping")
            return
        host = self.root.services.servers
        name = match["name"]
        try:
            entry = host.entry_for(name, principal)
        except SandboxRuntimeError:
            try:
                names = [e.name for e in host.catalog().for_principal(principal)]
            except SandboxRuntimeError:  # (a catalog that cannot be read names nothing)
                names = []
            await _no_such_server(scope, receive, send, unknown_server(name, names))
            return
        if not isinstance(token, str):
            identity = identity_of(token.claims, token.client_id)
            needed = server_scope(name, entry.required_scope)
            if not identity.allows(needed):
                policy = self._verifier.policy if self._verifier is not None else None
                text = refusal_text(needed, identity.principal, policy)
                hosted_refused(self.root.services.audit, identity, name)
                path = public_path(scope)
                await insufficient_scope(send, needed, text, self.metadata, path)
                return
        app = await self._app(entry)
        scope = dict(scope, path="/mcp", raw_path=b"/mcp")
        scope[PRINCIPAL_KEY] = principal
        scope[IDENTITY_KEY] = identity_of(getattr(token, "claims", None), principal)
        if not isinstance(token, str):  # (the session manager binds a session to its user)
            scope["user"] = AuthenticatedUser(token)
        await app(scope, receive, send)

    async def _app(self, entry: Entry) -> StreamableHTTPASGIApp:
        """The entry's app: made on first use, and again when its entry changed (the old
        one's sessions end)."""
        known = self._apps.get(entry.name)
        if known is not None and known[0] == entry:
            return known[1]
        async with self._lock:
            known = self._apps.get(entry.name)
            if known is not None and known[0] == entry:
                return known[1]
            if known is not None:
                known[2].set()
            server = self._server(entry)
            manager = StreamableHTTPSessionManager(
                app=server,
                json_response=False,
                stateless=False,
                security_settings=self.security,
            )
            stop = asyncio.Event()
            running = asyncio.Event()
            self.root.services.supervisor.spawn(
                f"hosted server {entry.name} sessions", _run(manager, running, stop)
            )
            await running.wait()
            answer_plainly(manager, self.root.services.supervisor)
            app = StreamableHTTPASGIApp(manager)
            self._apps[entry.name] = (entry, app, stop)
            return app

    def _server(self, entry: Entry) -> Server[Any]:
        server: Server[Any] = Server(
            entry.name,
            version="hosted",
            instructions=f"{entry.name}, hosted in a sandbox by sandbox_runtime",
            on_list_tools=_unused,
            on_call_tool=_unused,
            on_list_resources=_unused,
            on_read_resource=_unused,
            on_list_prompts=_unused,
            on_get_prompt=_unused,
        )
        # (Only the relay: the library's default tracing middleware costs every call.)
        audit = self.root.services.audit
        audited = [AuditedHostedCalls(audit, entry.name)] if audit.enabled else []
        server.middleware[:] = [*audited, Relay(self.root, entry)]
        return server

    async def aclose(self) -> None:
        for _, _, stop in self._apps.values():
            stop.set()


async def _run(
    manager: StreamableHTTPSessionManager, running: asyncio.Event, stop: asyncio.Event
) -> None:
    async with manager.run():
        running.set()
        await stop.wait()


class Relay:
    """The middleware that passes a request on to the caller's instance."""

    def __init__(self, root: Root, entry: Entry) -> None:
        self.root = root
        self.name = entry.name
        # Owners whose start ahead is in flight: one each, however many initializes come
        # meanwhile (each would otherwise leave a task behind that its client never waits for).
        self._ahead: set[Owner] = set()

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if ctx.method == "initialize":
            self._start_ahead(ctx)
        if ctx.method not in PASSED_ON:
            return await call_next(ctx)
        request = ctx.request
        scope: Mapping[str, Any] = getattr(request, "scope", {}) if request is not None else {}
        principal = scope.get(PRINCIPAL_KEY)
        if not isinstance(principal, str):
            raise MCPError(-32603, "no principal for this request")
        services = self.root.services
        try:
            entry = services.servers.entry_for(self.name, principal)
        except SandboxRuntimeError as exc:
            raise MCPError(-32601, str(exc)) from None
        session = scope.get(SESSION_KEY) or "default"
        owner = owner_of(entry, principal, str(session))
        params = dict(ctx.params or {})
        if isinstance(params.get("_meta"), dict):
            # The 2026 era's envelope is this endpoint's; the instance speaks the handshake
            # era, whose servers refuse requests that carry it.
            params["_meta"] = {
                k: v for k, v in params["_meta"].items() if not k.startswith(RESERVED_META)
            }
        caller_token = (
            (params.get("_meta") or {}).get("progressToken")
            if isinstance(params.get("_meta"), dict)
            else None
        )
        wants_progress = caller_token is not None or ctx.method == "tools/call"

        async def relay(_: int, text: str) -> None:
            await _relay_notification(ctx, text, caller_token)

        sink = relay if wants_progress else None
        try:
            answer = await call_instance(services, owner, entry, ctx.method, params, sink)
        except SandboxRuntimeError as exc:
            raise MCPError(-32603, str(exc)) from None
        if "error" in answer:
            error = answer["error"] if isinstance(answer["error"], dict) else {}
            code = error["code"] if isinstance(error.get("code"), int) else -32603
            raise MCPError(code, str(error.get("message", "error")), error.get("data"))
        try:
            return PASSED_ON[ctx.method].model_validate(answer.get("result"))
        except ValidationError as exc:
            raise MCPError(
                -32603,
                f"server {self.name} sent a malformed {ctx.method} result: "
                f"{exc.error_count()} problem(s), first: {exc.errors()[0]['msg']} at "
                f"{'.'.join(map(str, exc.errors()[0]['loc']))}",
            ) from None

    def _start_ahead(self, ctx: ServerRequestContext[Any, Any]) -> None:
        """A `warm` entry that is not shared: the caller's instance starts as its client
        initializes, in the background (the handshake never waits), so its first call finds
        it started or starting. Bounded as that call's own start: the same instance, caps; and
        one start ahead in flight per owner."""
        scope: Mapping[str, Any] = getattr(ctx.request, "scope", None) or {}
        principal, services = scope.get(PRINCIPAL_KEY), self.root.services
        if not isinstance(principal, str):
            return
        try:
            entry = services.servers.entry_for(self.name, principal)
        except SandboxRuntimeError:
            return
        if entry.warm and entry.scope != "shared" and not services.supervisor.closed:
            owner = owner_of(entry, principal, str(scope.get(SESSION_KEY) or "default"))
            if owner in self._ahead:
                return
            self._ahead.add(owner)
            start = _ping(services, owner, entry)
            task = services.supervisor.spawn(f"hosted server {entry.name} start ahead", start)
            task.add_done_callback(lambda _: self._ahead.discard(owner))


async def _ping(services: Services, owner: Owner, entry: Entry) -> None:
    with contextlib.suppress(SandboxRuntimeError):  # (its first call is told why)
        await call_instance(services, owner, entry, "ping", {}, None)


async def call_instance(
    services: Services,
    owner: Owner,
    entry: Entry,
    method: str,
    params: dict[str, Any],
    progress: Any,
) -> dict[str, Any]:
    """One request to `owner`'s instance of `entry`: a stdio server's on its home replica
    (through the Router), a remote one from here (it keeps no state)."""
    if entry.kind == "remote":
        return await services.servers.request(owner, entry.name, method, params, progress)
    args = {"server": entry.name, "method": method, "params": params}
    return await services.router.run(owner, "server_request", args, progress)


async def _relay_notification(
    ctx: ServerRequestContext[Any, Any], text: str, caller_token: Any
) -> None:
    """An instance's notification, to the caller of the request it came with."""
    try:
        message = json.loads(text)
    except ValueError:
        return
    params = message.get("params") if isinstance(message, dict) else None
    if not isinstance(params, dict):
        return
    try:
        if message.get("method") == "notifications/progress":
            if caller_token is None:
                return
            progress = params.get("progress")
            if not isinstance(progress, int | float):
                return
            total = params.get("total")
            note = params.get("message")
            await ctx.session.send_progress_notification(
                caller_token,
                float(progress),
                float(total) if isinstance(total, int | float) else None,
                note if isinstance(note, str) else None,
                related_request_id=ctx.request_id,  # type: ignore[arg-type]
            )
        elif message.get("method") == "notifications/message":
            level = params.get("level")
            if level not in (
                "debug",
                "info",
                "notice",
                "warning",
                "error",
                "critical",
                "alert",
                "emergency",
            ):
                return
            name = params.get("logger")
            with contextlib.suppress(Exception):
                await ctx.session.send_log_message(
                    level,
                    params.get("data"),
                    name if isinstance(name, str) else None,
                    # A request that asked for no progress may be answered by a JSON body
                    # (plain_replies): its logging goes on the session's own stream.
                    related_request_id=ctx.request_id if caller_token is not None else None,
                )
    except Exception as exc:  # (the caller went away)
        logger.debug("hosted server notification not relayed: {}", exc)


def unknown_server(name: str, names: list[str]) -> str:
    """What a caller who may use `names` reads for a URL naming `name` (after auth: an
    unauthenticated caller learns no names)."""
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"no hosted server {name!r}{hint} (list_servers names them)"


MAX_PEEKED_BODY = 64 * 1024


async def _no_such_server(scope: Scope, receive: Receive, send: Send, text: str) -> None:
    """404 with `text`, except for a POST of JSON-RPC requests (an MCP client's initialize,
    discover or stateless call): a JSON-RPC error for each, in a 200. The 1.x Python client
    turns any 404 into "Session terminated" and never reads the body of another error status;
    a JSON-RPC error in a 200 reaches every client's user as its message."""
    ids = await _request_ids(scope, receive) if scope.get("method") == "POST" else None
    if not ids:
        await _plain(send, 404, text)
        return
    errors = [{"jsonrpc": "2.0", "id": i, "error": {"code": -32600, "message": text}} for i in ids]
    body = json.dumps(errors if len(errors) > 1 else errors[0]).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _request_ids(scope: Scope, receive: Receive) -> list[Any] | None:
    """The ids of the JSON-RPC requests in a POST's body (None: not JSON-RPC requests, or a
    body past MAX_PEEKED_BODY, which is not read further)."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        if len(body) > MAX_PEEKED_BODY:
            return None
        if not message.get("more_body", False):
            break
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    ids = [
        i.get("id")
        for i in items
        if isinstance(i, dict) and isinstance(i.get("method"), str) and "id" in i
    ]
    return ids or None


async def _plain(send: Send, status: int, text: str) -> None:
    body = json.dumps({"error": text}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
