"""Real third-party MCP servers from PyPI and npm, installed with `srt-mcp-server servers`
as an operator would, hosted in sandboxes and called through /servers/NAME/mcp with the
official client, in both protocol eras."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hosted_harness import text_of
from mcp.types import TextResourceContents
from mcp_harness import ServerProcess, open_client, server_env, stop_all, stop_if_running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # (its fixture installs five servers)

ALICE, BOB = "registry-alice-token-0123456789", "registry-bob-token-0123456789"
SECRET = "everything-secret-value-42"
CLI = [sys.executable, "-m", "sandbox_runtime.cli"]
# The versions tested (REFERENCE: offline once installed).
TIME = "pypi:mcp-server-time==2026.10.19"
GIT = "pypi:mcp-server-git==2026.10.19"
EVERYTHING = "npm:@modelcontextprotocol/server-everything@2026.8.31"
MEMORY = "npm:@modelcontextprotocol/server-memory@2026.8.31"
FILES = "npm:@modelcontextprotocol/server-filesystem@2026.8.31"
GIT_ENV = [
    f"--env={k}={v}"
    for k, v in {
        "GIT_AUTHOR_NAME": "agent",
        "GIT_AUTHOR_EMAIL": "agent@example.invalid",
        "GIT_COMMITTER_NAME": "agent",
        "GIT_COMMITTER_EMAIL": "agent@example.invalid",
    }.items()
]


def servers_cli(state_dir: Path, *args: str) -> str:
    env = server_env(state_dir, 0)
    result = subprocess.run(
        [*CLI, "servers", *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"servers {' '.join(args)}: {result.stdout}{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("registry")
    state = workdir / "state"
    state.mkdir()
    servers_cli(state, "add", "time", TIME)
    # git and a filesystem server on one state directory: a repository made with one, used
    # with the other.
    servers_cli(state, "add", "git", GIT, "--state=code", *GIT_ENV)
    servers_cli(state, "add", "repofiles", FILES, "--state=code", "/workspace")
    servers_cli(
        state,
        "add",
        "everything",
        EVERYTHING,
        "--env=EVERYTHING_MARK=visible",
        "--secret=EVERYTHING_TOKEN=env:REGISTRY_TEST_SECRET",
    )
    servers_cli(state, "add", "memory", MEMORY, "--env=MEMORY_FILE_PATH=/workspace/memory.jsonl")
    servers_cli(state, "add", "files", FILES, "/workspace")
    installed = servers_cli(state, "install")
    for name in ("time", "git", "repofiles", "everything", "memory", "files"):
        assert f"{name}: installed" in installed, installed
    listed = servers_cli(state, "list")
    assert "EVERYTHING_TOKEN" in listed and "REGISTRY_TEST_SECRET" not in listed, listed
    server = ServerProcess(
        workdir,
        {
            "SANDBOX_AUTH_TOKENS": f"alice:{ALICE},bob:{BOB}",
            "REGISTRY_TEST_SECRET": SECRET,
            "SANDBOX_POOL_SIZE": "0",
            "SANDBOX_INTERPRETER_WARM": "",
        },
    )
    try:
        server.start()
        yield server
    finally:
        stop_all(stop_if_running(server))


def url(server: ServerProcess, name: str) -> str:
    return f"{server.base_url}/servers/{name}/mcp"


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_time_from_pypi(server: ServerProcess, mode: str) -> None:
    async with open_client(url(server, "time"), ALICE, mode) as conn:
        tools = {t.name: t for t in (await conn.client.list_tools()).tools}
        assert {"get_current_time", "convert_time"} <= set(tools), tools
        assert tools["get_current_time"].output_schema is not None  # a tool with one
        result = await conn.client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not result.is_error, result
        assert result.structured_content is not None
        assert result.structured_content["timezone"] == "UTC", result.structured_content
        converted = await conn.client.call_tool(
            "convert_time",
            {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
        )
        assert converted.structured_content is not None
        assert "21:00:00+09:00" in json.dumps(converted.structured_content["target"])


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_everything_from_npm(server: ServerProcess, mode: str) -> None:
    async with open_client(url(server, "everything"), ALICE, mode) as conn:
        names = {t.name for t in (await conn.client.list_tools()).tools}
        assert {"echo", "get-sum", "get-env", "trigger-long-running-operation"} <= names
        echoed = await conn.client.call_tool("echo", {"message": "through the sandbox"})
        assert "through the sandbox" in text_of(echoed), echoed
        total = await conn.client.call_tool("get-sum", {"a": 2, "b": 40})
        assert "42" in text_of(total), total
        structured = await conn.client.call_tool("get-structured-content", {"location": "Chicago"})
        assert structured.structured_content is not None, structured
        # A resource read and a prompt, passed through.
        read = await conn.client.read_resource("demo://resource/static/document/architecture.md")
        assert isinstance(read.contents[0], TextResourceContents)
        assert "Architecture" in read.contents[0].text
        prompt = await conn.client.get_prompt("simple-prompt")
        assert prompt.messages, prompt
        # A tool that reports progress.
        seen: list[tuple[float, float | None]] = []

        async def progress(value: float, total: float | None, message: str | None) -> None:
            seen.append((value, total))

        done = await conn.client.call_tool(
            "trigger-long-running-operation",
            {"duration": 1, "steps": 3},
            progress_callback=progress,
        )
        assert "completed" in text_of(done), done
        assert [v for v, _ in seen] == [1.0, 2.0, 3.0], seen


async def test_everything_sees_only_its_own_environment(server: ServerProcess) -> None:
    async with open_client(url(server, "everything"), BOB) as conn:
        env = json.loads(text_of(await conn.client.call_tool("get-env", {})))
    assert env["EVERYTHING_MARK"] == "visible" and env["EVERYTHING_TOKEN"] == SECRET, env
    assert not [k for k in env if k.startswith(("SANDBOX", "REGISTRY", "REDIS"))], env
    assert ALICE not in json.dumps(env) and BOB not in json.dumps(env)
    assert SECRET not in server.stderr_text()


async def test_a_cancelled_call_ends_and_the_server_goes_on(server: ServerProcess) -> None:
    async with open_client(url(server, "everything"), BOB) as conn:
        call = asyncio.ensure_future(
            conn.client.call_tool("trigger-long-running-operation", {"duration": 30, "steps": 30})
        )
        await asyncio.sleep(1.0)
        call.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert time.monotonic() - started < 5
        echoed = await conn.client.call_tool("echo", {"message": "after the cancel"})
        assert "after the cancel" in text_of(echoed)


async def test_memory_graph_is_per_principal(server: ServerProcess) -> None:
    entity = {"name": "alice-project", "entityType": "project", "observations": ["secret plan"]}
    async with open_client(url(server, "memory"), ALICE) as conn:
        made = await conn.client.call_tool("create_entities", {"entities": [entity]})
        assert not made.is_error, made
        graph = await conn.client.call_tool("read_graph", {})
        assert "alice-project" in json.dumps(graph.structured_content), graph
    async with open_client(url(server, "memory"), BOB, "auto") as conn:
        graph = await conn.client.call_tool("read_graph", {})
        assert "alice-project" not in json.dumps(graph.structured_content), graph
        found = await conn.client.call_tool("search_nodes", {"query": "secret"})
        assert "alice-project" not in json.dumps(found.structured_content), found


async def test_filesystem_is_rooted_in_the_instance_state(server: ServerProcess) -> None:
    async with open_client(url(server, "files"), ALICE) as conn:
        allowed = await conn.client.call_tool("list_allowed_directories", {})
        assert "/workspace" in text_of(allowed), allowed
        wrote = await conn.client.call_tool(
            "write_file", {"path": "/workspace/notes.txt", "content": "kept in the sandbox"}
        )
        assert not wrote.is_error, wrote
        read = await conn.client.call_tool("read_text_file", {"path": "/workspace/notes.txt"})
        assert "kept in the sandbox" in text_of(read), read
        outside = await conn.client.call_tool("read_text_file", {"path": "/etc/passwd"})
        assert outside.is_error, outside  # the server's own rule, inside our sandbox anyway
    async with open_client(url(server, "files"), BOB) as conn:
        read = await conn.client.call_tool("read_text_file", {"path": "/workspace/notes.txt"})
        assert read.is_error, read  # alice's file is in alice's instance's state


async def test_git_on_a_repository_in_its_state(server: ServerProcess) -> None:
    repo = "/workspace/repo"
    async with open_client(url(server, "repofiles"), ALICE) as files:
        for directory in (f"{repo}/.git/objects", f"{repo}/.git/refs/heads"):
            made = await files.client.call_tool("create_directory", {"path": directory})
            assert not made.is_error, made
        for path, content in (
            (f"{repo}/.git/HEAD", "ref: refs/heads/main\n"),
            (f"{repo}/.git/config", "[core]\n\trepositoryformatversion = 0\n\tbare = false\n"),
            (f"{repo}/hello.txt", "hello from a hosted server\n"),
        ):
            wrote = await files.client.call_tool("write_file", {"path": path, "content": content})
            assert not wrote.is_error, wrote
    async with open_client(url(server, "git"), ALICE, "auto") as git:
        added = await git.client.call_tool("git_add", {"repo_path": repo, "files": ["hello.txt"]})
        assert not added.is_error, added
        committed = await git.client.call_tool(
            "git_commit", {"repo_path": repo, "message": "first, through the sandbox"}
        )
        assert not committed.is_error, committed
        log = await git.client.call_tool("git_log", {"repo_path": repo})
        assert "first, through the sandbox" in text_of(log), log
        status = await git.client.call_tool("git_status", {"repo_path": repo})
        assert "main" in text_of(status), status
    async with open_client(url(server, "git"), BOB) as git:
        status = await git.client.call_tool("git_status", {"repo_path": repo})
        assert status.is_error, status  # alice's repository is in alice's state


async def test_list_servers_and_status(server: ServerProcess) -> None:
    async with open_client(server.url, ALICE) as conn:
        listed = await conn.client.call_tool("list_servers", {})
    servers = {s["name"]: s for s in (listed.structured_content or {})["servers"]}
    assert set(servers) == {"time", "git", "repofiles", "everything", "memory", "files"}
    assert servers["time"]["installed"] == "2026.10.19" and servers["time"]["ready"]
    assert servers["everything"]["kind"] == "npm"
    assert SECRET not in json.dumps(servers)
    logs = await asyncio.to_thread(
        subprocess.run,
        [*CLI, "servers", "logs", "everything"],
        env=server_env(server.state_dir, 0),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert logs.returncode == 0 and "started for" in logs.stdout, logs
    assert SECRET not in logs.stdout


WORKFLOW = """
import json
from mcp_servers import everything, files, memory, time
files.write_file(path="/workspace/todo.txt", content="buy milk\\nfix the bike\\ncall mom\\n")
text = files.read_text_file(path="/workspace/todo.txt")
text = text["content"] if isinstance(text, dict) else text
items = [line for line in text.splitlines() if line.strip()]
memory.create_entities(entities=[
    {"name": item, "entityType": "todo", "observations": ["from todo.txt"]} for item in items
])
graph = memory.read_graph()
total = everything["get-sum"](a=len(items), b=len(graph["entities"]))
now = time.get_current_time(timezone="UTC")
print(json.dumps({"items": len(items), "remembered": len(graph["entities"]),
                  "sum": total, "timezone": now["timezone"]}))
