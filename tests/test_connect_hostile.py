"""`connect`/`disconnect` given files a person (or an attacker) could leave: each is either
edited as it should be or refused in one line naming the file, with nothing written and
nothing made (no backup, no directory); `--dry-run` makes nothing either. Also `token new`
appended to a file, and the hint the server prints naming the port it listens on."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_connect import home, run  # noqa: F401 (the fixture)

from sandbox_runtime.connect import jsonc, toml_tables

pytestmark = pytest.mark.unit


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "content",
    [
        b'{"mcpServers": {"a": "\\x"}}',  # an escape JSON has not
        b'{"mcpServers": {"a": "\t"}}',  # a raw tab in a string
        b'{"mcpServers": {"\\u12": 1}}',  # a broken \u in a key
        b'{"a": ' + b"[" * 20000 + b"]" * 20000 + b"}",  # nested past Python's recursion
        b"\xff\xfe{\x00}\x00",  # UTF-16
        b'{"mcpServers": {}, "limit": NaN}',  # Python's json writes it; JSON has no NaN
        None,  # a directory where the file should be
    ],
)
def test_an_odd_file_is_refused_in_one_line_and_left_alone(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    content: bytes | None,
) -> None:
    path = home / ".cursor" / "mcp.json"
    path.parent.mkdir()
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    before = files_under(home)
    for command in ("connect", "disconnect"):
        code, out, err = run(capsys, command, "cursor")
        assert code == 1, (out, err)
        assert err.startswith(f"cursor: {path}: ") and err.count("\n") == 1, err
        assert "fix it by hand" in err or "cannot read it" in err or "UTF-8" in err, err
        assert files_under(home) == before
        if content is not None:
            assert path.read_bytes() == content
    code, out, err = run(capsys, "clients")
    assert code == 0 and "Traceback" not in err, err
    assert str(path) in out or "~/.cursor/mcp.json" in out, out


@pytest.mark.parametrize("client", ["cursor", "claude-desktop", "vscode", "codex", "zed"])
def test_dry_run_makes_no_directory(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    client: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(A directory it made would also make `clients` and --all-detected take the client for
    installed.)"""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("SANDBOX_AUTH_TOKEN", "t0123456789")
    code, out, err = run(capsys, "connect", client, "--dry-run")
    assert code == 0 and "would change" in out, err
    assert files_under(home) == [], files_under(home)


@pytest.mark.parametrize(
    "text",
    [
        "{\n  // my servers: none yet\n}\n",
        '{\n  "mcpServers": {\n    // "old": {"url": "http://example.com/mcp"}\n  }\n}\n',
        '{"mcpServers": { /* "off": {"url": "x"} */ }}\n',
    ],
)
def test_a_comment_in_an_empty_object_is_kept(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    text: str,
) -> None:
    path = home / ".cursor" / "mcp.json"
    path.parent.mkdir()
    path.write_text(text)
    code, _, err = run(capsys, "connect", "cursor")
    assert code == 0, err
    after = path.read_text()
    assert "sandbox-runtime" in jsonc.loads(after)["mcpServers"]
    comment = text[text.index("/") : text.index("\n", text.index("/"))].split("*/")[0]
    assert comment in after, after
    code, _, err = run(capsys, "disconnect", "cursor")
    assert code == 0, err
    assert comment in path.read_text() and "sandbox-runtime" not in path.read_text()
    if text.startswith('{\n  "'):
        assert path.read_text() == text


@pytest.mark.parametrize(
    "text",
    [
        '{"mcpServers": {"sandbox-runtime": {"url": "http://a/mcp"}, '
        '"sandbox-runtime": {"url": "http://127.0.0.1:8080/mcp"}}}\n',
        '{"mcpServers": {"x": {"url": "u"}}, "mcpServers": {"y": {"url": "v"}}}\n',
    ],
)
def test_a_repeated_key_on_the_way_is_refused(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    text: str,
) -> None:
    """Which of two same-named members a client reads is its parser's choice: removing one
    could leave the one it reads (`disconnect` saying done while it is still wired)."""
    path = home / ".cursor" / "mcp.json"
    path.parent.mkdir()
    path.write_text(text)
    for command in ("connect", "disconnect"):
        code, out, err = run(capsys, command, "cursor", "--url", "http://b:1/mcp")
        if command == "disconnect" and "sandbox-runtime" not in text:
            assert code == 0 and "not wired" in out, (out, err)
            continue
        assert code == 1 and "more than once" in err and "fix it by hand" in err, (out, err)
        assert path.read_text() == text and files_under(home) == [".cursor", ".cursor/mcp.json"]


