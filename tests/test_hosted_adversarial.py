"""Adversarial review of hosted MCP servers: a hostile server process, a hostile principal, a
careless operator. Each test names the hole it shows; those that fail are holes found open."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hosted_harness import message_of, text_of, toml
from mcp_harness import ServerProcess, open_client, stop_all, stop_if_running, traversable_by_others

pytestmark = pytest.mark.e2e

ALICE, BOB = "adv-alice-token-0123456789", "adv-bob-token-0123456789"
SECRET = "adv-operator-secret-5f1c2a"
MINI = Path(__file__).resolve().parent / "hosted_servers" / "_mini.py"

# The hostile server: one tool per trick (see each test).
ADV = r"""
import json, os, sys, time
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mini import RpcError, Server, ok_tool, tool

ARGS = sys.argv[1:]


def badid(args, ctx):
    # A response whose id is a list: not hashable.
    ctx.write_raw((json.dumps({"jsonrpc": "2.0", "id": [ctx.id], "result": {}}) + "\n").encode())
    time.sleep(0.3)
    return "after badid"


def badprogress(args, ctx):
    ctx.notify("notifications/progress", {"progressToken": {"a": 1}, "progress": 1})
    time.sleep(0.3)
    return "after badprogress"


def deep(args, ctx):
    n = int(args.get("n", 100000))
    ctx.write_raw(
        b'{"jsonrpc":"2.0","id":' + json.dumps(ctx.id).encode()
        + b',"result":{"content":[],"structuredContent":{"x":' + b"[" * n + b"]" * n + b"}}}\n"
    )
    return None


def say_err(args, ctx):
    sys.stderr.write(str(args.get("text", "")) + "\n")
    sys.stderr.flush()
    return "said"


def crash(args, ctx):
    sys.stderr.write(str(args.get("text", "")) + "\n")
    sys.stderr.flush()
    os._exit(3)


def leak_secret_and_crash(args, ctx):
    # What many real servers do: print their configuration at a failure.
    sys.stderr.write("config: API_KEY=%s\n" % os.environ.get("API_KEY"))
    sys.stderr.flush()
    os._exit(1)


def slow(args, ctx):
    time.sleep(float(args.get("seconds", 5)))
    return "slept"


ME = os.urandom(8).hex()


def pid(args, ctx):
    return ME  # (every sandbox's pid is 2: this names the process instead)


def init_error(params, ctx):
    try:
        with open("/workspace/secret.txt") as f:
            raise RpcError(-32000, "cannot load config: " + f.read())
    except OSError:
        pass
    return None


def plant(args, ctx):
    with open("/workspace/secret.txt", "w") as f:
        f.write(str(args.get("text", "")))
    os._exit(0)


def logflood(args, ctx):
    blob = "x" * int(args.get("size", 10000))
    for _ in range(int(args.get("n", 1000))):
        ctx.notify("notifications/message", {"level": "info", "data": blob})
    return "flooded"


TOOLS = {
    name: tool(fn)
    for name, fn in dict(
        badid=badid, badprogress=badprogress, deep=deep, say_err=say_err, crash=crash,
        leak_secret_and_crash=leak_secret_and_crash, slow=slow, pid=pid, plant=plant,
        logflood=logflood,
    ).items()
}
TOOLS["ok"] = ok_tool()

if __name__ == "__main__":
    if "--slow-init" in ARGS:
        time.sleep(float(ARGS[ARGS.index("--slow-init") + 1]))
    server = Server("adv", TOOLS, exit_on_eof="--ignore-eof" not in ARGS)
    server.methods["initialize"] = lambda p, c: init_error(p, c) or server.initialize(p, c)
    server.run()
"""


def scripts_dir(root: Path) -> Path:
    directory = root / "scripts"
    directory.mkdir()
    shutil.copy(MINI, directory / "_mini.py")
    (directory / "adv.py").write_text(ADV)
    for p in directory.iterdir():
        p.chmod(0o644)
    directory.chmod(0o755)
    traversable_by_others(directory)
    return directory


def processes_with(mark: str) -> list[int]:
    """Live processes whose command line holds `mark` (the instances of one test server)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in cmdline and b"adv.py" in cmdline and state != "Z":
            found.append(int(pid))
    return found