"""


async def test_code_mode_over_the_registry_servers(server: ServerProcess) -> None:
    """The README's worked example: read with one server, transform in Python, write with
    another, and return a short summary; each call a tool_call event."""
    async with open_client(server.url, BOB) as conn:
        result = await conn.ok(
            "execute_code", command=["python3", "-c", WORKFLOW], servers=["*"], timeout_seconds=120
        )
    out = "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")
    assert result["exit_code"] == 0, result
    summary = json.loads(out)
    assert summary["items"] == 3 and summary["remembered"] == 3, summary  # bob's own graph
    assert "6" in str(summary["sum"]), summary
    assert summary["timezone"] == "UTC"
    calls = [e for e in result["output"] if e["type"] == "tool_call"]
    assert [c["name"] for c in calls] == [
        "files.write_file",
        "files.read_text_file",
        "memory.create_entities",
        "memory.read_graph",
        "everything.get-sum",
        "time.get_current_time",
    ], calls
    assert all(c["reason"] == "ok" for c in calls), calls


async def test_run_code_over_the_registry_servers(server: ServerProcess) -> None:
    """In an interpreter: a progress-emitting tool, a tool error, calls at once, and results
    kept in its variables for the next call."""
    code = """
import asyncio, mcp_servers
from mcp_servers import everything, time
done = everything["trigger-long-running-operation"](duration=1, steps=2)
sums = await asyncio.gather(*(everything["get-sum"].aio(a=i, b=i) for i in range(8)))
try:
    time.convert_time(source_timezone="Nowhere/Atlantis", time="12:00", target_timezone="UTC")
    failed = None
