"""The MCP clients `connect` knows: where each keeps its servers, the entry it reads for a
remote Streamable HTTP server, how it refers to a token kept in an environment variable, and
its own `mcp add` command when it has one.

Facts as of late 2026 (the clients' docs, and what `claude|codex|gemini mcp add` write):
Claude Code expands `${VAR}` in its entries; Cursor and Windsurf `${env:VAR}`; Gemini CLI
`${VAR}`; Codex names the variable (`bearer_token_env_var`); VS Code asks once for an
`${input:ID}` and keeps it in its secret storage. Zed and Cline take the token only as text,
and Claude Desktop takes only local (stdio) servers: it runs `mcp-remote`, given the token in
the entry's `env`.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SCOPES = ("user", "project")
VSCODE_INPUT = "sandbox-runtime-token"


@dataclass(frozen=True)
class Target:
    """What to wire: the endpoint, the entry's name and where its token comes from."""

    url: str
    name: str
    token_env: str | None  # the variable holding the token (None: the server takes none)
    token: str | None  # its value, for the clients that must be given it as text


@dataclass(frozen=True)
class Change:
    """One client's entry as `connect` writes it."""

    entry: dict[str, Any]
    secret: bool  # the token itself is in the entry (the file is then written 0600)
    inputs: tuple[dict[str, Any], ...] = ()  # VS Code: prompts the entry refers to


@dataclass(frozen=True)
class Client:
    key: str
    title: str
    fmt: str  # "json" (with comments) or "toml"
    container: tuple[str, ...]  # the object (table) of servers in the file
    files: Callable[[str], Path | None]  # scope -> its config file (None: no such scope)
    build: Callable[[Target], Change]
    url_of: Callable[[dict[str, Any]], str | None]
    binaries: tuple[str, ...] = ()  # on PATH: the client is installed
    marks: tuple[str, ...] = ()  # paths under HOME whose presence says it is installed
    cli: str | None = None  # its own `mcp add` (run when installed, unless --no-cli)

    def file(self, scope: str) -> Path | None:
        return self.files(scope)

    def installed(self) -> bool:
        """Its binary is on PATH, or its own files are there."""
        if any(shutil.which(b) for b in self.binaries):
            return True
        if any((_home() / m).exists() for m in self.marks):
            return True
        path = self.file("user")
        return path is not None and path.parent != _home() and path.parent.is_dir()


def _home() -> Path:
    return Path.home()


def _app_dir(app: str) -> Path:
    """The per-user application directory (`~/.config/APP` on Linux)."""
    if sys.platform == "darwin":
        return _home() / "Library" / "Application Support" / app
    if sys.platform == "win32":
        return Path(os.environ.get("APPDATA") or _home() / "AppData" / "Roaming") / app
    return Path(os.environ.get("XDG_CONFIG_HOME") or _home() / ".config") / app


def _scoped(user: Callable[[], Path] | None, project: str | None) -> Callable[[str], Path | None]:
    def files(scope: str) -> Path | None:
        if scope == "user":
            return user() if user else None
        return Path.cwd() / project if project else None

    return files


def _bearer(target: Target, reference: str) -> dict[str, Any]:
    if target.token_env is None:
        return {}
    return {"headers": {"Authorization": f"Bearer {reference}"}}


def _plain_token(target: Target) -> str:
    if target.token is None:
        raise ValueError(
            f"this client takes the token only as text: set {target.token_env} to it "
            "in this shell and run connect again"
        )
    return target.token


def _url(entry: dict[str, Any]) -> str | None:
    value = entry.get("url") or entry.get("serverUrl") or entry.get("httpUrl")
    return value if isinstance(value, str) else None


def _claude_code(t: Target) -> Change:
    return Change({"type": "http", "url": t.url, **_bearer(t, f"${{{t.token_env}}}")}, False)


def _cursor(t: Target) -> Change:
    return Change({"url": t.url, **_bearer(t, f"${{env:{t.token_env}}}")}, False)


def _windsurf(t: Target) -> Change:
    return Change({"serverUrl": t.url, **_bearer(t, f"${{env:{t.token_env}}}")}, False)


def _gemini(t: Target) -> Change:
    # what `gemini mcp add --transport http` writes (`httpUrl` is the older spelling)
    return Change({"url": t.url, "type": "http", **_bearer(t, f"${{{t.token_env}}}")}, False)


def _codex(t: Target) -> Change:
    entry: dict[str, Any] = {"url": t.url}
    if t.token_env:
        entry["bearer_token_env_var"] = t.token_env
    return Change(entry, False)


def _vscode(t: Target) -> Change:
    if t.token_env is None:
        return Change({"type": "http", "url": t.url}, False)
    prompt = {
        "type": "promptString",
        "id": VSCODE_INPUT,
        "description": "sandbox_runtime's bearer token (the server's SANDBOX_AUTH_TOKEN)",
        "password": True,
    }
    entry = {"type": "http", "url": t.url, **_bearer(t, f"${{input:{VSCODE_INPUT}}}")}
    return Change(entry, False, (prompt,))


