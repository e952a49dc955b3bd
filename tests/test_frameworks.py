"""Real agent-framework clients against the real server, driven without a model.

Each framework runs in a venv of its own pins (tests/clients/requirements-*.txt; scripts/test
builds them with ensure_clients): .clients/py on mcp 1.x speaks the 2025-11-25 era, .clients/py2
on mcp 2.x negotiates 2026-07-28 (for the frameworks whose releases accept mcp 2), and
.clients/node holds the TypeScript SDKs (1.x: 2025 era; the 2.x client package: 2026). A driver
in tests/clients/ does what an agent built on the framework does and prints one JSON object of
what it saw; the tests here judge it.

| framework | eras |
|---|---|
| langchain-mcp-adapters (default per-call sessions) | 2025 only: it requires mcp<2 |
| openai-agents (convert_schemas_to_strict) | 2025 (mcp 1.x), 2026 (mcp 2.x, mode "auto") |
| pydantic-ai MCPToolset | 2025 (FastMCP 3), 2026 (FastMCP 4, mode "auto") |
| google-genai (ClientSession in tools=[...]) | 2025 (mcp 1.x), 2026 (mcp 2.x Client.session) |
| TypeScript SDK | 2025 (@modelcontextprotocol/sdk 1.x), 2026 (@modelcontextprotocol/client 2.x) |
| mcp-remote (the stdio bridge desktop clients run) | 2025 |

Without the clients the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import MODERN_PROTOCOL, ServerProcess, Servers, running_server

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).resolve().parent
DRIVERS = TESTS / "clients"
ROOT = TESTS.parent
TOKEN = "frameworks-token-0123456789abcdef"

# era -> (the env var scripts/test sets, where ensure_clients puts it by default)
PYTHONS = {
    "legacy": ("SRT_CLIENTS_PY", ROOT / ".clients/py/bin/python"),
    "modern": ("SRT_CLIENTS_PY2", ROOT / ".clients/py2/bin/python"),
}
ERAS = [pytest.param("legacy", id="2025-era"), pytest.param("modern", id="2026-era")]
TS_SDKS = [pytest.param("v1", id="sdk1-2025-era"), pytest.param("v2", id="client2-2026-era")]


def missing(reason: str) -> None:
    """Skip, or fail under CI: CI must run these."""
    reason += " (scripts/test builds the clients: ensure_clients in scripts/_setup.sh)"
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


def clients_python(era: str) -> Path:
    var, default = PYTHONS[era]
    path = Path(os.environ.get(var) or default)
    if not os.access(path, os.X_OK):
        missing(f"no framework clients venv: {var}={os.environ.get(var)!r}, {path} is missing")
    return path


def clients_node() -> tuple[str, Path]:
    """The node binary and the node_modules of the TypeScript SDKs."""
    value = os.environ.get("SRT_CLIENTS_NODE")
    modules = Path(value or ROOT / ".clients/node") / "node_modules"
    node = shutil.which("node")
    if node is None:
        missing("node is not installed")
    if not (modules / "@modelcontextprotocol").is_dir():
        missing(f"no TypeScript SDKs: SRT_CLIENTS_NODE={value!r}, {modules} has none")
    assert node is not None
    return node, modules


def brief(value: Any, limit: int = 1500) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def run_driver(argv: list[str], server: ServerProcess, cwd: Path, timeout: float = 90) -> Any:
    """Run a driver against `server`; its JSON report (fails on a crash or no report)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run(
        [*argv, "--url", server.url, "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        pytest.fail(
            f"{argv[-1]} printed no report (exit {proc.returncode}):\n"
            f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}"
        )
    report = json.loads(lines[-1])
    if "crash" in report:
        pytest.fail(
            f"{argv[-1]} crashed: {report['crash']}\n"
            f"{report.get('traceback') or report.get('stack')}\nstderr: {proc.stderr[-3000:]}"
        )
    return report


