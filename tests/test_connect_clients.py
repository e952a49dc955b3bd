"""`connect` end to end: what it writes is read by the clients' own code (Claude Code's,
Gemini CLI's and Codex's `mcp list`, pinned in tests/clients/node; the first two connect to the
server to say "Connected"), and the entry of every client is used by the official MCP SDK to
call `execute_code` on a real server (Claude Desktop's through the `npx mcp-remote` command
it names, run as written).

The CLIs come from scripts/_setup.sh's ensure_clients; without them these tests skip, except
under CI=true, where they fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_harness import ServerProcess, Servers, open_client
from test_frameworks import missing

from sandbox_runtime.connect import jsonc

pytestmark = pytest.mark.e2e

TOKEN = "connect-e2e-token-0123456789abcdef"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve("connect", SANDBOX_AUTH_TOKEN=TOKEN)


def node_bin() -> Path:
    modules = Path(os.environ.get("SRT_CLIENTS_NODE") or ROOT / ".clients/node") / "node_modules"
    for cli in ("claude", "codex", "gemini", "mcp-remote"):
        if not (modules / ".bin" / cli).exists():
            missing(f"no {cli} in {modules}/.bin")
    return modules / ".bin"


def env_for(home: Path, *, with_clis: bool) -> dict[str, str]:
    """The environment a user's shell has: HOME, the token in SANDBOX_AUTH_TOKEN, and the
    clients' CLIs on PATH (or not)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SANDBOX_", "SRT_CLI"))}
    env.update(HOME=str(home), SANDBOX_AUTH_TOKEN=TOKEN, NO_COLOR="1")
    path = env.get("PATH", "/usr/bin:/bin")
    env["PATH"] = f"{node_bin()}:{path}" if with_clis else path
    return env


def srt(env: dict[str, str], cwd: Path, *argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "sandbox_runtime.cli", *argv], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def client_cli(env: dict[str, str], cwd: Path, *argv: str) -> str:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False, stdin=subprocess.DEVNULL)  # fmt: skip
    return done.stdout + done.stderr


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "user-home"
    (path / "project").mkdir(parents=True)
    return path


@pytest.mark.parametrize("via", ["cli", "file"])
def test_claude_code_lists_the_entry_connected(server: ServerProcess, home: Path, via: str) -> None:
    env = env_for(home, with_clis=True)
    extra = [] if via == "cli" else ["--no-cli"]
    out = srt(env, home, "connect", "claude-code", "--url", server.url, *extra)
    assert ("run: claude mcp add" in out) == (via == "cli"), out
    listed = client_cli(env, home / "project", "claude", "mcp", "list")
    assert re.search(r"sandbox-runtime: \S+/mcp \(HTTP\) - [✓✔] Connected", listed), listed
    assert "no change" in srt(env, home, "connect", "claude-code", "--url", server.url, *extra)
    wrong = {**env, "SANDBOX_AUTH_TOKEN": "wrong-token-0123456789"}
    listed = client_cli(wrong, home / "project", "claude", "mcp", "list")
    assert "Connected" not in listed.replace("Connected to", ""), (
        listed
    )  # the token does come from the variable
    srt(env, home, "disconnect", "claude-code", *extra)
    assert "sandbox-runtime" not in client_cli(env, home / "project", "claude", "mcp", "list")


@pytest.mark.parametrize("via", ["cli", "file"])
def test_gemini_cli_lists_the_entry_connected(server: ServerProcess, home: Path, via: str) -> None:
    env = env_for(home, with_clis=True)
    settings = home / ".gemini" / "settings.json"
    settings.parent.mkdir()
    settings.write_text('// mine\n{\n  "ui": {"theme": "Default"}\n}\n')
    trusted = {str(home / "project"): "TRUST_FOLDER"}
    (home / ".gemini" / "trustedFolders.json").write_text(json.dumps(trusted))
    extra = [] if via == "cli" else ["--no-cli"]
    out = srt(env, home, "connect", "gemini", "--url", server.url, *extra)
    assert ("run: gemini mcp add" in out) == (via == "cli"), out
    listed = client_cli(env, home / "project", "gemini", "mcp", "list")
    assert re.search(r"✓ sandbox-runtime: \S+/mcp \(http\) - Connected", listed), listed
    if via == "file":
        assert settings.read_text().startswith("// mine\n")
    srt(env, home, "disconnect", "gemini", *extra)
    assert "sandbox-runtime" not in client_cli(env, home / "project", "gemini", "mcp", "list")