def _is_python(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe").split("/")[-1].startswith("python")
    except OSError:
        return False


def make_server(root: Path, catalog: dict[str, dict[str, Any]], **settings: str) -> ServerProcess:
    path = root / "servers.toml"
    path.write_text(toml(catalog))
    tokens = ",".join(
        [f"alice:{ALICE}", f"bob:{BOB}"] + [f"p{i}:adv-p{i}-token-0123456789" for i in range(6)]
    )
    server = ServerProcess(
        root,
        {
            "SANDBOX_AUTH_TOKENS": tokens,
            "SANDBOX_SERVERS_FILE": str(path),
            "ADV_REVIEW_SECRET": SECRET,
            "SANDBOX_POOL_SIZE": "0",
            "SANDBOX_INTERPRETER_WARM": "",
            **settings,
        },
    )
    return server.start()


MARK = f"mark-{uuid.uuid4().hex[:8]}"


def adv(*args: str, mark: str = MARK, **fields: Any) -> dict[str, Any]:
    return {
        "command": ["/usr/bin/python3", "/opt/srt-server/adv.py", mark, *args],
        **fields,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("adv")
    directory = str(scripts_dir(root))
    catalog = {
        "adv": adv(call_timeout=20, directory=directory),
        "advinit": adv(call_timeout=20, directory=directory),
        "advshared": adv(call_timeout=20, scope="shared", directory=directory),
        "advsession": adv(call_timeout=20, scope="session", directory=directory),
        "advsecret": adv(
            call_timeout=20, secrets={"API_KEY": "env:ADV_REVIEW_SECRET"}, directory=directory
        ),
        "advslowinit": adv(
            "--slow-init", "3", "--ignore-eof", call_timeout=20, directory=directory
        ),
    }
    server = make_server(root, catalog)
    try:
        yield server
    finally:
        stop_all(stop_if_running(server))


def url(server: ServerProcess, name: str) -> str:
    return f"{server.base_url}/servers/{name}/mcp"


# -- a hostile server process -------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["badid", "badprogress", "deep"])
async def test_one_malformed_message_does_not_hang_calls_until_the_timeout(
    server: ServerProcess, tool: str
) -> None:
    """HOLE: Instance._on_line/_on_notification (servers/instance.py:285, :299) look up a
    server-chosen id/progressToken in a dict (a list or object id: TypeError, unhashable), and
    json.loads of a deeply nested line raises RecursionError (not ValueError, :268-271). Either
    escapes _read_stdout: the reader task dies, the instance stays "alive", and every call on it
    (every principal's, for a shared one) hangs until call_timeout instead of failing at once.
    """
    async with open_client(url(server, "adv"), ALICE) as conn:
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 (ended, or answered: either is fine)
            result = await conn.client.call_tool(tool, {})
            if tool != "deep":  # the junk message ignored and the real answer arrives
                assert text_of(result) == f"after {tool}"
                raise RuntimeError("answered")
        elapsed = time.monotonic() - started
    assert elapsed < 8, f"{tool}: the call hung {elapsed:.1f} s (call_timeout is 20 s)"


# -- what one principal learns of another -------------------------------------------------------


async def test_a_shared_instance_error_carries_no_other_principals_stderr(
    server: ServerProcess,
) -> None:
    """HOLE: Instance._end (servers/instance.py:364-368) puts the instance's stderr tail in the
    error every waiting caller gets. With scope "shared", Bob's failed call shows what the
    instance wrote to stderr while serving Alice (her data, its secrets)."""
    async with open_client(url(server, "advshared"), ALICE) as conn:
        await conn.client.call_tool("say_err", {"text": "alice-private-data-77"})
    async with open_client(url(server, "advshared"), BOB) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("crash", {"text": "bob crashes it"})
    text = message_of(failed.value)
    assert "exited with code 3" in text, text
    assert "alice-private-data-77" not in text, text


async def test_an_instance_error_carries_no_secret_value(server: ServerProcess) -> None:
    """HOLE: the stderr tail in InstanceError (servers/instance.py:364-368) reaches the
    principal: a server that prints its configuration when it fails hands the operator's
    secret (catalog `secrets`, promised never to be shown) to whoever called it."""
    async with open_client(url(server, "advsecret"), ALICE) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("leak_secret_and_crash", {})
    text = message_of(failed.value)
    assert "exited with code 1" in text, text
    assert SECRET not in text, text


async def test_list_servers_shows_no_other_principals_start_failure(
    server: ServerProcess,
) -> None:
    """HOLE: a start that fails with the server's JSON-RPC error keeps the server's own words
    (ServerHost._start, servers/host.py:257-259) as the entry's last_error, which
    list_servers shows to every principal (server/server_tools.py, `problem`). What Alice's
    instance says about Alice's state reaches Bob."""
    async with open_client(url(server, "advinit"), ALICE) as conn:
        with pytest.raises(Exception):  # noqa: B017
            await conn.client.call_tool("plant", {"text": "alice-state-31337"})
    with pytest.raises(Exception):  # noqa: B017 (her next start fails: that is her business)
        async with open_client(url(server, "advinit"), ALICE):
            pass
    async with open_client(server.url, BOB) as conn:
        listed = (await conn.client.call_tool("list_servers", {})).structured_content
    assert "alice-state-31337" not in json.dumps(listed), listed


async def test_session_scope_gives_each_session_its_own_instance(server: ServerProcess) -> None:
    """Scope "session": the session is the one the path names (/s/SESSION/servers/NAME/mcp,
    as for /s/SESSION/mcp; both protocol eras, and nginx routes on it); each has its own
    instance. Without one in the path, calls are in the session "default"."""
    pids = []
    for session in ("one", "two"):
        path = f"{server.base_url}/s/{session}/servers/advsession/mcp"
        async with open_client(path, ALICE) as conn:
            pids.append(text_of(await conn.client.call_tool("pid", {})))
    assert pids[0] != pids[1], "two sessions got the same instance of a session-scoped server"
    async with open_client(url(server, "advsession"), ALICE) as one:
        async with open_client(url(server, "advsession"), ALICE, "auto") as two:
            first = text_of(await one.client.call_tool("pid", {}))
            second = text_of(await two.client.call_tool("pid", {}))
    assert first == second  # both in "default"


# -- the replica's bounds ----------------------------------------------------------------------


async def test_concurrent_starts_respect_max_server_instances(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """HOLE: ServerHost._make_room (servers/host.py:372-382) checks the count before a start,
    but the new instance is counted only after initialize (host.py:267); each key has its own
    lock (host.py:215). Principals starting at once all pass the check:
    SANDBOX_MAX_SERVER_INSTANCES is not a bound."""
    root = tmp_path_factory.mktemp("advcap")
    directory = str(scripts_dir(root))
    mark = f"cap-{uuid.uuid4().hex[:8]}"
    server = make_server(
        root,
        {"cap": adv("--slow-init", "1", mark=mark, call_timeout=20, directory=directory)},
        SANDBOX_MAX_SERVER_INSTANCES="2",
    )
    try:

        async def one(i: int) -> str:
            async with open_client(url(server, "cap"), f"adv-p{i}-token-0123456789") as conn:
                return text_of(await conn.client.call_tool("pid", {}))

        seen: list[int] = []

        async def count() -> None:
            while True:
                seen.append(len([p for p in processes_with(mark) if _is_python(p)]))
                await asyncio.sleep(0.1)

        counting = asyncio.ensure_future(count())
        try:
            answers = await asyncio.gather(*(one(i) for i in range(6)), return_exceptions=True)
        finally:
            counting.cancel()
        assert max(seen) <= 2, f"{max(seen)} instances ran at once (cap 2); answers {answers}"
    finally:
        stop_all(stop_if_running(server))


async def raw_session(http: Any, target: str, token: str) -> dict[str, str]:
    """A legacy MCP session opened by hand: the headers its later requests carry."""
    headers = {
        "Authorization": f"Bearer {token}",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "adv", "version": "1"},
        },
    }
    response = await http.post(target, json=init, headers=headers)
    assert response.status_code == 200, response.text
    headers["Mcp-Session-Id"] = response.headers["mcp-session-id"]
    headers["Mcp-Protocol-Version"] = "2025-11-25"
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    await http.post(target, json=note, headers=headers)
    return headers


async def test_a_start_cancelled_by_the_client_leaves_no_process(server: ServerProcess) -> None:
    """HOLE: a call cancelled (notifications/cancelled) while its instance starts: _start's
    cleanup (servers/host.py:254-256, Instance.aclose at servers/instance.py:373-388) runs
    inside the request's cancelled anyio scope, so its first await raises again and
    terminate() is never reached. A server that does not exit at EOF on stdin keeps running,
    untracked (not in _instances: outside SANDBOX_MAX_SERVER_INSTANCES, never stopped)."""
    import httpx2

    before = set(processes_with(MARK))
    target = url(server, "advslowinit")
    async with httpx2.AsyncClient(timeout=30) as http:
        headers = await raw_session(http, target, BOB)
        call = {
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {"name": "pid", "arguments": {}},
        }
        pending = asyncio.ensure_future(http.post(target, json=call, headers=headers))
        await asyncio.sleep(1.5)  # (the instance sleeps 3 s before it reads initialize)
        cancel = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": 7, "reason": "changed my mind"},
        }
        await http.post(target, json=cancel, headers=headers)
        with __import__("contextlib").suppress(Exception):
            await asyncio.wait_for(pending, 10)
    await asyncio.sleep(6)
    stray = set(processes_with(MARK)) - before
    assert not stray, f"processes left running after the cancelled start: {stray}"
