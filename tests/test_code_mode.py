"""Code mode: code in a sandbox calls hosted servers through its bridge (servers=[...] on
execute_code), checked by the host against what the principal may call, each call a
`tool_call` event; hostile code on the socket gets nowhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hosted_harness import catalog_server, script_entry
from mcp_harness import ServerProcess, open_client

pytestmark = pytest.mark.e2e

ALICE, BOB = "codemode-alice-token-0123456", "codemode-bob-token-0123456"


CATALOG = {
    "echoenv": script_entry("echoenv.py", tools_deny=["env"]),
    "snoop": script_entry("snoop.py"),
    "aliceonly": script_entry("echoenv.py", principals=["alice"]),
    "crash": script_entry("crash.py"),
    "giant": script_entry("giant.py"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with catalog_server(
        tmp_path_factory.mktemp("codemode"), CATALOG, f"alice:{ALICE},bob:{BOB}"
    ) as server:
        yield server


async def run(
    server: ServerProcess, code: str, servers: list[str] | None, token: str = ALICE, **extra: Any
) -> dict[str, Any]:
    arguments: dict[str, Any] = {"command": ["python3", "-c", code], **extra}
    if servers is not None:
        arguments["servers"] = servers
    async with open_client(server.url, token) as conn:
        result = await conn.call("execute_code", **arguments)
    assert result.structured_content is not None, result
    return dict(result.structured_content)


def stdout(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


def tool_calls(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in result["output"] if e["type"] == "tool_call"]


async def test_code_calls_a_hosted_server(server: ServerProcess) -> None:
    code = """
import json, mcp_servers
from mcp_servers import echoenv
print(json.dumps(echoenv.echo(text="from code")))
print(json.dumps([s["name"] for s in mcp_servers.servers()]))
print(json.dumps(sorted(t["name"] for t in echoenv.tools())))
"""
    result = await run(server, code, ["echoenv"])
    assert result["exit_code"] == 0, result
    lines = stdout(result).splitlines()
    assert json.loads(lines[0]) == {"text": "from code"}
    assert json.loads(lines[1]) == ["echoenv"]  # narrowed to what the call named
    assert json.loads(lines[2]) == ["echo", "ok", "slow"]  # "env" is denied: not listed
    (call,) = tool_calls(result)
    assert call["name"] == "echoenv.echo" and call["reason"] == "ok", call
    assert "from code" in call["message"]


async def test_a_loop_of_calls_and_calls_at_once(server: ServerProcess) -> None:
    code = """
import json, concurrent.futures
from mcp_servers import echoenv
texts = [echoenv.echo(text=str(i))["text"] for i in range(100)]
with concurrent.futures.ThreadPoolExecutor(6) as pool:
    together = list(pool.map(lambda i: echoenv.echo(text=f"t{i}")["text"], range(12)))
print(json.dumps([len(texts), texts[-1], sorted(together)[:2]]))
"""
    result = await run(server, code, ["*"])
    assert result["exit_code"] == 0, result
    assert json.loads(stdout(result)) == [100, "99", ["t0", "t1"]]
    assert len(tool_calls(result)) == 112


async def test_what_code_may_not_call_is_refused_inside_it(server: ServerProcess) -> None:
    code = """
import json, mcp_servers
out = {}
def attempt(key, fn):
    try:
        fn()
        out[key] = "called"
    except mcp_servers.BridgeError as exc:
        out[key] = [exc.kind, str(exc)]
attempt("denied tool", lambda: mcp_servers.server("echoenv").env())
attempt("not named", lambda: mcp_servers.server("snoop").ok())
attempt("not allowed", lambda: mcp_servers.server("aliceonly").ok())
attempt("forged", lambda: mcp_servers._ask(
    {"op": "call", "server": "aliceonly", "tool": "ok", "arguments": {}, "principal": "alice"}))
