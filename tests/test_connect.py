"""`connect`/`disconnect`/`clients`/`token` against a temporary HOME, file by file: each
client's entry has its documented shape, the file's comments and other entries are kept,
running it twice changes nothing, --dry-run writes nothing, disconnect gives back the file as
it was. (The clients' own code reading these files, and real calls through the entries, are in
test_connect_clients.py.)"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandbox_runtime.cli import main
from sandbox_runtime.connect import jsonc, toml_tables

TOKEN = "connect-token-0123456789abcdef"
VAR = "SANDBOX_AUTH_TOKEN"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME, and a working directory with no .env, for one test; no SANDBOX_* settings."""
    for key in list(os.environ):
        if key.startswith("SANDBOX_") or key in ("XDG_CONFIG_HOME", "CODEX_HOME", "SRT_CLI"):
            monkeypatch.delenv(key)
    home = tmp_path / "user-home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def bearer(entry: dict[str, Any]) -> str:
    return str(entry["headers"]["Authorization"])


# client -> (its user file under HOME, the file as a user left it, the servers in it, a check of
# our entry against the client's documented schema (token by reference where it has one))
Check = Callable[[dict[str, Any], str], None]


def _claude_code(e: dict[str, Any], url: str) -> None:
    assert e == {"type": "http", "url": url, "headers": {"Authorization": f"Bearer ${{{VAR}}}"}}


def _desktop(e: dict[str, Any], url: str) -> None:
    assert e["command"] == "npx" and e["args"][:3] == ["-y", "mcp-remote@0.15.1", url], e
    assert e["args"][3:] == ["--header", "Authorization:${AUTH_HEADER}"], e
    assert e["env"] == {"AUTH_HEADER": f"Bearer {TOKEN}"}, e


def _cursor(e: dict[str, Any], url: str) -> None:
    assert e == {"url": url, "headers": {"Authorization": f"Bearer ${{env:{VAR}}}"}}


def _vscode(e: dict[str, Any], url: str) -> None:
    assert e == {
        "type": "http",
        "url": url,
        "headers": {"Authorization": "Bearer ${input:sandbox-runtime-token}"},
    }


def _windsurf(e: dict[str, Any], url: str) -> None:
    assert e == {"serverUrl": url, "headers": {"Authorization": f"Bearer ${{env:{VAR}}}"}}


def _codex(e: dict[str, Any], url: str) -> None:
    assert e == {"url": url, "bearer_token_env_var": VAR}


def _gemini(e: dict[str, Any], url: str) -> None:
    assert e == {"url": url, "type": "http", "headers": {"Authorization": f"Bearer ${{{VAR}}}"}}


def _zed(e: dict[str, Any], url: str) -> None:
    assert e == {"url": url, "headers": {"Authorization": f"Bearer {TOKEN}"}}


def _cline(e: dict[str, Any], url: str) -> None:
    assert e == {
        "type": "streamableHttp",
        "url": url,
        "disabled": False,
        "headers": {"Authorization": f"Bearer {TOKEN}"},
    }


STRICT = (
    '{\n  "theme": "dark",\n  "mcpServers": {\n'
    '    "other": {"command": "uvx", "args": ["x"]}\n  }\n}\n'
)
WITH_COMMENTS = (
    '// my settings: keep this comment\n{\n  /* font */ "ui_font_size": 15,\n'
    '  "KEY": {\n    "other": {"url": "http://example.com/mcp"} // mine\n  }\n}\n'
)
CODEX = (
    '# my codex config\nmodel = "o3"  # fast\n\n[mcp_servers.other]\ncommand = "npx"\n'
    'args = ["-y", "x"]\n\n# profiles\n[profiles.fast]\nmodel = "o4-mini"\n'
)

CLIENTS: dict[str, tuple[str, str, str, Check, bool]] = {
    # key: (user file, its content before, servers' key, check, token written as text)
    "claude-code": (".claude.json", STRICT, "mcpServers", _claude_code, False),
    "claude-desktop": (
        ".config/Claude/claude_desktop_config.json",
        STRICT,
        "mcpServers",
        _desktop,
        True,
    ),
    "cursor": (".cursor/mcp.json", STRICT, "mcpServers", _cursor, False),
    "vscode": (
        ".config/Code/User/mcp.json",
        WITH_COMMENTS.replace("KEY", "servers"),
        "servers",
        _vscode,
        False,
    ),
    "windsurf": (".codeium/windsurf/mcp_config.json", STRICT, "mcpServers", _windsurf, False),
    "codex": (".codex/config.toml", CODEX, "mcp_servers", _codex, False),
    "gemini": (
        ".gemini/settings.json",
        WITH_COMMENTS.replace("KEY", "mcpServers"),
        "mcpServers",
        _gemini,
        False,
    ),
    "zed": (
        ".config/zed/settings.json",
        WITH_COMMENTS.replace("KEY", "context_servers"),
        "context_servers",
        _zed,
        True,
    ),
    "cline": (
        ".config/Code/User/globalStorage/saoudrizwan.claude-dev/settings/cline_mcp_settings.json",
        STRICT,
        "mcpServers",
        _cline,
        True,
    ),
}


