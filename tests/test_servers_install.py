"""Installing hosted servers' packages ahead (servers/installs.py) from the real registries:
a PyPI and an npm MCP server are installed, their recorded programs answer MCP, a second
install downloads nothing, and a failed install leaves nothing half-made behind."""

from __future__ import annotations

import contextlib
import io
import json
import os
import selectors
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_runtime.servers import cli
from sandbox_runtime.servers.catalog import CatalogError, entry_from_source, load_catalog
from sandbox_runtime.servers.installs import (
    INSTALL_MOUNT,
    RECORD,
    Installed,
    install_dir,
    install_entry,
    read_installed,
    remove_install,
)

# (pip and npm from the registries: a first install takes tens of seconds)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PACKAGES = {
    "time": "pypi:mcp-server-time",
    "memory": "npm:@modelcontextprotocol/server-memory",
}
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-03-26",
        "capabilities": {},
        "clientInfo": {"name": "srt-tests", "version": "0"},
    },
}


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A state dir whose catalog has both servers, installed by `servers install`."""
    state = tmp_path_factory.mktemp("servers-state")
    common = ["--state-dir", str(state)]
    for name, package in PACKAGES.items():
        assert cli.main([*common, "add", name, package]) == 0
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([*common, "install"])
    assert code == 0, err.getvalue()
    lines = sorted(out.getvalue().splitlines())
    assert lines[0].startswith("memory: installed npm:@modelcontextprotocol/server-memory ")
    assert lines[1].startswith("time: installed pypi:mcp-server-time ")
    yield state


def servers_dir(state: Path) -> Path:
    return state / "servers"


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_an_install_is_recorded_with_the_program_inside_the_sandbox(state: Path, name: str) -> None:
    record = read_installed(servers_dir(state), name)
    assert record is not None
    assert record.name == name and record.package == PACKAGES[name]
    assert record.version and record.version[0].isdigit()
    assert time.time() - 3600 < record.installed_at <= time.time()
    root = install_dir(servers_dir(state), name)
    assert json.loads((root / RECORD).read_text())["program"] == list(record.program)
    # Paths the sandbox sees: the interpreter under /usr (or the install's own, which
    # links there) and the package's files under the mount, never the host's state dir.
    assert not any(str(state) in part for part in record.program)
    if name == "time":
        assert record.program[:2] == (f"{INSTALL_MOUNT}/env/bin/python", "-c")
        assert "from mcp_server_time import main" in record.program[2]
        assert os.path.realpath(root / "env" / "bin" / "python").startswith("/usr/")
    else:
        assert record.program[0].startswith("/usr/") and record.program[0].endswith("node")
        assert record.program[1].startswith(
            f"{INSTALL_MOUNT}/env/node_modules/@modelcontextprotocol/server-memory/"
        )
    # The sandbox user is not root: it reads everything, writes nothing.
    for dirpath, _, filenames in os.walk(root):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o755, dirpath
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            if not os.path.islink(path):
                mode = stat.S_IMODE(os.stat(path).st_mode)
                assert mode & 0o444 == 0o444 and not mode & 0o022, path
    assert not [p.name for p in root.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_the_recorded_program_answers_mcp(state: Path, name: str) -> None:
    record = read_installed(servers_dir(state), name)
    assert record is not None
    host = str(install_dir(servers_dir(state), name))
    argv = [part.replace(INSTALL_MOUNT, host) for part in record.program]
    reply = first_reply(argv, INITIALIZE, cwd=state)
    assert reply["id"] == 1 and "serverInfo" in reply["result"], reply


def test_a_second_install_downloads_nothing(state: Path) -> None:
    catalog = load_catalog(state / "servers.toml")
    for name in PACKAGES:
        before = read_installed(servers_dir(state), name)
        steps: list[str] = []
        started = time.monotonic()
        again = install_entry(catalog.entries[name], servers_dir(state), log=steps.append)
        assert time.monotonic() - started < 2
        assert again == before and steps == []


def test_a_failed_install_leaves_nothing_and_keeps_the_previous_one(state: Path) -> None:
    bad = "pypi:this-package-does-not-exist-srt-0"
    with pytest.raises(CatalogError) as caught:
        install_entry(entry_from_source("ghost", bad), servers_dir(state), log=lambda _: None)
    message = str(caught.value)
    assert message.startswith("ghost: ") and "this-package-does-not-exist-srt-0" in message
    assert "No matching distribution" in message  # (the end of pip's own output)
    installs = servers_dir(state) / "install"
    assert sorted(p.name for p in installs.iterdir()) == sorted(PACKAGES)

    # The same name, now a package that cannot install: the good install stays in place.
    before = read_installed(servers_dir(state), "time")
    with pytest.raises(CatalogError, match=r"^time: "):
        install_entry(entry_from_source("time", bad), servers_dir(state), log=lambda _: None)
    assert read_installed(servers_dir(state), "time") == before
    assert sorted(p.name for p in installs.iterdir()) == sorted(PACKAGES)


def test_remove_install_removes_only_that_one(tmp_path: Path, state: Path) -> None:
    remove_install(servers_dir(state), "ghost")  # (none: nothing to do)
    before = read_installed(servers_dir(state), "memory")
    assert isinstance(before, Installed)
    copy = servers_dir(tmp_path) / "install" / "memory"
    copy.parent.mkdir(parents=True)
    subprocess.run(
        ["cp", "-a", str(install_dir(servers_dir(state), "memory")), str(copy)], check=True
    )
    remove_install(servers_dir(tmp_path), "memory")
    assert not copy.exists() and read_installed(servers_dir(tmp_path), "memory") is None
    assert read_installed(servers_dir(state), "memory") == before


def first_reply(argv: list[str], request: dict[str, object], cwd: Path) -> dict[str, object]:
    """Start `argv`, send one JSON-RPC line, and return the first JSON line it answers."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8"},
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        proc.stdin.flush()
        buffer = b""
        deadline = time.monotonic() + 60
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buffer:
                left = deadline - time.monotonic()
                assert left > 0, f"no reply from {argv}: {buffer!r}"
                if selector.select(left):
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        err = proc.stderr.read().decode(errors="replace")
                        raise AssertionError(f"{argv} exited without a reply: {err}")
                    buffer += chunk
        reply: dict[str, object] = json.loads(buffer.split(b"\n", 1)[0])
        return reply
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