print(json.dumps(out))
"""
    # bob names a server only alice may use (an attempt to widen): it is not there.
    result = await run(server, code, ["echoenv", "aliceonly"], token=BOB)
    out = json.loads(stdout(result))
    assert out["denied tool"][0] == "not_allowed" and "env" in out["denied tool"][1], out
    for key in ("not named", "not allowed", "forged"):
        assert out[key][0] == "not_allowed", out
    assert out["not allowed"][1] == "no server 'aliceonly' (this code may call: echoenv)", out
    assert 'call execute_code again with servers=["echoenv", "snoop"]' in out["not named"][1], out
    assert {c["reason"] for c in tool_calls(result)} == {"refused"}
    # Nothing reached aliceonly: no instance of it was started for bob (or anyone).
    async with open_client(server.url, ALICE) as conn:
        listed = (await conn.client.call_tool("list_servers", {})).structured_content
    assert listed is not None
    status = {s["name"]: s for s in listed["servers"]}
    assert status["aliceonly"]["instances_here"] == 0, status


async def test_without_servers_there_is_no_bridge(server: ServerProcess) -> None:
    code = """
import os
try:
    import mcp_servers
    mcp_servers.servers()
    print("bridged")
except Exception as exc:
    print(type(exc).__name__, os.path.exists("/run/srt-bridge/bridge.sock"))
"""
    result = await run(server, code, None)
    assert stdout(result).strip() in ("ModuleNotFoundError False", "BridgeError False"), result


async def test_tool_errors_and_crashes_raise_in_the_code(server: ServerProcess) -> None:
    code = """
import json, mcp_servers
from mcp_servers import crash
try:
    crash.crash()
except mcp_servers.BridgeError as exc:
    print(json.dumps([exc.kind, str(exc)]))
"""
    result = await run(server, code, ["crash"])
    kind, message = json.loads(stdout(result))
    assert kind == "failed" and "exited with code 3" in message, message


async def test_hostile_frames_leave_the_host_well(server: ServerProcess) -> None:
    code = r"""
import socket, struct, json, threading
path = "/run/srt-bridge/bridge.sock"
results = []
def frame(payload):
    s = socket.socket(socket.AF_UNIX); s.settimeout(15); s.connect(path)
    s.sendall(payload)
    try:
        head = s.recv(4)
        if len(head) == 4:
            (n,) = struct.unpack(">I", head)
            body = b""
            while len(body) < n:
                chunk = s.recv(n - len(body))
                if not chunk: break
                body += chunk
            results.append(json.loads(body).get("error", {}).get("kind"))
        else:
            results.append("closed")
    finally:
        s.close()
frame(struct.pack(">I", 11) + b"not json!!!")
frame(struct.pack(">I", 1 << 30) + b"x" * 1000)           # a frame it says is 1 GiB
frame(b"\x00\x00")                                          # half a header, then gone
frame(struct.pack(">I", 9) + b'{"op":1}}')
frame(struct.pack(">I", 20) + b'{"op":"call","server')     # less than it said
threads = [threading.Thread(target=frame, args=(struct.pack(">I", 2) + b"[]",)) for _ in range(50)]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps(results[:5]), len(results))
"""
    result = await run(server, code, ["echoenv"], timeout_seconds=60)
    assert result["exit_code"] == 0, result
    first, count = stdout(result).rsplit(" ", 1)
    assert json.loads(first)[:2] == ["protocol", "protocol"], first
    assert int(count) == 55, count
    assert httpx2.get(f"{server.base_url}/health", timeout=5).status_code == 200
    again = await run(server, "from mcp_servers import echoenv; print(echoenv.ok())", ["echoenv"])
    assert stdout(again).strip() == "fine", again


async def test_cancelling_the_execution_ends_its_calls(server: ServerProcess) -> None:
    async with open_client(server.url, ALICE) as conn:
        started = await conn.ok(
            "execute_code_async",
            command=["python3", "-c", "from mcp_servers import echoenv; echoenv.slow(seconds=60)"],
            servers=["echoenv"],
        )
        execution_id = started["execution_id"]
        await asyncio.sleep(1.5)
        cancelled = await conn.ok("cancel_execution", execution_id=execution_id)
        assert cancelled["success"], cancelled
        status = await conn.ok("get_execution_status", execution_id=execution_id)
        assert status["status"] == "cancelled", status
        after = await conn.call(
            "execute_code",
            command=["python3", "-c", "from mcp_servers import echoenv; print(echoenv.ok())"],
            servers=["echoenv"],
        )
        assert "fine" in json.dumps(after.structured_content), after


async def test_search_tools_finds_what_the_principal_may_call(server: ServerProcess) -> None:
    async with open_client(server.url, BOB) as conn:
        found = await conn.ok("search_tools", query="echo text", detail="full")
        names = {(t["server"], t["tool"]) for t in found["tools"]}
        assert ("echoenv", "echo") in names, found
        assert all(s != "aliceonly" for s, _ in names), found  # not bob's to call
        echo = next(t for t in found["tools"] if (t["server"], t["tool"]) == ("echoenv", "echo"))
        assert echo["input_schema"]["properties"]["text"]["type"] == "string", echo
        brief = await conn.ok("search_tools", query="", detail="names", server="echoenv")
        assert {t["tool"] for t in brief["tools"]} == {"echo", "ok", "slow"}, brief
        assert all("summary" not in t or t["summary"] is None for t in brief["tools"])
    # The code finds the same, and the stub files are there for it to read.
    code = """
