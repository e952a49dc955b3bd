"""The ASGI application: lifespan (one ExecutionManager), /health, auth, the MCP endpoint."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastmcp import FastMCP
from fastmcp.server.http import HostOriginGuardMiddleware
from mcp import types as mt
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sandbox_runtime import __version__, fds
from sandbox_runtime.app.services import Root, build
from sandbox_runtime.config import Settings
from sandbox_runtime.console import Console
from sandbox_runtime.e2b.app import PREFIX as E2B_PREFIX
from sandbox_runtime.e2b.app import E2BApp
from sandbox_runtime.server.audit_calls import AuditedCalls, AuditedFiles, refused_call
from sandbox_runtime.server.auth import CallerVerifier, PlainAuthErrors, no_registration
from sandbox_runtime.server.calls import ScopeCheck
from sandbox_runtime.server.console_oauth import console_oauth
from sandbox_runtime.server.dispatch import dispatch_fixed_tools
from sandbox_runtime.server.environment_tools import register_environment_tools
from sandbox_runtime.server.file_tools import register_file_tools
from sandbox_runtime.server.files_http import CLUSTER_PREFIX, PUBLIC_PREFIX, FilesApp
from sandbox_runtime.server.hosted import HostedServers
from sandbox_runtime.server.interpreter_tools import register_interpreter_tools
from sandbox_runtime.server.oauth_edge import (
    guard_scopes,
    make_verifier,
    metadata_routes,
    resource_metadata,
)
from sandbox_runtime.server.plain_replies import answer_plainly_where_possible
from sandbox_runtime.server.replies import ErrorResults
from sandbox_runtime.server.schemas import make_portable
from sandbox_runtime.server.server_tools import register_search_tool, register_server_tools
from sandbox_runtime.server.session_path import SessionPathMiddleware
from sandbox_runtime.server.session_tag import SessionTagMiddleware
from sandbox_runtime.server.snapshot_tools import register_snapshot_tools
from sandbox_runtime.server.tools import register_tools
from sandbox_runtime.sessions.listener import ClusterApp

INSTRUCTIONS = (
    "Runs commands in an isolated Linux sandbox (no network, unprivileged, limited memory, "
    "processes and time) with a persistent /workspace per session. execute_code runs and waits; "
    "execute_code_async starts and returns an execution_id to poll with get_execution_output "
    "(pass next_cursor as last_event_id), feed with send_stdin (interactive=true) and stop with "
    "cancel_execution. run_code runs Python, JavaScript, TypeScript or bash in a persistent "
    "interpreter per session (state kept between calls; plots returned as images)."
)


def build_mcp(settings: Settings, root: Root, auth: CallerVerifier | None = None) -> FastMCP:
    auth = auth or make_verifier(settings)
    mcp = FastMCP(
        "sandbox_runtime",
        instructions=INSTRUCTIONS,
        version=__version__,
        auth=auth,
        mask_error_details=True,
        # Modern (2026-07-28) requests re-list the tools to check arguments: dereferencing
        # every schema each time cost ~60% of the CPU of a call. make_portable inlines them
        # once, at startup.
        dereference_schemas=False,
        middleware=[
            *([AuditedCalls(root)] if settings.audit_log else []),  # (outermost: sees all)
            ErrorResults(settings.result_text, settings.result_max_chars),
            # (scopes can be short of every scope only with a policy file or OAuth)
            *([ScopeCheck(root, auth.policy)] if auth and (auth.policy or auth.oauth) else []),
        ],
    )
    register_tools(mcp, root)
    register_interpreter_tools(mcp, root)
    register_file_tools(mcp, root)
    register_server_tools(mcp, root)
    register_search_tool(mcp, root)
    register_snapshot_tools(mcp, root)
    register_environment_tools(mcp, root)
    return mcp


async def _cache_input_schemas(mcp: FastMCP) -> None:
    """Serve the 2026-07-28 `Mcp-Param-*` header check from a table of the tools' schemas.

    Without a lookup the SDK runs a whole tools/list through the server on every tools/call
    (~25% of a call's CPU). Our tools are fixed at startup and the same for every caller, so
    the schemas it would find are these.
    """
    tools = await mcp.list_tools(run_middleware=False)
    schemas = {t.name: t.to_mcp_tool(name=t.name).input_schema for t in tools}
    # A schema without any x-mcp-header annotation declares no header: nothing to validate
    # (None), which also spares the SDK walking the schema on every call.
    annotated = {n: s for n, s in schemas.items() if "x-mcp-header" in json.dumps(s)}
    mcp._mcp_server.get_tool_input_schema = annotated.get


async def _cache_tool_list(mcp: FastMCP) -> None:
    """Answer tools/list from one result made at startup.

    The library rebuilds it on every request (each tool converted, checked for visibility and
    auth, through the middleware): a new client's first request cost ~4x a no-op call. Our
    tools are fixed at startup and the same for every caller, and the list is one page (the
    library ignores a cursor without a page size, as this does).
    """
    tools = await mcp.list_tools(run_middleware=False)
    listed = mt.ListToolsResult(tools=[t.to_mcp_tool(name=t.name) for t in tools])

    async def list_tools(ctx: Any, params: mt.PaginatedRequestParams) -> mt.ListToolsResult:
        return listed

    mcp._mcp_server.add_request_handler("tools/list", mt.PaginatedRequestParams, list_tools)


def create_app(
    settings: Settings,
    cluster_port: int | None = None,
    cluster_address: str = "",
    root: Root | None = None,
) -> ASGIApp:
    """The whole server as one ASGI app. Its lifespan builds the parts (app/services.py) and
    tears them down; `root` (made here if not given) is where they are found meanwhile.

    With `cluster_port`, requests that arrive on that port (the cluster listener) reach only
    the replica-to-replica calls, and requests on any other port never do.
    """
    root = root or Root()
    verifier = make_verifier(settings)
    metadata = resource_metadata(settings)
    mcp = build_mcp(settings, root, verifier)
    files = FilesApp(lambda: root.services.router, lambda: root.services.signer)
    allowed = [h.strip() for h in settings.allowed_hosts.split(",") if h.strip()]
    protection: bool | Literal["auto"]
    if allowed == ["auto"] or not allowed:
        protection, hosts = "auto", None
    elif "*" in allowed:
        protection, hosts = False, None
    else:
        protection, hosts = True, allowed
    e2b = E2BApp(settings, root, files) if settings.e2b else None
    security = _transport_security(settings, protection, hosts)
    hosted = HostedServers(settings, root, security, verifier, metadata)
    mcp_app = mcp.http_app(
        path="/mcp",
        # An api replica keeps no transport sessions: behind a balancer with no affinity,
        # the next request of a legacy-era client may reach any replica.
        stateless_http=settings.role == "api",
        json_response=False,
        host_origin_protection=protection,
        allowed_hosts=hosts,
        event_store=_event_store(settings),
        retry_interval=1000 if settings.redis_url else None,
    )
    audit_refusal = refused_call(lambda: root.services.audit if root.running else None)
    guard_scopes(mcp_app.routes, metadata, verifier, audit_refusal)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with (
            build(settings, cluster_address) as services,
            root.serving(services),
            contextlib.AsyncExitStack() as stack,
        ):
            await make_portable(mcp)
            await _cache_input_schemas(mcp)
            await _cache_tool_list(mcp)
            if settings.fast_dispatch:
                await dispatch_fixed_tools(mcp)
            stack.push_async_callback(hosted.aclose)
            if verifier is not None:
                stack.push_async_callback(verifier.aclose)
            if e2b is not None:
                e2b.start(services)
            async with mcp_app.lifespan(app):
                answer_plainly_where_possible(mcp_app.routes, services.supervisor)
                # What startup made (~150k objects) lives as long as the process: frozen, a
                # full collection walks only what calls made (~100 ms a collection before).
                gc.collect()
                gc.freeze()
                yield

    async def health(request: Request) -> JSONResponse:
        if not root.running:
            return JSONResponse({"status": "starting", "version": __version__}, status_code=503)
        services = root.services
        current = services.manager
        sandbox = current.backend.unavailable_reason if settings.role != "api" else None
        redis = services.cluster.store_status
        cluster = services.cluster.problem or services.cluster.clock_problem
        if not current.egress_policy.enabled:
            egress = "disabled"
        elif current.egress is None or current.egress.problem is not None:
            egress = f"unavailable: {current.egress.problem if current.egress else 'not started'}"
        else:
            egress = "ok"  # (a proxy that died is restarted by the next sandbox that needs it)
        disk = current.workspaces.disk.status()
        damaged = current.workspaces.damaged()
        descriptors = fds.usage()
        healthy = (
            not disk.low
            and descriptors.problem is None
            and sandbox is None
            and redis in ("ok", "disabled")
            and cluster is None
            and egress in ("ok", "disabled")
        )
        body = {
            "status": "ok" if healthy else "degraded",
            "version": __version__,
            "replica_id": current.replica_id,
            "running_executions": current.running_count,
            "role": settings.role,
            "sandbox": "ok" if sandbox is None else f"unavailable: {sandbox}",
            "redis": redis,
            "mirror_backlog": services.cluster.backlog,
            "cluster": "disabled" if redis == "disabled" else cluster or "ok",
            "cluster_clock_skew_seconds": services.cluster.clock_skews,
            "store_clock_skew_seconds": services.cluster.store_clock_skew,
            "egress": egress,
            "disk": {
                "status": "low" if disk.low else "ok",
                "free_mb": disk.free_bytes // 2**20,
                "min_free_mb": settings.min_free_disk_mb,
                "reserve": current.workspaces.disk.reserve,
                "writes_stopped": current.workspaces.guard.stopped,
                "damaged_workspaces": len(damaged),
            },
            "workspaces": current.workspaces.describe_mode(),
            "file_descriptors": descriptors.as_dict(),
            "uptime_seconds": round(time.time() - current.started_at, 1),
        }
        return JSONResponse(body)

    metrics_tokens = _metrics_token_digests(settings)

    async def metrics(request: Request) -> Response:
        if metrics_tokens is not None:
            offered = request.headers.get("authorization", "")
            scheme, _, token = offered.partition(" ")
            digest = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).digest()
            allowed = scheme.lower() == "bearer" and any(
                hmac.compare_digest(digest, d) for d in metrics_tokens
            )
            if not allowed:
                return Response(
                    status_code=401, headers={"WWW-Authenticate": 'Bearer realm="metrics"'}
                )
        if not root.running:
            return Response("starting\n", status_code=503)
        current = root.services.manager
        body, content_type = current.metrics.render()
        return Response(body, media_type=content_type)

    async def ready(request: Request) -> JSONResponse:
        if not root.running:
            return JSONResponse({"ready": False, "reasons": ["starting"]}, status_code=503)
        current = root.services.manager
        reasons = []
        if current.backend.unavailable_reason is not None and settings.role != "api":
            reasons.append(f"sandbox: {current.backend.unavailable_reason}")
        if settings.role == "api":
            try:
                if not await root.services.cluster.live_workers():
                    reasons.append("no live worker: new sessions cannot be placed")
            except Exception as exc:  # (the store: reported below too)
                reasons.append(f"workers unknown: {type(exc).__name__}")
        disk = current.workspaces.disk.status()
        if disk.low:
            reasons.append(
                f"disk: the state filesystem has {disk.free_bytes // 2**20} MiB free, below "
                f"SANDBOX_MIN_FREE_DISK_MB={settings.min_free_disk_mb}"
            )
        if (problem := fds.usage().problem) is not None:
            reasons.append(problem)
        if (problem := await root.services.cluster.unreachable()) is not None:
            reasons.append(problem)
        if (problem := root.services.cluster.own_clock_problem) is not None:
            reasons.append(problem)
        body = {"ready": not reasons, "replica_id": current.replica_id, "reasons": reasons}
        return JSONResponse(body, status_code=200 if not reasons else 503)

    console: list[BaseRoute] = []
    if settings.console:
        guard: list[Middleware] = []
        if protection is not False:  # the same DNS-rebinding guard as /mcp's
            mode: Literal["auto", "strict"] = "strict" if protection is True else "auto"
            guard.append(Middleware(HostOriginGuardMiddleware, allowed_hosts=hosts, mode=mode))
        pages = Console(console_oauth(settings))
        console = [
            Route("/", pages.page, methods=["GET", "HEAD"], middleware=guard),
            Route("/console/{name}", pages.file, methods=["GET", "HEAD"], middleware=guard),
        ]
    public = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *(
                [Route("/register", no_registration, methods=["GET", "POST"])]
                if not metadata
                else []
            ),
            *metadata_routes(metadata),
            *console,
            Route("/servers/{name}/mcp", hosted, methods=["GET", "POST", "DELETE"]),
            Mount("/", app=mcp_app),
        ],
        middleware=[
            Middleware(PlainAuthErrors, metadata=metadata),
            Middleware(SessionTagMiddleware, replica_id=settings.replica_id),
            Middleware(SessionPathMiddleware),
        ],
        lifespan=lifespan,
    )
    # Signed file URLs carry their own authority: they bypass the MCP app's auth and Host checks.
    audited = AuditedFiles(files, lambda: root.services.audit if root.running else None)
    edges: dict[str, ASGIApp] = {PUBLIC_PREFIX: audited}
    if e2b is not None:  # (its own keys and access tokens: not the MCP app's auth)
        edges[E2B_PREFIX + "/"] = e2b
    served = PrefixDispatch(public, edges)
    if cluster_port is None:
        return served
    cluster = ClusterApp(lambda: root.services.router, {CLUSTER_PREFIX: files})
    probes = PROBES if settings.role == "worker" else ()  # (a worker serves only this port)
    return ClusterDispatch(served, cluster, cluster_port, probes)


class PrefixDispatch:
    """Sends HTTP requests under a path prefix to its own app, all else (lifespan included)
    to the default app."""

    def __init__(self, default: ASGIApp, routes: dict[str, ASGIApp]) -> None:
        self.default = default
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for prefix, app in self.routes.items():
                if scope["path"].startswith(prefix):
                    await app(scope, receive, send)
                    return
        await self.default(scope, receive, send)


class ClusterDispatch:
    """Sends requests that arrived on the cluster port to the cluster app, all else to the
    public app (lifespan included)."""

    def __init__(
        self, public: ASGIApp, cluster: ASGIApp, cluster_port: int, probes: tuple[str, ...] = ()
    ) -> None:
        self.public = public
        self.cluster = cluster
        self.cluster_port = cluster_port
        self.probes = probes  # paths of the public app served on the cluster port too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        on_cluster = server is not None and server[1] == self.cluster_port
        if scope["type"] == "http" and on_cluster and scope["path"] not in self.probes:
            await self.cluster(scope, receive, send)
        else:
            await self.public(scope, receive, send)


LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
PROBES = ("/health", "/ready", "/metrics")


def _transport_security(
    settings: Settings, protection: bool | Literal["auto"], hosts: list[str] | None
) -> TransportSecuritySettings | None:
    """The hosted servers' DNS-rebinding guard, as /mcp's: the allowed hosts if given; for
    "auto", the loopback names when the server is bound to loopback."""
    if protection is False:
        return None
    if protection is True and hosts:
        return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts)
    if settings.host in ("127.0.0.1", "localhost", "::1"):
        return TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=[f"{h}{p}" for h in LOOPBACK for p in ("", ":*")],
            allowed_origins=[f"http://{h}{p}" for h in LOOPBACK for p in ("", ":*")],
        )
    return None


def _event_store(settings: Settings) -> Any:
    """Legacy SSE streams resumable with Last-Event-ID; their events kept in Redis if configured.

    Resumption works on the replica that holds the MCP session (sticky routing sends it there).
    """
    if not settings.redis_url:
        return None
    from fastmcp.server.event_store import EventStore
    from key_value.aio.stores.redis import RedisStore as KeyValueRedisStore

    from sandbox_runtime.state.redis_store import redis_client

    # Our client, not the library's from the URL: that one has no socket timeouts (a Redis that
    # stops answering would hold a stream forever) and retries with backoff up to 10 s.
    client = redis_client(
        settings.redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
    )
    return EventStore(
        storage=KeyValueRedisStore(client=client),
        max_events_per_stream=1000,
        ttl=settings.retention_seconds,
    )


def _metrics_token_digests(settings: Settings) -> list[bytes] | None:
    """Digests of the tokens that may scrape /metrics; None: open (no token configured)."""
    if settings.metrics_token is not None and settings.metrics_token.get_secret_value():
        tokens = [settings.metrics_token.get_secret_value()]
    else:
        tokens = list(settings.tokens())
    if not tokens:  # (signed-in users' tokens are not for scrapers: set SANDBOX_METRICS_TOKEN)
        return [] if settings.oauth_issuers() else None
    return [hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest() for t in tokens]
