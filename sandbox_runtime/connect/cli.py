"""`srt-mcp-server connect|disconnect|clients|token`: the commands that wire MCP clients to
this server (or to one hosted server's endpoint) and make its tokens."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import secrets
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from sandbox_runtime.config import Settings, cli_name
from sandbox_runtime.config.command import local_url
from sandbox_runtime.connect import wiring
from sandbox_runtime.connect.clients import ALIASES, CLIENTS, SCOPES, Client, Target, lookup

DEFAULT_NAME = "sandbox-runtime"
TOKEN_VAR = "SANDBOX_AUTH_TOKEN"  # noqa: S105 (the variable's name, not a token)
PRINCIPAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def main(command: str, argv: Sequence[str]) -> int:
    try:
        if command == "token":
            return _token(list(argv))
        args = _parse(command, list(argv))
        settings = _settings()
        if command == "clients":
            return _clients(args, settings)
        return _wire(command, args, settings)
    except UsageError as exc:
        print(f"{cli_name()} {command}: {exc}", file=sys.stderr)
        return 2
    except wiring.WiringError as exc:
        print(f"{cli_name()} {command}: {exc}", file=sys.stderr)
        return 1


def _settings() -> Settings:
    environment_only: dict[str, Any] = {}  # (no flags: the environment and .env)
    try:
        return Settings(**environment_only)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise UsageError(f"invalid settings: {problems}") from None
    except ValueError as exc:
        raise UsageError(f"invalid settings: {exc}") from None


def _parse(command: str, argv: list[str]) -> argparse.Namespace:
    names = ", ".join(CLIENTS)
    p = _Parser(
        prog=f"{cli_name()} {command}",
        description={
            "connect": "Add this server (or a hosted server's endpoint) to MCP clients.",
            "disconnect": "Remove what `connect` added from MCP clients.",
            "clients": "The MCP clients here: installed? wired to this server? at which URL?",
        }[command],
        epilog=f"clients: {names}",
    )
    if command != "clients":
        p.add_argument("clients", nargs="*", metavar="CLIENT", help=f"one or more of: {names}")
        p.add_argument(
            "--all-detected", action="store_true", help="every client installed on this machine"
        )
        p.add_argument(
            "--server",
            metavar="NAME",
            help="a hosted server's endpoint (/servers/NAME/mcp) instead of /mcp",
        )
        p.add_argument(
            "--name",
            help=f"the entry's name in the client (default {DEFAULT_NAME}, or "
            f"{DEFAULT_NAME}-NAME with --server)",
        )
        p.add_argument(
            "--dry-run", action="store_true", help="say what would change; write nothing"
        )
        p.add_argument(
            "--no-cli",
            dest="use_cli",
            action="store_false",
            help="edit the client's file even when its own CLI (claude, codex, gemini, code) "
            "is installed",
        )
    p.add_argument(
        "--url",
        help="the server's URL (default http://SANDBOX_HOST:SANDBOX_PORT/mcp, as configured here)",
    )
    p.add_argument(
        "--token-env",
        metavar="VAR",
        help=f"the environment variable the client reads the token from (default {TOKEN_VAR} "
        "when the server has a token)",
    )
    p.add_argument("--scope", choices=SCOPES, default="user", help="user (default) or project")
    return p.parse_args(argv)


def _base_url(args: argparse.Namespace, settings: Settings) -> str:
    if args.url:
        url = args.url.rstrip("/")
        if not re.match(r"https?://[^/]+", url):
            raise UsageError(f"--url {args.url!r} is not an http(s) URL")
        return url.removesuffix("/mcp")
    return local_url(settings.host, settings.port)


def _check_server(name: str, settings: Settings, remote: bool) -> None:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,47}", name):
        raise UsageError(f"{name!r} is not a hosted server's name")
    if remote:
        return  # another server's catalog: its own `servers list` says
    from sandbox_runtime.servers.catalog import CatalogError, load_catalog

    try:
        names = sorted(load_catalog(settings.servers_path()).entries)
    except CatalogError:
        return
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; add it: {cli_name()} servers add"
        raise UsageError(f"no hosted server named {name!r} in {settings.servers_path()}{hint}")


def _target(args: argparse.Namespace, settings: Settings) -> Target:
    base = _base_url(args, settings)
    url = f"{base}/servers/{args.server}/mcp" if args.server else f"{base}/mcp"
    if args.server:
        _check_server(args.server, settings, remote=bool(args.url))
    name = args.name or (f"{DEFAULT_NAME}-{args.server}" if args.server else DEFAULT_NAME)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise UsageError(f"--name {name!r}: letters, digits, '-', '_' and '.' only")
    var = args.token_env
    if var is None and (settings.tokens() or os.environ.get(TOKEN_VAR)):
        var = TOKEN_VAR
    if var is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
        raise UsageError(f"--token-env {var!r} is not an environment variable's name")
    token = os.environ.get(var) if var else None
    if var == TOKEN_VAR and not token and settings.auth_token is not None:
        token = settings.auth_token.get_secret_value()
    return Target(url, name, var, token)


def _chosen(args: argparse.Namespace) -> list[Client]:
    chosen: list[Client] = []
    for word in args.clients:
        client = lookup(word)
        if client is None:
            close = difflib.get_close_matches(word.lower(), [*CLIENTS, *ALIASES], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"no client named {word!r}{hint}; the clients: {', '.join(CLIENTS)}")
        if client not in chosen:
            chosen.append(client)
    if args.all_detected:
        chosen += [c for c in CLIENTS.values() if c.installed() and c not in chosen]
        if not chosen:
            raise UsageError(
                f"no MCP client is installed here: name one, e.g. {cli_name()} connect "
                f"claude-code (the clients: {', '.join(CLIENTS)})"
            )
    if not chosen:
        raise UsageError("name a client (or --all-detected)")
    return chosen


def _wire(command: str, args: argparse.Namespace, settings: Settings) -> int:
    clients = _chosen(args)
    target = _target(args, settings)
    failed = 0
    by_reference: list[str] = []
    for client in clients:
        try:
            if command == "connect":
                out = wiring.connect(
                    client, args.scope, target, dry_run=args.dry_run, use_cli=args.use_cli
                )
            else:
                out = wiring.disconnect(
                    client, args.scope, target.name, dry_run=args.dry_run, use_cli=args.use_cli
                )
        except wiring.WiringError as exc:
            print(f"{client.key}: {exc}", file=sys.stderr)
            failed += 1
            continue
        _report(command, client, target, out, args.dry_run)
        if command == "connect" and target.token_env:
            change = client.build(target)
            if change.secret:
                print(
                    f"warning: {client.key}: the token is written in {_shown(out.path)} (mode "
                    f"0600): {client.title} cannot read it from a variable",
                    file=sys.stderr,
                )
            elif not change.inputs:
                by_reference.append(client.title)
    if by_reference and target.token_env:
        have = "is set" if os.environ.get(target.token_env) else "is NOT set in this shell"
        print(
            f"{', '.join(by_reference)} {'reads' if len(by_reference) == 1 else 'read'} the "
            f"token from ${target.token_env} ({have}): "
            f"export {target.token_env}=<token> where they start"
        )
    return 1 if failed else 0


def _report(
    command: str, client: Client, target: Target, out: wiring.Outcome, dry_run: bool
) -> None:
    where = _shown(out.path)
    if not out.changed:
        state = "already wired" if command == "connect" else "not wired"
        print(f"{client.key}: {target.name} {state} in {where} (no change)")
        return
    verb = "would " if dry_run else ""
    if out.how != "file":
        print(f"{client.key}: {verb}run: {out.how}")
        return
    if dry_run:
        print(f"{client.key}: would change {where}:")
        diff = out.diff
        if target.token:  # (a diff is pasted into tickets and kept in logs)
            diff = diff.replace(target.token, f"<${target.token_env}>")
        sys.stdout.write(diff)
        return
    done = (
        f"wired {target.name} -> {target.url}"
        if command == "connect"
        else (f"removed {target.name}")
    )
    backup = f" (the previous file: {_shown(out.backup)})" if out.backup else ""
    print(f"{client.key}: {done} in {where}{backup}")


def _shown(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def _clients(args: argparse.Namespace, settings: Settings) -> int:
    base = _base_url(args, settings)
    rows = [("client", "installed", "config", "wired to this server")]
    for client in CLIENTS.values():
        path = client.file(args.scope)
        if path is None:
            rows.append((client.key, _yes(client.installed()), f"(no {args.scope} scope)", ""))
            continue
        try:
            entries = wiring.read_entries(client, path)
        except wiring.WiringError as exc:
            rows.append((client.key, _yes(client.installed()), _shown(path), str(exc)))
            continue
        wired = []
        for name, entry in entries.items():
            url = client.url_of(entry) if isinstance(entry, dict) else None
            if url and (url.startswith(base + "/") or name.startswith(DEFAULT_NAME)):
                wired.append(f"{name} -> {url}")
        rows.append((client.key, _yes(client.installed()), _shown(path), ", ".join(wired) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])
    return 0


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _token(argv: list[str]) -> int:
    p = _Parser(
        prog=f"{cli_name()} token",
        description="Make a bearer token and print the settings line that makes the server "
        "accept it.",
    )
    p.add_argument("action", choices=["new"])
    p.add_argument(
        "--principal",
        help="the token's principal (default: `default`, SANDBOX_AUTH_TOKEN); each principal "
        "sees only its own sessions and executions",
    )
    p.add_argument(
        "--e2b",
        action="store_true",
        help="make an E2B API key (`e2b_` and hex, the shape E2B's SDKs check) for "
        "E2B_API_KEY; the server's E2B API is on with SANDBOX_E2B=true (docs/e2b.md)",
    )
    args = p.parse_args(argv)
    token = "e2b_" + secrets.token_hex(20) if args.e2b else secrets.token_urlsafe(32)
    principal = args.principal or "default"
    if not PRINCIPAL.fullmatch(principal):
        raise UsageError(f"--principal {principal!r}: letters, digits, '.', '_', '@', '-' only")
    if principal == "default":
        line = f"{TOKEN_VAR}={token}"
        note = "add it to .env (or the server's environment) and restart the server"
    else:
        line = f"SANDBOX_AUTH_TOKENS={principal}:{token}"
        note = (
            "add it to .env (or the server's environment; when SANDBOX_AUTH_TOKENS is set "
            f"already, append ,{principal}:{token} to it) and restart the server"
        )
    private = _private_stdout()
    print(line)
    if private:
        print(f"# {private}", file=sys.stderr)
    if args.e2b:
        print(
            f"# {note} with SANDBOX_E2B=true; E2B SDK code: export E2B_API_KEY={token} "
            "E2B_API_URL=http://HOST:PORT/e2b E2B_SANDBOX_URL=http://HOST:PORT/e2b",
            file=sys.stderr,
        )
        return 0
    print(
        f"# {note}; clients: export {TOKEN_VAR}={token} then {cli_name()} connect "
        f"claude-code (or another: {cli_name()} clients lists them)",
        file=sys.stderr,
    )
    return 0


def _private_stdout() -> str:
    """`token new >> .env`: the shell made (or opened) .env with the umask's mode, readable by
    others; it is made 0600 before the token is written to it. Says so (empty: nothing to do)."""
    try:
        info = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return ""  # (no real stdout: a test's capture)
    if not stat.S_ISREG(info.st_mode) or not info.st_mode & 0o077:
        return ""
    try:
        os.fchmod(sys.stdout.fileno(), stat.S_IMODE(info.st_mode) & 0o700 | 0o600)
    except OSError as exc:
        raise UsageError(
            f"the file the token would go to is readable by others and cannot be made 0600 "
            f"({exc.strerror}): chmod 600 it first"
        ) from None
    return "the file the token is written to is now mode 0600 (readable by its owner only)"