import json, os, mcp_servers
found = mcp_servers.search("echo text", detail="names")
print(json.dumps([found, sorted(os.listdir("/run/srt-bridge/servers/echoenv"))]))
"""
    result = await run(server, code, ["echoenv"], token=BOB)
    found, files = json.loads(stdout(result))
    assert {"server": "echoenv", "tool": "echo"} in found, found
    assert "echo.py" in files and "__index__.py" in files and "env.py" not in files, files


async def test_run_code_calls_servers_and_keeps_what_it_got(server: ServerProcess) -> None:
    """In an interpreter a call returns its result as in a script; results stay in its
    variables for later calls, which need no tool call to use them."""
    async with open_client(server.url, ALICE) as conn:
        first = await conn.ok(
            "run_code",
            code="from mcp_servers import echoenv\ngot = echoenv.echo(text='kept')\nprint(got)",
            servers=["echoenv"],
        )
        assert "{'text': 'kept'}" in stdout(first), first
        assert [c["name"] for c in tool_calls(first)] == ["echoenv.echo"], first
        later = await conn.ok("run_code", code="print(got['text'].upper())")
        assert stdout(later).strip() == "KEPT" and not tool_calls(later), later
        refused = await conn.ok(  # this call names no servers: its bridge is gone
            "run_code",
            code="import mcp_servers\ntry:\n    echoenv.echo(text='x')\n"
            "except mcp_servers.BridgeError as exc:\n    print(exc.kind, exc)",
        )
        kind, message = stdout(refused).strip().split(" ", 1)
        assert kind == "unavailable", refused
        assert message.endswith('call run_code again with servers=["echoenv"])'), message


async def test_a_large_result_is_also_kept_as_a_workspace_file(server: ServerProcess) -> None:
    code = """
