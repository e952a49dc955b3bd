"""Running the app under uvicorn with a bounded, execution-first graceful shutdown."""

from __future__ import annotations

import asyncio
import socket
from types import FrameType

import uvicorn
from loguru import logger
from sse_starlette.sse import AppStatus

from sandbox_runtime.app.services import Root
from sandbox_runtime.config import Settings, cli_name
from sandbox_runtime.config.command import connect_hint, listen_url
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.logs import setup_logging
from sandbox_runtime.server.app import create_app
from sandbox_runtime.server.heads import HeadTimeoutProtocol, say_why_in_401s

REPLY_GRACE = 0.5  # after the executions stopped: time for calls that waited on one to answer


class _Server(uvicorn.Server):
    """On SIGTERM/SIGINT, stop the executions first, then let uvicorn close connections."""

    def __init__(self, config: uvicorn.Config, root: Root) -> None:
        super().__init__(config)
        self.root = root
        self._stopping: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Stop listening at once (uvicorn) so a proxy sends new work elsewhere, and at the
        # same time stop the executions; the lifespan's exit waits for both to finish.
        if self._stopping is None:
            logger.info("signal {}: stopping executions and the server", sig)
            try:
                supervisor = self.root.services.supervisor
                self._stopping = supervisor.spawn(
                    "stop executions on signal", self._stop_executions()
                )
            except (SandboxRuntimeError, RuntimeError):  # starting, or closed: nothing to stop
                AppStatus.should_exit = True
            if self._stopping is not None and self.root.services.settings.role == "worker":
                # A draining worker keeps its cluster listener until it has stopped: api
                # replicas still reach its running executions (stdin, cancel, output). A
                # second signal stops listening at once.
                self._stopping.add_done_callback(
                    lambda _: super(_Server, self).handle_exit(sig, frame)
                )
                return
        super().handle_exit(sig, frame)

    async def _stop_executions(self) -> None:
        try:
            if self.root.running:
                await self.root.services.stop()
            await asyncio.sleep(REPLY_GRACE)
        finally:
            AppStatus.should_exit = True  # now end the SSE streams still open


async def serve(settings: Settings) -> int:
    # sse-starlette ends every SSE response at the signal, the replies of legacy-era calls
    # waiting on an execution included; end them once the executions have stopped instead.
    AppStatus.disable_automatic_graceful_drain()
    AppStatus.should_exit = False  # a process-wide flag: a previous serve() may have set it
    root = Root()
    sockets: list[socket.socket] | None = None
    cluster_port: int | None = None
    cluster_address = ""
    if settings.redis_url and settings.cluster_secret is not None and settings.role != "api":
        # Several replicas share the store: listen for their forwarded calls too (a worker:
        # only for them, and its probes).
        cluster_host, port = settings.cluster_bind()
        public = None
        if settings.role == "all":
            try:
                public = bind(settings.host, settings.port)
            except OSError as exc:
                logger.error(
                    "cannot listen on {}:{} (SANDBOX_PORT): {}", settings.host, settings.port, exc
                )
                return 1
        try:
            cluster = bind(cluster_host, port)
        except OSError as exc:
            if public is not None:
                public.close()
            logger.error(
                "cannot listen on {}:{} for other replicas (SANDBOX_CLUSTER_HOST / "
                "SANDBOX_CLUSTER_PORT, default the public port + 1): {}",
                cluster_host,
                port,
                exc,
            )
            return 1
        sockets = [public, cluster] if public is not None else [cluster]
        cluster_port = cluster.getsockname()[1]
        cluster_address = settings.cluster_advertise or f"{advertised(cluster_host)}:{cluster_port}"
        logger.info(
            "cluster listener on {}:{} (advertised as {})",
            cluster_host,
            cluster_port,
            cluster_address,
        )
    app = create_app(settings, cluster_port, cluster_address, root)
    setup_logging(settings)  # again: importing the MCP libraries installed their own handlers
    say_why_in_401s()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        log_level="info" if settings.access_log else "warning",
        access_log=settings.access_log,
        log_config=None,  # keep our handlers: uvicorn's records go to loguru
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace) + 1),
        # Longer than a proxy's idle keep-alive to us (nginx's shipped config: 50 s), so the
        # proxy, not we, closes an idle connection: never one it is sending a request on.
        timeout_keep_alive=75,
        proxy_headers=True,
        server_header=False,
        http=HeadTimeoutProtocol,  # (a head sent too slowly is cut: heads.py)
    )
    server = _Server(config, root)
    principals = sorted(set(settings.tokens().values()))
    base = listen_url(settings.host, settings.port)
    logger.info(
        "srt-mcp-server replica {} listening on {}/mcp (auth: {})\n  health: {}/health, "
        "readiness: {}/ready\n  wire an MCP client to it: {} (or cursor, "
        "vscode, windsurf, codex, gemini, zed, cline, claude-desktop; `{} clients` lists them)",
        settings.replica_id,
        base,
        ", ".join(
            ([f"bearer token, principals: {', '.join(principals)}"] if principals else [])
            + [f"OAuth from {i}" for i in settings.oauth_issuers()]
        )
        or "none",
        base,
        base,
        connect_hint(settings),
        cli_name(),
    )
    await server.serve(sockets=sockets)
    return 0


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens on it).

    Raises OSError (address in use, unknown host).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def advertised(host: str) -> str:
    """How other replicas reach a listener bound to `host`."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host