def python_driver(era: str, script: str, server: ServerProcess, cwd: Path, *extra: str) -> Any:
    return run_driver([str(clients_python(era)), str(DRIVERS / script), *extra], server, cwd)


def check_era(report: dict[str, Any], era: str) -> None:
    version = report.get("protocol_version")
    if era == "modern":
        assert version == MODERN_PROTOCOL, f"negotiated {version!r}, not {MODERN_PROTOCOL}"
    else:
        assert version and version < MODERN_PROTOCOL, f"negotiated {version!r}"


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve("frameworks", SANDBOX_AUTH_TOKEN=TOKEN)


# One driver run per (driver, era) serves the module's tests of it.
_reports: dict[tuple[str, str], Any] = {}


def cached(key: tuple[str, str], make: Any) -> Any:
    if key not in _reports:
        _reports[key] = make()
    return _reports[key]


# -- langchain-mcp-adapters -------------------------------------------------------------------


def python_interpreters(server: ServerProcess) -> float:
    return sum(
        server.metric(TOKEN, "srt_interpreters{", 'language="python"', f'state="{state}"')
        for state in ("busy", "idle")
    )


def test_langchain_per_call_sessions_share_one_interpreter(tmp_path: Path) -> None:
    """get_tools() without client.session(): every call is a new MCP transport session. 20
    unnamed run_code calls all work, `x = 1` is still there for `print(x)` at the end, and the
    token ends with at most one Python interpreter (the session is "default" in every call)."""
    clients_python("legacy")
    with running_server(tmp_path / "server", SANDBOX_AUTH_TOKEN=TOKEN) as srv:
        report = python_driver("legacy", "langchain_driver.py", srv, tmp_path, "--calls", "20")
        interpreters = python_interpreters(srv)
    assert "run_code" in (report.get("tools") or []), brief(report.get("tools"))
    calls = report["calls"]
    assert len(calls) == 20
    failed = [
        {"call": i, "code": c["code"], **c["result"]}
        for i, c in enumerate(calls)
        if "exception" in c["result"]
        or c["result"]["is_error"]
        or c["result"]["status"] != "completed"
    ]
    assert not failed, f"{len(failed)} of 20 calls failed, the first: {brief(failed[:2])}"
    for i, c in enumerate(calls[1:-1], start=1):
        assert c["result"]["stdout"] == f"call {i}\n", brief(c)
    last = calls[-1]["result"]
    assert last["stdout"] == "1\n", f"x = 1 did not survive to the last call: {brief(last)}"
    assert interpreters <= 1, f"{interpreters:g} python interpreters for one token after 20 calls"
    sessions = {c["result"]["session"] for c in calls}
    assert sessions == {"default"}, f"sessions named in the results: {sessions}"
    # What the model reads (LangChain hands it the text): the output, not the result's JSON.
    for i, c in enumerate(calls[1:-1], start=1):
        assert c["result"]["text"] == [f"call {i}"], brief(c["result"]["text"])
    assert last["text"] == ["1"], brief(last["text"])


# -- openai-agents ------------------------------------------------------------------------------


def openai_agents_report(era: str, server: ServerProcess, tmp_path: Path) -> Any:
    return cached(
        ("openai-agents", era),
        lambda: python_driver(era, "openai_agents_driver.py", server, tmp_path),
    )


@pytest.mark.parametrize("era", ERAS)
def test_openai_agents_strict_conversion(era: str, server: ServerProcess, tmp_path: Path) -> None:
    """convert_schemas_to_strict=True converts every tool (the SDK silently falls back to a
    non-strict schema when it cannot), and `environment` / `sandbox_config` stay usable."""
    report = openai_agents_report(era, server, tmp_path)
    check_era(report, era)
    tools = report["tools"]
    assert {"execute_code", "run_code"} <= set(tools), sorted(tools)
    not_strict = {name: t["strict_error"] for name, t in tools.items() if not t["strict"]}
    assert not not_strict, f"not converted to strict: {brief(not_strict)}"
    unusable = {
        f"{name}.{prop}": t[f"{prop}_schema"]
        for name, t in tools.items()
        for prop, ok in t["usable"].items()
        if not ok
    }
    assert not unusable, f"collapsed by strict conversion: {brief(unusable)}"
    assert tools["execute_code"]["usable"].keys() == {"environment", "sandbox_config"}