import json, glob
from mcp_servers import giant
text = giant.giant(mb=0.25)
kept = glob.glob("/workspace/.mcp_results/giant.giant.*.json")
print(json.dumps([len(text), len(json.load(open(kept[0]))["content"][0]["text"])]))
"""
    result = await run(server, code, ["giant"])
    got, kept = json.loads(stdout(result))
    assert got == kept == 256 * 1024, (got, kept)
    (call,) = tool_calls(result)
    assert "kept in /workspace/.mcp_results/giant.giant." in call["message"], call


JS = """
import { echoenv, search, server, BridgeError } from "mcp_servers";
const got = await echoenv.echo({ text: "from js" });
let refused = null;
try { await echoenv.env({}); } catch (err) { refused = [err.name, err.kind]; }
const found = await search("echo text", "names");
const ok = await server("echoenv").ok();
console.log(JSON.stringify({ got, refused, found: found.length > 0, ok }));
"""


async def test_javascript_calls_servers(server: ServerProcess) -> None:
    async with open_client(server.url, ALICE) as conn:
        result = await conn.ok(
            "execute_code", command=["node", "--input-type=module", "-e", JS], servers=["echoenv"]
        )
    assert result["exit_code"] == 0, result
    assert json.loads(stdout(result)) == {
        "got": {"text": "from js"},
        "refused": ["BridgeError", "not_allowed"],
        "found": True,
        "ok": "fine",
    }, result


async def test_typescript_in_run_code_calls_servers(server: ServerProcess) -> None:
    code = (
        'import { echoenv } from "/node_modules/mcp_servers/index.mjs";  // (Deno)\n'
        'const got: { text: string } = await echoenv.echo({ text: "from ts" });\n'
        "console.log(got.text);"
    )
    async with open_client(server.url, ALICE) as conn:
        result = await conn.ok("run_code", code=code, language="typescript", servers=["echoenv"])
    assert stdout(result).strip() == "from ts", result
    assert [c["name"] for c in tool_calls(result)] == ["echoenv.echo"], result


async def test_code_cannot_reach_another_sandboxs_bridge(server: ServerProcess) -> None:
    """Each sandbox sees only its own bridge directory: another execution's socket (and the
    host's directory of them) is not there to connect to."""
    async with open_client(server.url, ALICE) as conn:
        holder = await conn.ok(
            "execute_code_async",
            command=["python3", "-c", "import time; time.sleep(30)"],
            servers=["echoenv"],
        )
        bridges = server.state_dir / "bridges"
        others = [str(p / "bridge.sock") for p in bridges.iterdir()]
        assert others, "the holding execution's bridge is on the host"
        code = f"""
import json, os, socket
seen = {{}}
for path in {others!r} + ["{bridges}"]:
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        seen[path] = "connected"
    except OSError as exc:
        seen[path] = type(exc).__name__
print(json.dumps([seen, sorted(os.listdir("/run/srt-bridge"))]))
"""
        result = await run(server, code, ["echoenv"], token=BOB)
        seen, listing = json.loads(stdout(result))
        assert "connected" not in seen.values(), seen
        assert listing == ["bridge.sock", "node_modules", "python", "servers"] or listing == [
            "bridge.sock",
            "node_modules",
            "python",
        ], listing
        await conn.ok("cancel_execution", execution_id=holder["execution_id"])


async def test_a_stub_says_what_a_tool_without_an_output_schema_returned(
    server: ServerProcess,
) -> None:
    stub_of_ok = "print(open('/run/srt-bridge/servers/echoenv/ok.py').read())"
    first = await run(
        server, f"from mcp_servers import echoenv\nechoenv.ok()\n{stub_of_ok}", ["echoenv"]
    )
    assert "def ok() -> str:  # returns: seen: one text block" in stdout(first), first
    later = await run(server, stub_of_ok, ["echoenv"])  # a new bridge: known from the start
    assert "def ok() -> str:  # returns: seen: one text block" in stdout(later), later
    others = await run(server, stub_of_ok, ["echoenv"], token=BOB)  # not bob's to know
    assert "def ok() -> object:  # returns: not seen yet" in stdout(others), others
    echo = await run(server, "print(open('/run/srt-bridge/servers/echoenv/echo.py').read())",
                     ["echoenv"])  # fmt: skip
    assert "-> dict:" in stdout(echo) and "# output schema:" in stdout(echo), echo
    compiled = await run(
        server,
        "import glob\nfiles = glob.glob('/run/srt-bridge/servers/*/*.py')\n"
        "[compile(open(f).read(), f, 'exec') for f in files]\nprint(len(files))",
        ["*"],
    )
    assert compiled["exit_code"] == 0 and int(stdout(compiled)) >= 4, compiled  # valid Python
