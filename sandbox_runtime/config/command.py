"""How the operator runs this CLI, for the hints it prints: each must run as printed."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox_runtime.config.settings import Settings

NAME = "srt-mcp-server"


def cli_name() -> str:
    """`srt-mcp-server` when that is on PATH; else what ./scripts/srt says it is run as
    (SRT_CLI), else the path this process was started by (`.venv/bin/srt-mcp-server`)."""
    if os.environ.get("SRT_CLI"):
        return os.environ["SRT_CLI"]
    if shutil.which(NAME):
        return NAME
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is None or argv0.name != NAME or not argv0.exists():
        return NAME
    try:
        return "./" + str(argv0.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(argv0.resolve())


def listen_url(host: str, port: int) -> str:
    """Where the server listens, as a URL (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def local_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a server listening on (host, port) by."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def connect_hint(settings: Settings) -> str:
    """The command the server's start names to wire a client: with `--url` when the server
    listens elsewhere than `connect`, reading only the environment and .env, would say (it
    was given --host or --port), and the token's variable when it was given --token."""
    from sandbox_runtime.config.settings import Settings

    command = f"{cli_name()} connect claude-code"
    environment_only: dict[str, Any] = {}  # (no flags: what `connect` reads)
    try:
        configured: Settings | None = Settings(**environment_only)
    except ValueError:  # (pydantic's ValidationError is one)
        configured = None
    here = local_url(settings.host, settings.port)
    if configured is None or local_url(configured.host, configured.port) != here:
        command += f" --url {here}/mcp"
    if settings.tokens() and (configured is None or not configured.tokens()):
        command += " (with SANDBOX_AUTH_TOKEN set to the token given by --token)"
    return command