def servers_in(path: Path, key: str) -> dict[str, Any]:
    text = path.read_text()
    data = tomllib.loads(text) if ".toml" in path.name else jsonc.loads(text)
    return dict(data[key])


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("client", list(CLIENTS))
def test_connect_writes_the_documented_entry_and_disconnect_gives_the_file_back(
    client: str, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rel, before, key, check, plaintext = CLIENTS[client]
    path = home / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(before)
    path.chmod(0o644)
    monkeypatch.setenv(VAR, TOKEN)
    url = "http://127.0.0.1:8080/mcp"

    code, out, err = run(capsys, "connect", client, "--no-cli", "--dry-run")
    assert code == 0, err
    assert path.read_text() == before and sorted(tree(home)) == [rel], "--dry-run wrote"
    assert "sandbox-runtime" in out and "+" in out, out

    code, out, err = run(capsys, "connect", client, "--no-cli")
    assert code == 0, err
    servers = servers_in(path, key)
    check(servers["sandbox-runtime"], url)
    assert servers["other"] == servers_in(home / (rel + ".srt-backup"), key)["other"]
    text = path.read_text()
    for line in before.splitlines():  # every line kept (one may have gained a comma)
        assert line.replace(",", "") in text.replace(",", ""), f"lost {line!r}:\n{text}"
    mode = stat.S_IMODE(path.stat().st_mode)
    if plaintext:
        assert TOKEN in text and mode == 0o600, (mode, text)
        assert "written in" in err and "0600" in err, err
    else:
        assert TOKEN not in text, text  # by reference only
        assert mode == 0o644, oct(mode)

    code, out, err = run(capsys, "connect", client, "--no-cli")  # twice: no change
    assert code == 0 and "no change" in out, out
    assert path.read_text() == text

    code, out, err = run(capsys, "disconnect", client, "--no-cli")
    assert code == 0, err
    assert path.read_text() == before, path.read_text()
    code, out, err = run(capsys, "disconnect", client, "--no-cli")
    assert code == 0 and "no change" in out and path.read_text() == before


@pytest.mark.parametrize("client", ["cursor", "codex", "vscode"])
def test_a_hosted_servers_endpoint_and_a_file_that_did_not_exist(
    client: str, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rel, _, key, _, _ = CLIENTS[client]
    code, out, err = run(capsys, "connect", client, "--no-cli", "--url", "https://srt.example/mcp",
                         "--server", "time")  # fmt: skip
    assert code == 0, err
    entry = servers_in(home / rel, key)["sandbox-runtime-time"]
    assert entry["url"] == "https://srt.example/servers/time/mcp"
    assert "headers" not in entry and "bearer_token_env_var" not in entry, entry  # no token
    code, out, _ = run(capsys, "clients")
    row = next(line for line in out.splitlines() if line.startswith(client))
    assert "sandbox-runtime-time -> https://srt.example/servers/time/mcp" in row, out


def test_claude_desktop_over_plain_http_elsewhere_allows_it(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "connect", "desktop", "--url", "http://10.1.2.3:8080")
    assert code == 0, err
    config = home / ".config/Claude/claude_desktop_config.json"
    entry = json.loads(config.read_text())["mcpServers"]["sandbox-runtime"]
    assert entry["args"] == ["-y", "mcp-remote@0.15.1", "http://10.1.2.3:8080/mcp", "--allow-http"]


def test_wrong_names_say_what_was_meant(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "connect", "cursr")
    assert code == 2 and "no client named 'cursr' (did you mean 'cursor'?)" in err, err
    catalog = home / "state" / "servers.toml"
    catalog.parent.mkdir()
    catalog.write_text('[servers.time]\npackage = "pypi:mcp-server-time"\n')
    os.environ["SANDBOX_STATE_DIR"] = str(catalog.parent)
    try:
        code, _, err = run(capsys, "connect", "cursor", "--server", "tme")
    finally:
        del os.environ["SANDBOX_STATE_DIR"]
    assert code == 2 and "no hosted server named 'tme'" in err and "'time'?" in err, err
    code, _, err = run(capsys, "connect")
    assert code == 2 and "name a client (or --all-detected)" in err, err
    code, _, err = run(capsys, "connect", "zed", "--token-env", "MISSING_VAR")
    assert code == 1 and "set MISSING_VAR to it" in err, err


def test_an_unparsable_file_is_left_alone(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = home / ".cursor" / "mcp.json"
    path.parent.mkdir()
    path.write_text('{"mcpServers": {"a": 1,,}}')
    code, _, err = run(capsys, "connect", "cursor")
    assert code == 1 and "cannot parse it (line 1 column 24" in err, err
    assert path.read_text() == '{"mcpServers": {"a": 1,,}}'


def test_a_symlinked_config_is_edited_at_its_target(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dotfiles = home / "dotfiles"
    dotfiles.mkdir()
    (dotfiles / "mcp.json").write_text(STRICT)
    (home / ".cursor").mkdir()
    (home / ".cursor" / "mcp.json").symlink_to(dotfiles / "mcp.json")
    assert run(capsys, "connect", "cursor")[0] == 0
    assert (home / ".cursor" / "mcp.json").is_symlink()
    assert "sandbox-runtime" in json.loads((dotfiles / "mcp.json").read_text())["mcpServers"]


def test_token_new_prints_a_line_the_server_accepts(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sandbox_runtime.config.parsing import tokens

    code, out, err = run(capsys, "token", "new")
    assert code == 0
    name, _, token = out.strip().partition("=")
    assert name == "SANDBOX_AUTH_TOKEN" and len(token) >= 32, out
    assert f"export SANDBOX_AUTH_TOKEN={token}" in err, err
    code, out, _ = run(capsys, "token", "new", "--principal", "alice")
    name, _, value = out.strip().partition("=")
    assert name == "SANDBOX_AUTH_TOKENS" and list(tokens("", value).values()) == ["alice"], out
    code, _, err = run(capsys, "token", "new", "--principal", "a:b")
    assert code == 2 and "--principal" in err, err


# --- the editors on their own ------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{}",
        '{"a": 1}',
        '{\n\t"a": [1, 2,],\n\t"servers": {"x": 1},\n}\n',
        '// top\n{\n  "servers": {\n    "x": 1 /* why */\n  },\n  "inputs": []\n}',
    ],
)
def test_jsonc_edits_round_trip(text: str) -> None:
    doc = jsonc.Document(text)
    doc.set(["servers", "srt"], {"url": "u", "n": [1]})
    doc.append(["inputs"], {"id": "t"})
    after = jsonc.loads(doc.text)
    assert after["servers"]["srt"] == {"url": "u", "n": [1]} and {"id": "t"} in after["inputs"]
    again = jsonc.Document(doc.text)
    again.set(["servers", "srt"], {"url": "u", "n": [1]})
    again.append(["inputs"], {"id": "t"})
    assert again.text == doc.text
    doc.remove(["servers", "srt"])
    doc.remove_item(["inputs"], {"id": "t"})
    if doc.get(["inputs"]) == [] and "inputs" not in text:
        doc.remove(["inputs"])
    assert "srt" not in jsonc.loads(doc.text).get("servers", {})
    if '"servers": {"x"' in text or '"x": 1 /*' in text:
        assert doc.text == text, doc.text


def test_jsonc_keeps_crlf_line_ends() -> None:
    text = '{\r\n  "servers": {\r\n    "x": 1 // mine\r\n  }\r\n}\r\n'
    doc = jsonc.Document(text)
    doc.set(["servers", "srt"], {"url": "u"})
    out = doc.rendered()
    assert "\n" not in out.replace("\r\n", "") and jsonc.loads(out)["servers"]["srt"] == {
        "url": "u"
    }
    doc.remove(["servers", "srt"])
    assert doc.rendered() == text


def test_jsonc_reports_where_it_is_broken() -> None:
    for bad, where in [('{"a": 1', "line 1 column 8"), ('{\n "a": tru }', "line 2 column 7"),
                       ("{/* x", "line 1 column 2"), ('["a"]', "not an object")]:  # fmt: skip
        with pytest.raises(jsonc.JsoncError, match=where):
            jsonc.Document(bad)


def test_toml_tables_keep_the_rest() -> None:
    new = toml_tables.set_table(CODEX, ["mcp_servers", "srt"], {"url": "u", "env": {"A": "1"}})
    assert tomllib.loads(new)["mcp_servers"]["srt"] == {"url": "u", "env": {"A": "1"}}
    assert new.startswith(CODEX)
    assert (
        toml_tables.set_table(new, ["mcp_servers", "srt"], {"url": "u", "env": {"A": "1"}}) == new
    )
    changed = toml_tables.set_table(new, ["mcp_servers", "srt"], {"url": "v"})
    assert tomllib.loads(changed)["mcp_servers"]["srt"] == {"url": "v"}
    assert toml_tables.remove_table(new, ["mcp_servers", "srt"]) == CODEX
    assert toml_tables.remove_table(CODEX, ["mcp_servers", "srt"]) is None
    crlf = CODEX.replace("\n", "\r\n")
    added = toml_tables.set_table(crlf, ["mcp_servers", "srt"], {"url": "u"})
    assert added.count("\n") == added.count("\r\n")
    assert toml_tables.remove_table(added, ["mcp_servers", "srt"]) == crlf
    with pytest.raises(toml_tables.TomlError, match="inline"):
        toml_tables.set_table('mcp_servers = { srt = { url = "x" } }\n', ["mcp_servers", "srt"],
                              {"url": "y"})  # fmt: skip


def test_hints_name_a_command_that_runs(tmp_path: Path) -> None:
    """Without srt-mcp-server on PATH, a hint names the path it was run by."""
    venv_bin = Path(sys.executable).parent
    entry = venv_bin / "srt-mcp-server"
    assert entry.exists(), f"{entry}: the package's entry point (pip install -e .) is missing"
    env = {k: v for k, v in os.environ.items() if k not in ("SRT_CLI",)}
    env["PATH"] = "/usr/bin:/bin"
    env["SANDBOX_STATE_DIR"] = str(tmp_path)
    done = subprocess.run([str(entry), "servers", "logs", "tme"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode != 0
    assert "no server named 'tme'" in done.stderr, done.stderr
    (tmp_path / "servers.toml").write_text('[servers.time]\npackage = "pypi:mcp-server-time"\n')
    done = subprocess.run([str(entry), "servers", "logs", "tme"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert "no server named 'tme' (did you mean 'time'?)" in done.stderr, done.stderr
    done = subprocess.run([str(entry), "servers", "add", "time", "pypi:mcp-server-time",
                           "--replace"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False)  # fmt: skip
    hint = next(line for line in done.stdout.splitlines() if "install it before use" in line)
    command = hint.split(": ", 1)[1]
    assert command.split()[0] == str(entry), hint  # not `srt-mcp-server`: not on PATH


def test_an_unusable_state_dir_says_what_to_set(tmp_path: Path) -> None:
    """(As a user who is not root, the default /var/lib/sandbox-runtime: not writable.)"""
    from mcp_harness import run_server_once

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, stderr = run_server_once(tmp_path, SANDBOX_STATE_DIR=str(blocker / "state"))
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert f"cannot use the state dir {blocker / 'state'}" in stderr, stderr
    assert "set SANDBOX_STATE_DIR (or --state-dir) to a directory this user can write" in stderr


def test_all_detected_and_project_scope(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no client's command: detected by its files
    (home / ".cursor").mkdir()
    (home / ".codeium" / "windsurf").mkdir(parents=True)
    code, out, err = run(capsys, "connect", "--all-detected", "--dry-run")
    assert code == 0, err
    assert [line.split(":")[0] for line in out.splitlines() if "would change" in line] == [
        "cursor",
        "windsurf",
    ], out
    code, out, err = run(capsys, "clients")
    installed = {line.split()[0] for line in out.splitlines()[1:] if line.split()[1] == "yes"}
    assert installed == {"cursor", "windsurf"}, out

    code, out, err = run(capsys, "connect", "cursor", "claude-code", "--scope", "project")
    assert code == 0, err
    assert "sandbox-runtime" in json.loads(Path(".cursor/mcp.json").read_text())["mcpServers"]
    assert "sandbox-runtime" in json.loads(Path(".mcp.json").read_text())["mcpServers"]
    code, _, err = run(capsys, "connect", "windsurf", "--scope", "project")
    assert code == 1 and "Windsurf has no project-scope config (use --scope user)" in err, err


def test_concurrent_connects_lose_no_entry(home: Path) -> None:
    """Eight `connect`s at once into one file: each reads, edits and replaces it under the
    directory's lock, so none writes over another's entry."""
    env = {**os.environ, "HOME": str(home)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sandbox_runtime.cli",
                "connect",
                "cursor",
                "--no-cli",
                "--url",
                "http://127.0.0.1:9/mcp",
                "--server",
                f"s{i}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(8)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    servers = servers_in(home / ".cursor" / "mcp.json", "mcpServers")
    assert sorted(servers) == [f"sandbox-runtime-s{i}" for i in range(8)], servers
    assert not [p.name for p in (home / ".cursor").iterdir() if p.name.startswith(".mcp.json.")]
