"""The hosted servers' catalog (servers/catalog.py) and the `servers` CLI, without the network:
what is accepted, what is refused and why, what the file holds, what is never shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox_runtime import cli as top_cli
from sandbox_runtime.servers import cli
from sandbox_runtime.servers.catalog import (
    Catalog,
    CatalogError,
    entry_from_source,
    load_catalog,
    parse_catalog,
    parse_entry,
    resolve_secret,
)
from sandbox_runtime.servers.catalog_file import dump_catalog, save_catalog
from sandbox_runtime.servers.desktop import import_desktop_config
from sandbox_runtime.servers.installs import INSTALL_MOUNT, RECORD, read_installed

pytestmark = pytest.mark.unit

DESKTOP_CONFIG = {
    "mcpServers": {
        "memory": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-memory"]},
        "Time Zones": {"command": "uvx", "args": ["mcp-server-time", "--local-timezone", "UTC"]},
        "notes": {
            "command": "/usr/local/bin/notes-mcp",
            "args": ["--root", "/data"],
            "env": {"NOTES_MODE": "read-only", "LOG_LEVEL": "debug"},
        },
        "linear": {
            "url": "https://mcp.linear.example/mcp",
            "headers": {"Authorization": "Bearer lin_api_not_a_real_one"},
        },
    }
}


# --- parse_entry ---------------------------------------------------------------------------


def test_a_name_must_be_short_lowercase_words() -> None:
    for name in ("Time", "-time", "ti me", "a" * 49, "", "../x"):
        with pytest.raises(CatalogError, match="name is 1-48"):
            parse_entry(name, {"package": "pypi:mcp-server-time"})
    assert parse_entry("a" * 48, {"package": "pypi:x"}).name == "a" * 48


def test_an_entry_has_exactly_one_source() -> None:
    with pytest.raises(CatalogError, match="exactly one of package, command or url"):
        parse_entry("two", {"package": "pypi:x", "url": "https://example.com/mcp"})
    with pytest.raises(CatalogError, match="exactly one of package, command or url"):
        parse_entry("none", {"args": ["--x"]})
    with pytest.raises(CatalogError, match="the program, is empty"):
        parse_entry("blank", {"command": [""]})


@pytest.mark.parametrize(
    ("package", "message"),
    [
        ("pypi:not a name", "not a PyPI requirement"),
        ("pypi:x;rm -rf /", "not a PyPI requirement"),
        ("pypi:", "not a PyPI requirement"),
        ("npm:UpperCase", "not an npm package"),
        ("npm:@scope", "not an npm package"),
        ("cargo:ripgrep", "must start with pypi: or npm:"),
    ],
)
def test_a_bad_package_spec_is_refused_with_the_field(package: str, message: str) -> None:
    with pytest.raises(CatalogError, match=message) as caught:
        parse_entry("srv", {"package": package})
    assert "servers.srv.package" in str(caught.value)


def test_good_package_specs_are_accepted() -> None:
    for package in (
        "pypi:mcp-server-time",
        "pypi:mcp-server-time==2025.1.1",
        "pypi:some_pkg[extra]>=1.0",
        "npm:@modelcontextprotocol/server-memory",
        "npm:@modelcontextprotocol/server-memory@0.6.3",
        "npm:left-pad@^1.3",
    ):
        assert parse_entry("srv", {"package": package}).package == package


def test_an_unknown_field_is_named_with_the_known_ones() -> None:
    with pytest.raises(CatalogError, match=r"servers\.srv: unknown field\(s\) memroy_mb") as c:
        parse_entry("srv", {"package": "pypi:x", "memroy_mb": 64})
    assert "memory_mb" in str(c.value)  # (among the known ones: the typo is easy to see)


def test_fields_are_type_checked() -> None:
    with pytest.raises(CatalogError, match="memory_mb must be a positive whole number"):
        parse_entry("srv", {"package": "pypi:x", "memory_mb": True})
    with pytest.raises(CatalogError, match="cpus must be a positive number"):
        parse_entry("srv", {"package": "pypi:x", "cpus": float("nan")})
    with pytest.raises(CatalogError, match="args must be a list of strings"):
        parse_entry("srv", {"package": "pypi:x", "args": "--flag"})
    with pytest.raises(CatalogError, match="not valid Unicode"):
        parse_entry("srv", {"package": "pypi:x", "args": ["\ud800"]})
    with pytest.raises(CatalogError, match="warm: 0 or 1"):
        parse_entry("srv", {"package": "pypi:x", "warm": 2})
    with pytest.raises(CatalogError, match="a remote server runs elsewhere; it has no env"):
        parse_entry("srv", {"url": "https://example.com/mcp", "env": {"A": "b"}})
    with pytest.raises(CatalogError, match="only a remote"):
        parse_entry("srv", {"package": "pypi:x", "headers": {"X-A": "b"}})


@pytest.mark.parametrize("ref", ["env:API_KEY", "file:/run/secrets/api-key"])
def test_a_secret_is_a_reference_to_a_variable_or_a_file(ref: str) -> None:
    entry = parse_entry("srv", {"package": "pypi:x", "secrets": {"API_KEY": ref}})
    assert entry.secrets == {"API_KEY": ref}


@pytest.mark.parametrize(
    "ref", ["sk-live-123", "env:", "env:9BAD", "file:relative/path", "vault:kv/x"]
)
def test_a_secret_that_is_not_a_reference_is_refused(ref: str) -> None:
    with pytest.raises(CatalogError, match="must be env:NAME") as caught:
        parse_entry("srv", {"package": "pypi:x", "secrets": {"API_KEY": ref}})
    assert "servers.srv.secrets.API_KEY" in str(caught.value)


def test_a_variable_cannot_be_both_plain_and_secret() -> None:
    with pytest.raises(CatalogError, match="A in both env and secrets"):
        parse_entry("srv", {"package": "pypi:x", "env": {"A": "1"}, "secrets": {"A": "env:B"}})


def test_secrets_resolve_from_the_environment_or_a_file(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("from-a-file\n")
    assert resolve_secret("env:K", {"K": "from-env"}) == "from-env"
    assert resolve_secret(f"file:{tmp_path / 'key'}") == "from-a-file"
    with pytest.raises(CatalogError, match="environment has no K"):
        resolve_secret("env:K", {})
    with pytest.raises(CatalogError, match="cannot read it"):
        resolve_secret(f"file:{tmp_path / 'missing'}")


# --- the file ------------------------------------------------------------------------------


def test_a_catalog_round_trips_through_its_file(tmp_path: Path) -> None:
    entries = [
        entry_from_source(
            "time",
            "pypi:mcp-server-time==2025.1.1",
            ["--local-timezone", "UTC"],
            env={"TZ": "UTC", "ODD": 'quote " backslash \\ tab \t del \x7f é'},
            secrets={"API_KEY": "env:TIME_KEY"},
            scope="shared",
            warm=1,
            egress=["api.example.com"],
            cpus=0.5,
            memory_mb=256,
            tools_deny=["convert_time"],
        ),
        entry_from_source("mem", "npm:@modelcontextprotocol/server-memory"),
        entry_from_source("local", "/usr/bin/local-mcp", ["--stdio"], principals=["alice"]),
        entry_from_source(
            "remote", "https://example.com/mcp", headers={"Authorization": "env:REMOTE_TOKEN"}
        ),
    ]
    catalog = Catalog({e.name: e for e in entries})
    path = tmp_path / "state" / "servers.toml"
    save_catalog(path, catalog)
    assert path.stat().st_mode & 0o777 == 0o600  # it names where secrets come from
    assert load_catalog(path) == catalog
    assert parse_catalog(dump_catalog(catalog)) == catalog
    assert not list(path.parent.glob(".*.tmp"))


def test_a_missing_catalog_is_empty_and_a_broken_one_is_an_error(tmp_path: Path) -> None:
    assert load_catalog(tmp_path / "none.toml") == Catalog()
    broken = tmp_path / "broken.toml"
    broken.write_text("[servers.x\n")
    with pytest.raises(CatalogError, match="not valid TOML"):
        load_catalog(broken)
    broken.write_bytes(b'[servers.x]\npackage = "pypi:\xff"\n')
    with pytest.raises(CatalogError, match="not UTF-8"):
        load_catalog(broken)
    broken.write_text('[server.x]\npackage = "pypi:x"\n')
    with pytest.raises(CatalogError, match=r"unknown top-level key\(s\) server"):
        load_catalog(broken)


# --- desktop configs -----------------------------------------------------------------------


def test_a_desktop_config_becomes_packages_commands_and_remotes() -> None:
    catalog, report = import_desktop_config(json.dumps(DESKTOP_CONFIG), Catalog())
    memory, time, notes, linear = (
        catalog.entries[n] for n in ("memory", "time-zones", "notes", "linear")
    )
    assert memory.package == "npm:@modelcontextprotocol/server-memory" and memory.args == ()
    assert time.package == "pypi:mcp-server-time"
    assert time.args == ("--local-timezone", "UTC")
    assert notes.kind == "command" and notes.command == ("/usr/local/bin/notes-mcp",)
    assert notes.args == ("--root", "/data")
    assert notes.env == {"NOTES_MODE": "read-only", "LOG_LEVEL": "debug"}
    assert linear.kind == "remote" and linear.url == "https://mcp.linear.example/mcp"
    assert linear.headers == {"Authorization": "Bearer lin_api_not_a_real_one"}
    assert report == [
        "memory: npm:@modelcontextprotocol/server-memory",
        "time-zones: pypi:mcp-server-time --local-timezone UTC",
        "notes: /usr/local/bin/notes-mcp --root /data",
        "linear: https://mcp.linear.example/mcp",
    ]


def test_only_npx_own_flags_are_dropped_and_uvx_latest_is_the_newest() -> None:
    config = {
        "mcpServers": {
            "a": {"command": "npx", "args": ["--yes", "some-mcp", "-y", "--port", "1"]},
            "b": {"command": "uvx", "args": ["mcp-server-fetch@latest"]},
            "c": {"command": "uvx", "args": ["mcp-server-git@1.2.0"]},
        }
    }
    catalog, _ = import_desktop_config(json.dumps(config), Catalog())
    assert catalog.entries["a"].package == "npm:some-mcp"
    assert catalog.entries["a"].args == ("-y", "--port", "1")  # the server's own -y stays
    assert catalog.entries["b"].package == "pypi:mcp-server-fetch"
    assert catalog.entries["c"].package == "pypi:mcp-server-git==1.2.0"


def test_an_import_never_silently_overwrites_a_server() -> None:
    existing = Catalog({"memory": entry_from_source("memory", "pypi:other")})
    with pytest.raises(CatalogError, match="already has a server named memory"):
        import_desktop_config(json.dumps(DESKTOP_CONFIG), existing)
    catalog, report = import_desktop_config(
        json.dumps(DESKTOP_CONFIG), existing, replace_existing=True
    )
    assert catalog.entries["memory"].package.startswith("npm:")
    assert report[0].endswith("(replaced)")
    twins = {"mcpServers": {"Git": {"command": "a"}, "git": {"command": "b"}}}
    with pytest.raises(CatalogError, match="its name would be git, as Git's is"):
        import_desktop_config(json.dumps(twins), Catalog())


def test_a_bad_desktop_config_names_the_server() -> None:
    with pytest.raises(CatalogError, match="not JSON"):
        import_desktop_config("{", Catalog())
    with pytest.raises(CatalogError, match="mcpServers"):
        import_desktop_config('{"servers": {}}', Catalog())
    bad_env = {"mcpServers": {"x": {"command": "x", "env": {"BAD NAME": "1"}}}}
    with pytest.raises(CatalogError, match=r"mcpServers\.x: .*'BAD NAME' is not a valid name"):
        import_desktop_config(json.dumps(bad_env), Catalog())


# --- the CLI -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _state_dir_of_the_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never the host's real state: a test that forgets --state-dir still writes here."""
    monkeypatch.setenv("SANDBOX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("SANDBOX_SERVERS_FILE", raising=False)


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *words: str) -> tuple[int, str, str]:
    code = cli.main(["--state-dir", str(tmp_path / "state"), *words])
    out, err = capsys.readouterr()
    return code, out, err


