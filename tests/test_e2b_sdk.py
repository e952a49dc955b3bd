"""The E2B SDKs, unmodified, against the real server's E2B API (SANDBOX_E2B=true).

The SDKs run in venvs / a node_modules of their own pins (tests/clients/requirements-e2b*.txt,
tests/clients/e2b-node; scripts/_setup.sh's ensure_clients installs them): the Python `e2b`
newest release (POST /v2/sandboxes, since 2.51) and the last before that move (POST
/sandboxes), and the JS `e2b` under Node. A driver in tests/clients/ runs E2B's documented
examples, finding the server by E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY only, and prints
what the SDK returned; the tests here judge it. Without the clients the tests skip, except
under CI=true, where they fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import ServerProcess, Servers, open_client

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).resolve().parent
DRIVERS = TESTS / "clients"
ROOT = TESTS.parent
ALICE = "e2b_" + "a1" * 20
BOB = "e2b_" + "b2" * 20
PYTHONS = {
    "latest": ("SRT_CLIENTS_E2B_PY", ROOT / ".clients/e2b-py/bin/python"),
    "pre-v2": ("SRT_CLIENTS_E2B_PY_OLD", ROOT / ".clients/e2b-py-old/bin/python"),
}
SDKS = [pytest.param("latest", id="e2b-latest"), pytest.param("pre-v2", id="e2b-2.50")]


def missing(reason: str) -> None:
    """Skip, or fail under CI: CI must run these."""
    reason += " (scripts/test builds the clients: ensure_clients in scripts/_setup.sh)"
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


def e2b_python(sdk: str) -> Path:
    var, default = PYTHONS[sdk]
    path = Path(os.environ.get(var) or default)
    if not os.access(path, os.X_OK):
        missing(f"no E2B SDK venv: {var}={os.environ.get(var)!r}, {path} is missing")
    return path


def e2b_node() -> tuple[str, Path]:
    value = os.environ.get("SRT_CLIENTS_E2B_NODE")
    modules = Path(value or ROOT / ".clients/e2b-node") / "node_modules"
    node = shutil.which("node")
    if node is None:
        missing("node is not installed")
    if not (modules / "e2b").is_dir():
        missing(f"no E2B JS SDK: SRT_CLIENTS_E2B_NODE={value!r}, {modules} has none")
    assert node is not None
    return node, modules


def sdk_env(base_url: str, key: str) -> dict[str, str]:
    """The environment of an SDK process: the three variables, nothing of ours."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("E2B_")
    }
    env.update(
        E2B_API_URL=f"{base_url}/e2b",
        E2B_SANDBOX_URL=f"{base_url}/e2b",
        E2B_API_KEY=key,
        PYTHONUNBUFFERED="1",
    )
    return env


def run_driver(
    argv: list[str], base_url: str, cwd: Path, key: str = ALICE, timeout: float = 180
) -> Any:
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=sdk_env(base_url, key),
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        pytest.fail(
            f"the driver printed no report (exit {proc.returncode}):\n"
            f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}"
        )
    report = json.loads(lines[-1])
    if "crash" in report:
        pytest.fail(
            f"the driver crashed: {report['crash']}\n"
            f"{report.get('traceback') or report.get('stack')}\nstderr: {proc.stderr[-3000:]}"
        )
    return report


def python_driver(sdk: str, base_url: str, cwd: Path, *args: str, key: str = ALICE) -> Any:
    argv = [str(e2b_python(sdk)), str(DRIVERS / "e2b_driver.py"), *args]
    return run_driver(argv, base_url, cwd, key)


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve(
        "e2b",
        SANDBOX_E2B="true",
        SANDBOX_AUTH_TOKENS=f"alice:{ALICE},bob:{BOB}",
        SANDBOX_WORKSPACE_MB="160",
    )