@pytest.mark.parametrize("via", ["cli", "file"])
def test_codex_reads_the_entry(server: ServerProcess, home: Path, via: str) -> None:
    env = env_for(home, with_clis=True)
    config = home / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text('# mine\nmodel = "o3"\n')
    extra = [] if via == "cli" else ["--no-cli"]
    out = srt(env, home, "connect", "codex", "--url", server.url, *extra)
    assert ("run: codex mcp add" in out) == (via == "cli"), out
    listed = _json_part(client_cli(env, home, "codex", "mcp", "list", "--json"))
    entry = next(e for e in listed if e["name"] == "sandbox-runtime")
    assert entry["enabled"] and entry["transport"]["url"] == server.url, entry
    assert entry["transport"]["bearer_token_env_var"] == "SANDBOX_AUTH_TOKEN", entry
    assert config.read_text().startswith('# mine\nmodel = "o3"\n')
    srt(env, home, "disconnect", "codex", *extra)
    assert "sandbox-runtime" not in client_cli(env, home, "codex", "mcp", "list", "--json")


def _json_part(text: str) -> Any:
    """The JSON of `codex mcp list --json` (it may print a warning line first)."""
    return json.JSONDecoder().raw_decode(text[text.index("[") :])[0]


# --- every client's entry, used by the official SDK --------------------------------------

FILES = {
    "claude-code": (".claude.json", "mcpServers"),
    "cursor": (".cursor/mcp.json", "mcpServers"),
    "vscode": (".config/Code/User/mcp.json", "servers"),
    "windsurf": (".codeium/windsurf/mcp_config.json", "mcpServers"),
    "codex": (".codex/config.toml", "mcp_servers"),
    "gemini": (".gemini/settings.json", "mcpServers"),
    "zed": (".config/zed/settings.json", "context_servers"),
    "cline": (
        ".config/Code/User/globalStorage/saoudrizwan.claude-dev/settings/cline_mcp_settings.json",
        "mcpServers",
    ),
}


def resolve(value: str, env: dict[str, str], typed: str) -> str:
    """What the client sends for a header: its references replaced as it replaces them
    (`${VAR}`, `${env:VAR}`; `${input:ID}` is what the user types at VS Code's prompt)."""
    value = re.sub(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m[1]], value)
    value = re.sub(r"\$\{input:[^}]+\}", typed, value)
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m[1]], value)


@pytest.mark.parametrize("client", list(FILES))
async def test_each_clients_entry_calls_execute_code(
    client: str, server: ServerProcess, home: Path
) -> None:
    env = env_for(home, with_clis=False)
    srt(env, home, "connect", client, "--url", server.url, "--no-cli")
    rel, key = FILES[client]
    text = (home / rel).read_text()
    data = tomllib.loads(text) if rel.endswith(".toml") else jsonc.loads(text)
    entry = data[key]["sandbox-runtime"]
    url = entry.get("url") or entry.get("serverUrl")
    headers = {k: resolve(v, env, TOKEN) for k, v in (entry.get("headers") or {}).items()}
    if "bearer_token_env_var" in entry:
        headers["Authorization"] = f"Bearer {env[entry['bearer_token_env_var']]}"
    async with open_client(url, None, "auto", headers=headers) as conn:
        result = await conn.ok("execute_code", command=f"echo wired-{client}")
    assert f"wired-{client}\n" in [e.get("data") for e in result["output"]], result


async def test_claude_desktops_entry_runs_mcp_remote_as_written(
    server: ServerProcess, home: Path
) -> None:
    """The entry's command (`npx -y mcp-remote@0.15.1 URL --header …`, env AUTH_HEADER) run as
    Claude Desktop runs it; npx finds the pinned mcp-remote in the test clients' node_modules."""
    env = env_for(home, with_clis=False)
    srt(env, home, "connect", "claude-desktop", "--url", server.url)
    config = home / ".config/Claude/claude_desktop_config.json"
    entry = json.loads(config.read_text())["mcpServers"]["sandbox-runtime"]
    assert oct(config.stat().st_mode & 0o777) == "0o600"
    if shutil.which("npx") is None:
        missing("npx is not installed")
    launch = StdioServerParameters(
        command=entry["command"],
        args=entry["args"],
        env={"PATH": env["PATH"], "HOME": str(home), **entry["env"]},
        cwd=node_bin().parent.parent,  # (where npx looks first)
    )
    async with Client(launch, mode="legacy") as mcp:
        result = await mcp.call_tool("execute_code", {"command": "echo desktop"})
    assert not result.is_error, result
    data = result.structured_content or {}
    assert "desktop\n" in [e.get("data") for e in data["output"]], data
    assert result.content[0].text.startswith("desktop\n[exit 0, ")  # type: ignore[union-attr]