def test_add_list_and_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        tmp_path,
        capsys,
        "add",
        "time",
        "pypi:mcp-server-time",
        "--env",
        "TZ=Europe/Secret-Town",
        "--secret",
        "API_KEY=env:TIME_API_KEY",
        "--scope",
        "shared",
        "--warm",
        "1",
        "--egress",
        "api.example.com",
        "--",
        "--local-timezone",
        "UTC",
    )
    assert (code, err) == (0, "")
    assert "added time: pypi:mcp-server-time --local-timezone UTC" in out
    assert "servers install time" in out
    code, _, err = run(
        tmp_path,
        capsys,
        "add",
        "remote",
        "https://example.com/mcp",
        "--header",
        "Authorization=Bearer very-secret-header",
    )
    assert (code, err) == (0, "")
    entry = load_catalog(tmp_path / "state" / "servers.toml").entries["time"]
    assert entry.args == ("--local-timezone", "UTC") and entry.scope == "shared"
    assert entry.egress == ("api.example.com",) and entry.warm == 1

    code, out, err = run(tmp_path, capsys, "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "SOURCE", "SCOPE", "INSTALLED"]
    assert lines[1].split()[:4] == ["remote", "remote", "https://example.com/mcp", "principal"]
    assert "headers: Authorization" in lines[1]
    assert lines[2].split()[:2] == ["time", "pypi"]
    assert "not installed" in lines[2] and "secrets: API_KEY" in lines[2]
    code, as_json, _ = run(tmp_path, capsys, "list", "--json")
    described = {d["name"]: d for d in json.loads(as_json)}
    assert described["time"]["secrets"] == ["API_KEY"] and described["time"]["env"] == ["TZ"]
    assert described["time"]["installed"] is None
    for text in (out, as_json):  # never a value: not of a variable, a secret or a header
        for value in ("Secret-Town", "TIME_API_KEY", "very-secret-header", "Bearer"):
            assert value not in text

    code, out, err = run(tmp_path, capsys, "remove", "time")
    assert (code, out) == (0, "removed time\n")
    assert set(load_catalog(tmp_path / "state" / "servers.toml").entries) == {"remote"}
    code, _, err = run(tmp_path, capsys, "remove", "time")
    assert code == 1 and err == "srt-mcp-server servers: no server named 'time' in the catalog\n"


def test_add_replaces_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tmp_path, capsys, "add", "srv", "pypi:a")[0] == 0
    code, _, err = run(tmp_path, capsys, "add", "srv", "pypi:b")
    assert code == 1 and "already has a server named srv" in err and "--replace" in err
    # (an install of the old package is not the new one's: removed)
    install = tmp_path / "state" / "servers" / "install" / "srv"
    install.mkdir(parents=True)
    (install / RECORD).write_text(
        json.dumps(
            {
                "name": "srv",
                "package": "pypi:a",
                "version": "1",
                "program": [f"{INSTALL_MOUNT}/env/bin/python"],
                "installed_at": 1.0,
            }
        )
    )
    assert read_installed(tmp_path / "state" / "servers", "srv") is not None
    code, out, _ = run(tmp_path, capsys, "add", "srv", "pypi:b", "--replace")
    assert code == 0 and out.startswith("replaced srv: pypi:b")
    assert not install.exists()