def _zed(t: Target) -> Change:
    if t.token_env is None:
        return Change({"url": t.url}, False)
    return Change({"url": t.url, "headers": {"Authorization": f"Bearer {_plain_token(t)}"}}, True)


def _cline(t: Target) -> Change:
    entry: dict[str, Any] = {"type": "streamableHttp", "url": t.url, "disabled": False}
    if t.token_env is None:
        return Change(entry, False)
    entry["headers"] = {"Authorization": f"Bearer {_plain_token(t)}"}
    return Change(entry, True)


def _claude_desktop(t: Target) -> Change:
    args = ["-y", "mcp-remote@0.15.1", t.url]
    host = urlsplit(t.url).hostname or ""
    if t.url.startswith("http://") and host not in ("localhost", "127.0.0.1", "::1"):
        args.append("--allow-http")  # mcp-remote refuses plain http elsewhere without it
    if t.token_env is None:
        return Change({"command": "npx", "args": args}, False)
    # mcp-remote expands ${AUTH_HEADER} from the env Claude Desktop gives it (no spaces in
    # args: Windows splits them)
    args += ["--header", "Authorization:${AUTH_HEADER}"]
    env = {"AUTH_HEADER": f"Bearer {_plain_token(t)}"}
    return Change({"command": "npx", "args": args, "env": env}, True)


def _desktop_url(entry: dict[str, Any]) -> str | None:
    args = entry.get("args")
    if isinstance(args, list):
        return next((a for a in args if isinstance(a, str) and "://" in a), None)
    return None


def _vscode_user() -> Path:
    return _app_dir("Code") / "User" / "mcp.json"


def _codex_user() -> Path:
    return Path(os.environ.get("CODEX_HOME") or _home() / ".codex") / "config.toml"


def _cline_user() -> Path:
    storage = _app_dir("Code") / "User" / "globalStorage" / "saoudrizwan.claude-dev"
    return storage / "settings" / "cline_mcp_settings.json"


def _zed_user() -> Path:
    if sys.platform == "win32":
        return _app_dir("Zed") / "settings.json"
    return Path(os.environ.get("XDG_CONFIG_HOME") or _home() / ".config") / "zed" / "settings.json"


CLIENTS: dict[str, Client] = {
    c.key: c
    for c in (
        Client(
            "claude-code",
            "Claude Code",
            "json",
            ("mcpServers",),
            _scoped(lambda: _home() / ".claude.json", ".mcp.json"),
            _claude_code,
            _url,
            binaries=("claude",),
            marks=(".claude.json",),
            cli="claude",
        ),
        Client(
            "claude-desktop",
            "Claude Desktop",
            "json",
            ("mcpServers",),
            _scoped(lambda: _app_dir("Claude") / "claude_desktop_config.json", None),
            _claude_desktop,
            _desktop_url,
        ),
        Client(
            "cursor",
            "Cursor",
            "json",
            ("mcpServers",),
            _scoped(lambda: _home() / ".cursor" / "mcp.json", ".cursor/mcp.json"),
            _cursor,
            _url,
            binaries=("cursor",),
            marks=(".cursor",),
        ),
        Client(
            "vscode",
            "VS Code",
            "json",
            ("servers",),
            _scoped(_vscode_user, ".vscode/mcp.json"),
            _vscode,
            _url,
            binaries=("code",),
            cli="code",
        ),
        Client(
            "windsurf",
            "Windsurf",
            "json",
            ("mcpServers",),
            _scoped(lambda: _home() / ".codeium" / "windsurf" / "mcp_config.json", None),
            _windsurf,
            _url,
            binaries=("windsurf",),
            marks=(".codeium/windsurf",),
        ),
        Client(
            "codex",
            "Codex CLI",
            "toml",
            ("mcp_servers",),
            _scoped(_codex_user, ".codex/config.toml"),
            _codex,
            _url,
            binaries=("codex",),
            marks=(".codex",),
            cli="codex",
        ),
        Client(
            "gemini",
            "Gemini CLI",
            "json",
            ("mcpServers",),
            _scoped(lambda: _home() / ".gemini" / "settings.json", ".gemini/settings.json"),
            _gemini,
            _url,
            binaries=("gemini",),
            marks=(".gemini",),
            cli="gemini",
        ),
        Client(
            "zed",
            "Zed",
            "json",
            ("context_servers",),
            _scoped(_zed_user, ".zed/settings.json"),
            _zed,
            _url,
            binaries=("zed", "zeditor"),
        ),
        Client(
            "cline",
            "Cline",
            "json",
            ("mcpServers",),
            _scoped(_cline_user, None),
            _cline,
            _url,
        ),
    )
}

ALIASES = {
    "claude": "claude-code",
    "desktop": "claude-desktop",
    "code": "vscode",
    "vs-code": "vscode",
    "codex-cli": "codex",
    "gemini-cli": "gemini",
}


def lookup(name: str) -> Client | None:
    key = name.strip().lower()
    return CLIENTS.get(ALIASES.get(key, key))