@pytest.mark.parametrize("era", ERAS)
def test_openai_agents_invoke_with_strict_environment(
    era: str, server: ServerProcess, tmp_path: Path
) -> None:
    """execute_code through the function tool, with every property present (nulls) and the
    environment as a strict-mode model writes it, a list of {name, value}: the variable
    reaches the command."""
    report = openai_agents_report(era, server, tmp_path)
    result = report["invoke"]
    assert "exception" not in result, brief(result)
    assert not report["invoke_arguments_valid"], (
        "the strict-form arguments do not match the tool's schema: "
        + brief(report["invoke_arguments_valid"])
    )
    # The function tool hands the model the text: the command's output and how it ended.
    (text,) = result["text"]
    assert text.startswith(result["expected_stdout"] + "[exit 0, "), brief(result)


# -- pydantic-ai --------------------------------------------------------------------------------


@pytest.mark.parametrize("era", ERAS)
def test_pydantic_ai_toolset_calls(era: str, server: ServerProcess, tmp_path: Path) -> None:
    """MCPToolset in an Agent whose scripted model calls execute_code and run_code."""
    report = python_driver(era, "pydantic_ai_driver.py", server, tmp_path)
    assert report.get("run") == "done", brief(report.get("run"))
    check_era(report, era)
    assert {"execute_code", "run_code"} <= set(report["tools"]), sorted(report["tools"])
    results = report["results"]
    assert results["exec"]["stdout"] == "pyd-exec-ok\n", brief(results["exec"])
    assert not results["exec"]["is_error"], brief(results["exec"])
    assert results["run"]["stdout"] == "42\n", brief(results["run"])
    assert results["run"]["status"] == "completed", brief(results["run"])
    for name in ("exec", "run"):
        assert results[name]["output_key"] == "output", brief(results[name])


# -- google-genai -------------------------------------------------------------------------------


@pytest.mark.parametrize("era", ERAS)
def test_genai_converts_every_tool(era: str, server: ServerProcess, tmp_path: Path) -> None:
    """A ClientSession in tools=[...]: google-genai converts every tool's schema; with the API
    endpoint a closed port, generate_content fails at connecting, not converting."""
    report = python_driver(era, "genai_driver.py", server, tmp_path)
    check_era(report, era)
    tools = report["tools"]
    assert {"execute_code", "run_code"} <= set(tools), sorted(tools)
    failed = {name: t["exception"] for name, t in tools.items() if "exception" in t}
    assert not failed, f"{len(failed)} of {len(tools)} tools do not convert: {brief(failed)}"
    generated = report["generate_dict_config"]
    assert generated.get("connection_error"), f"failed before connecting: {brief(generated)}"


# -- TypeScript SDK -----------------------------------------------------------------------------


def ts_report(sdk: str, server: ServerProcess, tmp_path: Path) -> Any:
    node, modules = clients_node()

    def make() -> Any:
        # ESM resolves packages from the script's own directory: a copy of the driver beside a
        # link to the installed node_modules.
        work = tmp_path / f"ts-{sdk}"
        work.mkdir()
        shutil.copy(DRIVERS / "ts_sdk_driver.mjs", work)
        (work / "node_modules").symlink_to(modules, target_is_directory=True)
        argv = [node, str(work / "ts_sdk_driver.mjs"), "--sdk", sdk, "--sleep", "12"]
        return run_driver(argv, server, work)

    return cached(("ts", sdk), make)