def test_usage_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        ("frob",),
        ("add", "only-a-name"),
        ("add", "srv", "pypi:x", "--env", "NO_EQUALS_sk-secret"),
        ("add", "srv", "pypi:x", "--memory-mb", "lots"),
        ("logs", "../../etc/passwd"),
        ("remove", "srv", "--", "more"),
    ]
    for words in cases:
        code, _, err = run(tmp_path, capsys, *words)
        assert code == 2, words
        assert err.startswith("srt-mcp-server servers: ") and err.count("\n") == 1, err
        assert "sk-secret" not in err
    code, _, err = run(tmp_path, capsys, "add", "Bad_Name", "pypi:x")
    assert code == 1 and "name is 1-48" in err and "Traceback" not in err


def test_import_reports_and_reminds_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "claude_desktop_config.json"
    config.write_text(json.dumps(DESKTOP_CONFIG))
    code, out, err = run(tmp_path, capsys, "import", str(config))
    assert (code, err) == (0, "")
    assert "imported memory: npm:@modelcontextprotocol/server-memory" in out
    assert "imported linear: https://mcp.linear.example/mcp" in out
    assert "srt-mcp-server servers install" in out
    catalog = load_catalog(tmp_path / "state" / "servers.toml")
    assert set(catalog.entries) == {"memory", "time-zones", "notes", "linear"}
    code, _, err = run(tmp_path, capsys, "import", str(config))
    assert code == 1 and "already has a server named memory" in err
    assert run(tmp_path, capsys, "import", str(config), "--replace")[0] == 0
    code, out, _ = run(tmp_path, capsys, "list")
    assert "lin_api_not_a_real_one" not in out and "read-only" not in out
    code, _, err = run(tmp_path, capsys, "import", str(tmp_path / "missing.json"))
    assert code == 1 and "cannot read it" in err