@pytest.mark.parametrize("sdk", SDKS)
def test_documented_examples(sdk: str, server: ServerProcess, tmp_path: Path) -> None:
    """create, commands.run (foreground, exit codes, env vars, background with on_stdout,
    stdin, kill), files (write/read/list/make_dir/rename/remove/exists), list, connect from a
    second process, pause/resume keeping files, set_timeout then expiry, kill."""
    r = python_driver(sdk, server.base_url, tmp_path, "examples")
    assert r["info"] == {"template": "base", "state": "running"}
    assert r["run"] == {"stdout": "hi\nhello\n", "stderr": "oops\n", "exit": 0}
    assert r["exit3"] == 3
    assert r["home"] == "/home/user user\n/home/user\n"
    assert r["background"] == {"seen": "line1\nline2\nline3\n", "exit": 0}
    assert r["stdin"] == "typed\n"
    assert r["listed"] is True and r["killed"] is True
    assert r["after_kill"]["exit"] != 0
    assert r["read"] == "first" and r["cat"] == "first"
    assert r["read_bytes"] == b"\x00\x01bytes".hex()
    assert r["list"] == ["data", "notes.txt"]
    assert r["make_dir"] == [True, False]
    assert r["rename"] == "/home/user/d/renamed.txt"
    assert r["exists"] == [False, True] and r["removed"] is True
    assert r["missing"] == "FileNotFoundException"
    assert r["in_list"] is True
    assert r["second_process"] == "survives"
    assert r["paused_state"] == "paused"
    assert r["resumed_read"] == "survives" and r["resumed_state"] == "running"
    assert r["running_after_timeout"] is False and r["listed_after_timeout"] is False
    assert r["kill"] is True and r["kill_again"] is False
    # Every sandbox it made is killed or expired: nothing of their sessions stays behind
    # (each records the environment it chose; an ended session forgets it).
    assert list((server.state_dir / "session-environments").glob("*.json")) == []


def test_fifty_megabytes_each_way(server: ServerProcess, tmp_path: Path) -> None:
    """files.write and files.read of 50 MB: the bytes in the sandbox and back are the same."""
    r = python_driver("latest", server.base_url, tmp_path, "transfer", "50")
    assert r["sha_in_sandbox_matches"] is True
    assert r["download_matches"] is True


def test_js_sdk_examples(server: ServerProcess, tmp_path: Path) -> None:
    """The JS SDK under Node: the same examples, a 50 MB round trip, pause/resume, kill."""
    node, modules = e2b_node()
    work = tmp_path / "js"
    work.mkdir()
    shutil.copy(DRIVERS / "e2b_driver.mjs", work)
    (work / "node_modules").symlink_to(modules, target_is_directory=True)
    r = run_driver([node, str(work / "e2b_driver.mjs")], server.base_url, work)
    assert r["run"] == {"stdout": "hi\nhello\n", "stderr": "oops\n", "exit": 0}
    assert r["exit3"] == 3
    assert r["background"] == {"seen": "line1\nline2\nline3\n", "exit": 0}
    assert r["stdin"] == "typed\n"
    assert r["killed"] is True and r["afterKill"]["exit"] != 0
    assert r["read"] == "first" and r["list"] == ["notes.txt"]
    assert r["makeDir"] == [True, False] and r["rename"] == "/home/user/d/renamed.txt"
    assert r["removed"] is True and r["bigMatches"] is True and r["inList"] is True
    assert r["resumedRead"] == "survives"
    assert r["kill"] is True and r["isRunning"] is False


def test_commands_are_our_executions(server: ServerProcess, tmp_path: Path) -> None:
    """A command run through the SDK is an execution of the sandbox's session: it is in
    `list_executions` of session `e2b-<id>` for the key's principal (and not for another)."""
    created = python_driver("latest", server.base_url, tmp_path, "create")
    sandbox_id = created["sandbox_id"]
    ran = python_driver("latest", server.base_url, tmp_path, "run", sandbox_id, "echo traced")
    assert ran == {"stdout": "traced\n", "exit": 0}

    async def listed(token: str) -> list[Any]:
        async with open_client(server.url, token) as conn:
            result = await conn.ok("list_executions", session=f"e2b-{sandbox_id}")
            return list(result["result"])

    mine = asyncio.run(listed(ALICE))
    assert any("echo traced" in json.dumps(e["command"]) for e in mine), mine
    assert asyncio.run(listed(BOB)) == []
    assert python_driver("latest", server.base_url, tmp_path, "kill", sandbox_id) == {
        "killed": True
    }