@pytest.mark.parametrize("sdk", TS_SDKS)
def test_typescript_sdk_long_call_lives_on_progress(
    sdk: str, server: ServerProcess, tmp_path: Path
) -> None:
    """callTool(execute_code `sleep 12; echo done`, {timeout: 5000, resetTimeoutOnProgress:
    true, onprogress}): the server's progress notifications keep it alive to the end."""
    report = ts_report(sdk, server, tmp_path)
    check_era(report, "modern" if sdk == "v2" else "legacy")
    call = report["long_call"]
    assert call.get("exception") is None, (
        f"{call.get('exception')} after {call['seconds']}s with {call['progress_count']} "
        f"progress notifications (longest gap {call['max_gap_ms']} ms)"
    )
    assert not call["is_error"], brief(call)
    assert "done" in call["stdout"], brief(call)
    assert call["max_gap_ms"] < 5000, brief(call)


@pytest.mark.parametrize("sdk", TS_SDKS)
def test_typescript_sdk_wrong_token_says_invalid_token(
    sdk: str, server: ServerProcess, tmp_path: Path
) -> None:
    """A wrong token: the error says "invalid token". The 1.x SDK puts the 401 body in the
    error's message; the 2.x client in mode "auto" says only "Version negotiation failed: the
    server requires authorization (HTTP 401)" and keeps the body in error.data.text."""
    wrong = ts_report(sdk, server, tmp_path)["wrong_token"]
    assert wrong.get("exception"), "a wrong token was accepted"
    assert wrong["status"] == 401, brief(wrong)
    shown = wrong["message"] if sdk == "v1" else wrong["body"] or ""
    assert "invalid token" in shown.lower(), brief(wrong)


# -- mcp-remote (a stdio bridge that desktop clients run) ---------------------------------------


def mcp_remote(server: ServerProcess, home: Path, token: str, lines: list[dict[str, Any]]) -> Any:
    """Run mcp-remote against `server` with `token`, feed it `lines` on stdin (as a desktop
    client would over stdio), and return (its JSON-RPC answers, its stderr)."""
    node, modules = clients_node()
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home)}  # it keeps its OAuth state under ~/.mcp-auth
    proc = subprocess.Popen(
        [node, str(modules / "mcp-remote/dist/proxy.js"), server.url, "--transport",
         "http-only", "--header", f"Authorization: Bearer {token}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    answers: list[Any] = []
    try:
        for line in lines:
            proc.stdin.write((json.dumps(line) + "\n").encode())
            proc.stdin.flush()
            if "id" not in line:
                continue
            answer = proc.stdout.readline()
            if not answer:
                break
            answers.append(json.loads(answer))
    finally:
        try:  # (closes its stdin: mcp-remote then ends)
            _, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    return answers, stderr.decode(errors="replace")


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "desktop", "version": "1"},
    },
}


def test_mcp_remote_bridges_calls_and_says_invalid_token(
    server: ServerProcess, tmp_path: Path
) -> None:
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "execute_code", "arguments": {"command": "echo bridged"}},
    }
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    answers, stderr = mcp_remote(server, tmp_path / "home", TOKEN, [INITIALIZE, initialized, call])
    assert [a.get("id") for a in answers] == [1, 2], f"{answers}\n{stderr[-2000:]}"
    result = answers[1]["result"]
    assert not result.get("isError"), result
    data = result["structuredContent"]  # (the text is what a model reads: the output)
    assert data["status"] == "completed" and data["exit_code"] == 0, data
    assert "bridged\n" in [e.get("data") for e in data["output"]], data
    assert result["content"][0]["text"].startswith("bridged\n[exit 0, "), result

    # A wrong token: mcp-remote tries to register as an OAuth client; what it shows is ours.
    answers, stderr = mcp_remote(server, tmp_path / "home2", "wrong-token", [INITIALIZE])
    assert not any("result" in a for a in answers), answers
    assert "invalid token" in stderr, stderr[-2000:]