def test_logs_prints_the_end_of_the_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(tmp_path, capsys, "logs", "time")
    assert code == 1 and "no server named 'time' in " in err, err
    assert run(tmp_path, capsys, "add", "time", "pypi:mcp-server-time")[0] == 0
    code, _, err = run(tmp_path, capsys, "logs", "time")
    assert code == 1 and "no log for time" in err and "no instance of it has run" in err, err
    code, _, err = run(tmp_path, capsys, "logs", "tme")
    assert code == 1 and err.endswith("no server named 'tme' (did you mean 'time'?)\n"), err
    logs = tmp_path / "state" / "servers" / "logs"
    logs.mkdir(parents=True)
    (logs / "time.log").write_bytes(b"".join(b"line %d\n" % i for i in range(100)) + b"\xff")
    code, out, _ = run(tmp_path, capsys, "logs", "time", "--lines", "3")
    assert code == 0 and out == "line 98\nline 99\n\ufffd\n"
    code, out, _ = run(tmp_path, capsys, "logs", "time")
    assert out.splitlines()[0] == "line 51" and len(out.splitlines()) == cli.LOG_LINES


def test_install_keeps_going_past_a_broken_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(tmp_path, capsys, "add", "local", "/usr/bin/true", "--directory", "/srv/x")[0] == 0
    assert load_catalog(tmp_path / "state" / "servers.toml").entries["local"].directory == "/srv/x"
    code, out, err = run(tmp_path, capsys, "install", "missing", "local")
    assert code == 1
    assert "missing: no server of this name" in err
    assert "local: nothing to install (command)" in out
    code, out, _ = run(tmp_path, capsys, "install")
    assert code == 0 and "nothing to install" in out