except mcp_servers.ToolError as exc:
    failed = str(exc)
print(done[:40], len(sums), bool(failed))
"""
    async with open_client(server.url, ALICE) as conn:
        first = await conn.ok("run_code", code=code, servers=["everything", "time"])
        out = "".join(e.get("data", "") for e in first["output"] if e["type"] == "stdout")
        assert "Long running operation completed" in out and out.strip().endswith("8 True"), first
        calls = [e for e in first["output"] if e["type"] == "tool_call"]
        assert len(calls) == 10 and calls[-1]["reason"] == "error", calls
        later = await conn.ok("run_code", code="print(sums[3])")
        assert "6" in "".join(e.get("data", "") for e in later["output"]), later


async def test_typescript_and_a_loop_over_the_registry_servers(server: ServerProcess) -> None:
    """TypeScript (Deno, run_code) calls memory and time; Python makes 100 calls in a loop."""
    ts = (
        'import { memory, time } from "mcp_servers";\n'
        "await memory.create_entities({ entities: [\n"
        '  { name: "ts-note", entityType: "note", observations: ["from TypeScript"] }] });\n'
        "const graph: { entities: { name: string }[] } = await memory.read_graph();\n"
        'const now: { timezone: string } = await time.get_current_time({ timezone: "UTC" });\n'
        "console.log(graph.entities.some((e) => e.name === 'ts-note'), now.timezone);"
    )
    loop = (
        "from mcp_servers import everything\n"
        "echoed = [everything.echo(message=str(i)) for i in range(100)]\n"
        "print(len(echoed), echoed[-1])"
    )
    async with open_client(server.url, ALICE) as conn:
        typed = await conn.ok(
            "run_code", code=ts, language="typescript", servers=["memory", "time"]
        )
        out = "".join(e.get("data", "") for e in typed["output"] if e["type"] == "stdout")
        assert out.strip() == "true UTC", typed
        looped = await conn.ok("run_code", code=loop, servers=["everything"], timeout_seconds=60)
        out = "".join(e.get("data", "") for e in looped["output"] if e["type"] == "stdout")
        assert out.startswith("100 Echo: 99"), looped
        assert len([e for e in looped["output"] if e["type"] == "tool_call"]) == 100