def test_toml_a_header_inside_a_multiline_string_is_not_a_table() -> None:
    text = (
        'instructions = """\nConfigure it so:\n[mcp_servers.sandbox-runtime]\nurl = "..."\n'
        '[other]\n"""\nmodel = "o3"\n'
    )
    values = {"url": "http://127.0.0.1:8080/mcp"}
    try:
        new = toml_tables.set_table(text, ["mcp_servers", "sandbox-runtime"], values)
    except toml_tables.TomlError:
        return  # refused: nothing written
    data = toml_tables.loads(new)
    assert data["instructions"] == toml_tables.loads(text)["instructions"], new
    assert data["mcp_servers"]["sandbox-runtime"] == values, new


def test_toml_an_inline_entry_is_not_said_to_be_gone(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    path = home / ".codex" / "config.toml"
    path.parent.mkdir()
    text = '[mcp_servers]\nsandbox-runtime = { url = "http://127.0.0.1:8080/mcp" }\n'
    path.write_text(text)
    code, out, err = run(capsys, "disconnect", "codex")
    assert code == 1 and "by hand" in err and "not wired" not in out, (out, err)
    assert path.read_text() == text


def test_token_new_appended_to_a_file_leaves_it_private(tmp_path: Path) -> None:
    """`token new >> .env`: the shell makes .env with the umask's mode (0644) before the
    command runs; the token is in it only once it is 0600."""
    env_file = tmp_path / ".env"
    env_file.write_text("SANDBOX_PORT=8080\n")
    env_file.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    done = subprocess.run(
        f"umask 022; {sys.executable} -m sandbox_runtime.cli token new >> .env",
        shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    lines = env_file.read_text().splitlines()
    assert lines[0] == "SANDBOX_PORT=8080" and lines[1].startswith("SANDBOX_AUTH_TOKEN=")
    assert "0600" in done.stderr, done.stderr


def test_the_servers_connect_hint_names_its_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """`./scripts/serve --port 9000`: the CLI run after it reads only the environment (8080),
    so the hint the server prints says where it listens."""
    from sandbox_runtime.config import Settings
    from sandbox_runtime.config.command import connect_hint

    for key in list(os.environ):
        if key.startswith("SANDBOX_"):
            monkeypatch.delenv(key)
    assert "--url" not in connect_hint(Settings())
    hint = connect_hint(Settings(port=18480))
    assert "connect claude-code --url http://127.0.0.1:18480/mcp" in hint, hint
    monkeypatch.setenv("SANDBOX_PORT", "18480")
    assert "--url" not in connect_hint(Settings())
    assert "--url" not in connect_hint(Settings(host="0.0.0.0"))  # (reached at 127.0.0.1)
    hint = connect_hint(Settings(auth_token="a-token-given-as-a-flag"))
    assert hint.endswith("(with SANDBOX_AUTH_TOKEN set to the token given by --token)"), hint
    monkeypatch.setenv("SANDBOX_AUTH_TOKEN", "a-token-given-as-a-flag")
    assert "(with" not in connect_hint(Settings())


@pytest.mark.parametrize(
    ("client", "rel", "text"),
    [
        ("zed", ".config/zed/settings.json", '// zed\n{\n  "theme": "One Dark"\n}\n'),
        ("claude-code", ".claude.json", '{"numStartups": 3, "projects": {}}'),
        ("cursor", ".cursor/mcp.json", "{}\n"),
        ("codex", ".codex/config.toml", 'model = "o3"\n'),
    ],
)
def test_disconnect_gives_back_a_file_that_had_no_servers(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    client: str,
    rel: str,
    text: str,
) -> None:
    """(The README: `disconnect` "gives the client's file back as it was"; the servers' object
    `connect` had to make goes with its last entry.)"""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    path = home / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    assert run(capsys, "connect", client)[0] == 0
    assert "sandbox-runtime" in path.read_text()
    code, _, err = run(capsys, "disconnect", client)
    assert code == 0, err
    assert path.read_text() == text


@pytest.mark.parametrize("client", ["zed", "cline", "claude-desktop"])
def test_dry_run_shows_no_token(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    client: str,
) -> None:
    """A client given the token as text: --dry-run's diff (pasted into a ticket, kept in a CI
    log) names it without printing it."""
    token = "dry-run-token-0123456789abcdef"
    monkeypatch.setenv("SANDBOX_AUTH_TOKEN", token)
    code, out, err = run(capsys, "connect", client, "--dry-run")
    assert code == 0 and "would change" in out, err
    assert token not in out + err, out
    assert "Bearer <$SANDBOX_AUTH_TOKEN>" in out, out


def test_a_project_file_linked_out_of_the_project_is_refused(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A repository can hold symlinks: `.mcp.json -> /dev/null` (replaced by a regular file
    when run as root), `.cursor -> /etc`, a link to a file that does not exist yet anywhere.
    Project scope edits only files inside the project (the working directory)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.json"
    victim.write_text('{"mine": 1}\n')
    project = Path.cwd()
    (project / ".mcp.json").symlink_to(victim)
    (project / ".cursor").symlink_to(outside)
    (project / ".gemini").mkdir()
    (project / ".gemini" / "settings.json").symlink_to(outside / "new-file.json")
    before = files_under(outside)
    for client in ("claude-code", "cursor", "gemini"):
        code, out, err = run(capsys, "connect", client, "--scope", "project")
        assert code == 1 and "outside the project" in err, (client, out, err)
    assert files_under(outside) == before and victim.read_text() == '{"mine": 1}\n'
    (project / "real.json").write_text("{}\n")
    (project / ".mcp.json").unlink()
    (project / ".mcp.json").symlink_to("real.json")  # inside: edited at its target
    assert run(capsys, "connect", "claude-code", "--scope", "project")[0] == 0
    assert "sandbox-runtime" in (project / "real.json").read_text()


def test_a_device_a_fifo_or_a_huge_file_is_refused(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """(Read as a config, a FIFO blocks for ever and /dev/zero never ends.)"""
    path = home / ".cursor" / "mcp.json"
    path.parent.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(65 * 1024 * 1024)  # sparse
    for target, said in [
        (Path("/dev/zero"), "not a regular file"),
        (fifo, "not a regular file"),
        (huge, "larger than 64 MiB"),
    ]:
        path.unlink(missing_ok=True)
        path.symlink_to(target)
        for command in ("connect", "disconnect", "clients"):
            code, out, err = (
                run(capsys, command, "cursor") if command != "clients" else run(capsys, command)
            )
            assert code == (0 if command == "clients" else 1), (target, command, out, err)
            assert said in out + err, (target, command, out, err)
        assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)


@pytest.mark.parametrize(
    ("client", "rel", "text"),
    [
        (
            "cursor",
            ".cursor/mcp.json",
            '{\r\n  "a": 1,\n  "mcpServers": {\r\n    "x": {}\n  }\n}\r\n',
        ),
        ("codex", ".codex/config.toml", 'model = "o3"\r\n[profiles.x]\nmodel = "o4"\r\n'),
    ],
)
def test_mixed_line_ends_are_kept(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    client: str,
    rel: str,
    text: str,
) -> None:
    """A file with both \\r\\n and \\n line ends keeps each line's own (only a file written
    with \\r\\n throughout gets \\r\\n on the lines connect adds)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    path = home / rel
    path.parent.mkdir(parents=True)
    path.write_bytes(text.encode())
    assert run(capsys, "connect", client)[0] == 0
    after = path.read_bytes().decode()
    for line in text.splitlines(keepends=True):  # (one may have gained a comma)
        assert line.replace(",", "") in after.replace(",", ""), (line, after)
    assert run(capsys, "disconnect", client)[0] == 0
    assert path.read_bytes().decode() == text


def test_a_token_as_text_is_not_written_into_a_project(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Zed takes the token only as text; its project file (.zed/settings.json) is kept in the
    repository, where the token would be committed with it."""
    monkeypatch.setenv("SANDBOX_AUTH_TOKEN", "project-token-0123456789abcdef")
    code, out, err = run(capsys, "connect", "zed", "--scope", "project")
    assert code == 1 and "--scope user" in err and "project-token" not in out + err, (out, err)
    assert files_under(Path.cwd()) == []
    code, out, err = run(capsys, "connect", "cursor", "--scope", "project")  # by reference
    assert code == 0 and "project-token" not in Path(".cursor/mcp.json").read_text(), err


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_root_editing_a_users_file_leaves_it_theirs(
    home: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`sudo srt-mcp-server connect …` with the user's HOME: the replaced file (and its backup)
    stays the user's, or their client could no longer read it."""
    path = home / ".cursor" / "mcp.json"
    path.parent.mkdir()
    path.write_text("{}\n")
    os.chown(path, 65534, 65534)
    assert run(capsys, "connect", "cursor")[0] == 0
    for made in (path, path.with_name("mcp.json.srt-backup")):
        info = made.stat()
        assert (info.st_uid, info.st_gid) == (65534, 65534), made
    assert "sandbox-runtime" in path.read_text()


def test_the_listening_line_names_a_url() -> None:
    from sandbox_runtime.config.command import listen_url

    assert listen_url("::", 8080) == "http://[::]:8080"
    assert listen_url("0.0.0.0", 8080) == "http://0.0.0.0:8080"