def test_the_main_cli_hands_servers_to_its_own_parser(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = str(tmp_path / "state")
    assert top_cli.main(["servers", "add", "srv", "pypi:x", "--state-dir", state]) == 0
    assert top_cli.main(["servers", "--state-dir", state, "list"]) == 0
    assert "srv" in capsys.readouterr().out
    assert top_cli.main(["servers", "list", "--file", str(tmp_path / "other.toml")]) == 0
    assert "no servers in" in capsys.readouterr().out


def test_catalog_problems_are_told_per_principal(tmp_path: Path) -> None:
    """An entry's error goes to the principals that may use it; one whose principals cannot
    be read is only said to exist; a file that is not TOML only said to be invalid."""
    from sandbox_runtime.servers.catalog_file import BROKEN_FILE, UNKNOWN_ENTRY, CatalogFile

    path = tmp_path / "servers.toml"
    path.write_text(
        '[servers.ok]\ncommand = ["/bin/true"]\n'
        '[servers.mine]\ncommand = ["/bin/true"]\nscope = "x"\nprincipals = "alice"\n'
        '[servers.anyone]\ncommand = ["/bin/true"]\nscope = "y"\n'
        '[servers.odd]\ncommand = ["/bin/true"]\nprincipals = 5\n'
    )
    catalog = CatalogFile(path)
    assert set(catalog.current().entries) == {"ok"}
    alice, bob = catalog.problem_for("alice") or "", catalog.problem_for("bob") or ""
    assert "servers.mine.scope" in alice and "servers.anyone.scope" in alice, alice
    assert "mine" not in bob and "servers.anyone.scope" in bob, bob
    for told in (alice, bob):
        assert UNKNOWN_ENTRY in told and "odd" not in told, told
    assert "servers.odd" in (catalog.problem or "") and "servers.mine" in (catalog.problem or "")
    path.write_text("[servers.x\n")  # (not TOML: the last good catalog and its problems stay)
    assert set(catalog.current().entries) == {"ok"}
    bob = catalog.problem_for("bob") or ""
    assert BROKEN_FILE in bob and "servers.anyone.scope" in bob and str(path) not in bob, bob


def test_what_instances_said_is_kept_by_owner_and_bounded() -> None:
    from sandbox_runtime.domain.owner import Owner
    from sandbox_runtime.servers import learned as learned_module
    from sandbox_runtime.servers.catalog import parse_entry
    from sandbox_runtime.servers.learned import Learned

    entry = parse_entry("s", {"command": ["/bin/true"]})
    alice, bob, shared = (Owner(p, "srv:s") for p in ("alice", "bob", ""))
    kept = Learned()
    kept.keep_tools((alice, "s"), entry, [{"name": "alices"}])
    assert kept.tools((bob, "s"), entry) is None
    assert kept.tools((alice, "s"), entry) == [{"name": "alices"}]
    assert kept.tools((alice, "s"), parse_entry("s", {"command": ["/bin/false"]})) is None
    kept.history((bob, "s")).crashes.append(learned_module.time.monotonic())
    kept.history((bob, "s")).last_error = "crashed: bob's"
    kept.history((bob, "s")).last_error_at = 1.0
    kept.history((shared, "s")).crashes.append(learned_module.time.monotonic())
    assert kept.crashes_recent("s", "alice") == 1 and kept.crashes_recent("s", "bob") == 2
    assert kept.last_error("s", "alice") == (None, None)
    assert kept.last_error("s", None) == ("crashed: bob's", 1.0)  # (the operator's view)
    big = [{"name": "x", "description": "d" * (learned_module.MAX_TOOL_LIST_BYTES // 5)}]
    for n in range(6):  # (64 MiB in all: the oldest lists go)
        kept.keep_tools((Owner(f"p{n}", "srv:s"), "s"), entry, big)
    assert kept.tools((Owner("p0", "srv:s"), "s"), entry) is None
    assert kept.tools((Owner("p5", "srv:s"), "s"), entry) == big
    assert kept._tool_bytes <= learned_module.MAX_TOOL_LIST_BYTES
