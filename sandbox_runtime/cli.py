"""`srt-mcp-server`: serve (the default), `doctor`, `runtime install`, `servers …`, `env …`,
`audit`, or `connect|disconnect|clients|token` (sandbox_runtime/connect)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ipaddress
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TextIO

from loguru import logger
from pydantic import ValidationError

from sandbox_runtime import __version__
from sandbox_runtime.config import Settings, cli_name
from sandbox_runtime.logs import setup_logging

FLAG_TO_SETTING = {
    "host": "host",
    "port": "port",
    "token": "auth_token",
    "redis_url": "redis_url",
    "max_concurrent": "max_concurrent",
    "max_per_session": "max_per_session",
    "timeout": "timeout",
    "max_timeout": "max_timeout",
    "log_file": "log_file",
    "log_level": "log_level",
    "replica_id": "replica_id",
    "state_dir": "state_dir",
    "sandbox_user": "sandbox_user",
    "allow_unauthenticated": "allow_unauthenticated",
    "allowed_hosts": "allowed_hosts",
    "console": "console",
    "role": "role",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="srt-mcp-server",
        description="Sandboxed, stateful code execution for AI agents over MCP (Streamable HTTP).",
        epilog="Every flag also reads from the environment (SANDBOX_<NAME>, REDIS_URL) and .env.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "command",
        nargs="?",
        choices=["serve", "doctor", "runtime"],
        default="serve",
        help="serve (default); doctor: check the host; runtime install: build the sandbox "
        "runtime (Python data stack, Deno, kernels) into SANDBOX_RUNTIME_DIR; servers "
        "add|list|remove|install|logs|import: the hosted MCP servers (servers --help); "
        "connect CLIENT…|disconnect|clients: wire MCP clients (Claude Code, Cursor, VS Code, "
        "…) to this server (connect --help); audit: the audit log, filtered (audit --help); "
        "token new: make a bearer token; secrets "
        "set|list|rm|keygen|rekey: keys the egress proxy adds to requests (secrets --help); env "
        "build|import|list|inspect|rm|prune|push|fetch: environments (env --help)",
    )
    parser.add_argument("action", nargs="?", choices=["install"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--force", action="store_true", help="runtime install: rebuild even if installed"
    )
    parser.add_argument(
        "--if-missing",
        action="store_true",
        help="runtime install: do nothing (quietly) when a runtime is installed",
    )
    parser.add_argument(
        "--progress-log",
        metavar="FILE",
        help="runtime install: append its progress to FILE (shown when it fails), not stderr",
    )
    parser.add_argument("--host", help="address to listen on (SANDBOX_HOST, default 127.0.0.1)")
    parser.add_argument("--port", "-p", type=int, help="port (SANDBOX_PORT, default 8080)")
    parser.add_argument(
        "--token",
        "-t",
        help="bearer token clients must send (SANDBOX_AUTH_TOKEN; prefer the variable: "
        "command lines are visible to other local users)",
    )
    parser.add_argument("--redis-url", help="Redis to mirror into (REDIS_URL)")
    parser.add_argument("--max-concurrent", type=int, help="SANDBOX_MAX_CONCURRENT")
    parser.add_argument("--max-per-session", type=int, help="SANDBOX_MAX_PER_SESSION")
    parser.add_argument("--timeout", type=float, help="default timeout, s (SANDBOX_TIMEOUT)")
    parser.add_argument("--max-timeout", type=float, help="SANDBOX_MAX_TIMEOUT")
    parser.add_argument("--log-file", help="SANDBOX_LOG_FILE")
    parser.add_argument("--log-level", help="SANDBOX_LOG_LEVEL")
    parser.add_argument("--replica-id", help="SANDBOX_REPLICA_ID")
    parser.add_argument("--state-dir", help="SANDBOX_STATE_DIR")
    parser.add_argument("--sandbox-user", help="SANDBOX_SANDBOX_USER")
    parser.add_argument("--allowed-hosts", help="SANDBOX_ALLOWED_HOSTS")
    parser.add_argument(
        "--role",
        choices=["all", "api", "worker"],
        help="all (default): one process serves MCP and runs sandboxes; api: MCP only, "
        "sessions placed on workers; worker: sandboxes only (SANDBOX_ROLE)",
    )
    parser.add_argument(
        "--no-console",
        dest="console",
        action="store_false",
        default=None,
        help="do not serve the web console at / (SANDBOX_CONSOLE=false)",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="serve without a token on a non-loopback address (SANDBOX_ALLOW_UNAUTHENTICATED)",
    )
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for flag, name in FLAG_TO_SETTING.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def _describe_validation(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        if not err["loc"]:  # a check across settings: its message names them
            lines.append(f"invalid settings: {err['msg'].removeprefix('Value error, ')}")
            continue
        loc = ".".join(str(p) for p in err["loc"])
        env = "REDIS_URL" if loc == "redis_url" else f"SANDBOX_{loc.upper()}"
        lines.append(f"invalid setting {env} (--{loc.replace('_', '-')}): {err['msg']}")
    return "\n".join(lines)


def state_dir_problem(path: Path) -> str | None:
    """One line saying what to set when the state dir (or a directory in it) cannot be made
    or written, e.g. the default /var/lib/sandbox-runtime for a user who is not root."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        unwritable = [p for p in (path, *path.iterdir()) if p.is_dir() and not _writable(p)]
    except OSError as exc:
        unwritable, reason = [Path(exc.filename or path)], exc.strerror or str(exc)
    else:
        reason = "not writable by this user"
    if not unwritable:
        return None
    return (
        f"cannot use the state dir {path} ({unwritable[0]}: {reason}): set SANDBOX_STATE_DIR "
        f"(or --state-dir) to a directory this user can write, e.g. "
        f"SANDBOX_STATE_DIR={Path.home()}/.local/state/sandbox-runtime"
    )


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["servers"]:  # its own sub-commands and flags (`servers --help`)
        from sandbox_runtime.servers.cli import main as servers_main

        return servers_main(argv[1:])
    if argv[:1] == ["secrets"]:  # set|list|rm|keygen|rekey (`secrets --help`)
        from sandbox_runtime.egress.secrets_cli import main as secrets_main

        return secrets_main(argv[1:])
    if argv[:1] == ["env"]:  # build|import|list|inspect|rm|push|fetch (`env --help`)
        from sandbox_runtime.environments.cli import main as env_main

        return env_main(argv[1:], shared=_shared_store)
    if argv[:1] == ["audit"]:  # the audit log, filtered (`audit --help`)
        from sandbox_runtime.audit.cli import main as audit_main

        return audit_main(argv[1:])
    if argv[:1] and argv[0] in ("connect", "disconnect", "clients", "token"):
        from sandbox_runtime.connect.cli import main as connect_main

        return connect_main(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        print(_describe_validation(exc), file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"invalid settings: {exc}", file=sys.stderr)
        return 2
    if args.command == "doctor":
        from sandbox_runtime.doctor import run_doctor

        return run_doctor(settings)
    if args.command == "runtime":
        return _runtime(settings, args)
    from sandbox_runtime.egress.secrets import settings_problem
    from sandbox_runtime.oauth.policy import policy_problem

    problem = (
        state_dir_problem(settings.state_dir)
        or settings_problem(settings)
        or policy_problem(settings.policy_file)
    )
    if problem:
        print(problem, file=sys.stderr)
        return 2
    setup_logging(settings)
    if not settings.tokens() and not settings.oauth_issuers() and not is_loopback(settings.host):
        if not settings.allow_unauthenticated:
            print(
                f"refusing to listen on {settings.host} without a token: set SANDBOX_AUTH_TOKEN "
                "(or --token), or pass --allow-unauthenticated if a proxy authenticates",
                file=sys.stderr,
            )
            return 2
        logger.warning("serving on {} WITHOUT authentication", settings.host)
    from sandbox_runtime.app.state_lock import StateDirInUseError, holding, needs_lock
    from sandbox_runtime.server.run import serve
    from sandbox_runtime.workspaces.override import give_up_quota_override

    with contextlib.ExitStack() as held:
        if needs_lock(settings.role):  # before anything touches the state directory
            with contextlib.suppress(OSError):  # (before any thread: workspaces/override.py)
                give_up_quota_override()
            try:
                held.enter_context(holding(settings.state_dir))
            except StateDirInUseError as exc:
                print(f"refusing to start: {exc}", file=sys.stderr)
                return 1
            except OSError as exc:
                print(
                    f"cannot lock the state directory (SANDBOX_STATE_DIR): {exc}", file=sys.stderr
                )
                return 1
        try:
            return _run(serve(settings))
        except KeyboardInterrupt:  # a second Ctrl+C while stopping: the server has said so
            return 130


def _shared_store(settings: Settings) -> Any:
    """The snapshot store, where environments are shared between workers (by digest)."""
    from sandbox_runtime.snapshots.stores import open_store

    store = open_store(
        settings.snapshot_store,
        settings.state_dir / "snapshots",
        endpoint=settings.snapshot_s3_endpoint,
        region=settings.snapshot_s3_region,
        timeout=settings.snapshot_store_timeout,
    )
    if store is None:
        raise SystemExit("SANDBOX_SNAPSHOT_STORE is 'none': no store to share environments")
    return store


def _runtime(settings: Settings, args: argparse.Namespace) -> int:
    from sandbox_runtime.interpreters.runtime import load_runtime

    if args.action != "install":
        print(f"usage: {cli_name()} runtime install [--force] [--if-missing]", file=sys.stderr)
        return 2
    path = settings.runtime_path()
    if args.if_missing and load_runtime(path) is not None:
        return 0
    if not args.progress_log:
        return _install_runtime(settings, args, sys.stderr)
    print(
        f"installing the sandbox runtime into {path} (~1 min; log: {args.progress_log})",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(args.progress_log, "a") as progress:
        # the installers it runs (pip, deno) write to fds 1 and 2: into the log too
        os.dup2(progress.fileno(), 1)
        os.dup2(progress.fileno(), 2)
        try:
            code = _install_runtime(settings, args, progress)
        finally:
            progress.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    if code:
        with open(args.progress_log, errors="replace") as f:
            sys.stderr.writelines(collections.deque(f, maxlen=40))
    return code


def _install_runtime(settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    from sandbox_runtime.interpreters.runtime import RuntimeInstallError, install_runtime

    try:
        runtime = install_runtime(
            settings.runtime_path(),
            requirements=settings.runtime_requirements,
            force=args.force,
            log=lambda line: print(line, file=out, flush=True),
        )
    except RuntimeInstallError as exc:
        print(f"runtime install failed: {exc}", file=out)
        return 1
    print(f"languages: {', '.join(runtime.languages)}", file=out)
    return 0


def _run(main: Coroutine[Any, Any, int]) -> int:
    """Run the server on uvloop when installed (uvicorn only picks it itself in uvicorn.run)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


if __name__ == "__main__":
    sys.exit(main())
