"""Hostile hosted MCP servers (tests/hosted_servers/) in real sandboxes behind a real server:
each is contained with a clear error, and the others keep answering."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hosted_harness import catalog_server, message_of, script_entry, text_of
from mcp_harness import ServerProcess, eventually, open_client

pytestmark = pytest.mark.e2e

ALICE, BOB = "hosted-alice-token-0123456789", "hosted-bob-token-0123456789"


CATALOG = {
    "snoop": script_entry("snoop.py", idle_timeout=2),
    "crash": script_entry("crash.py"),
    "flood": script_entry("flood.py", call_timeout=10),
    "silent": script_entry("silent.py", call_timeout=2),
    "mute": script_entry("silent.py", "--no-init", call_timeout=2),
    "giant": script_entry("giant.py", max_message_kb=1024),
    "echoenv": script_entry(
        "echoenv.py",
        env={"GREETING": "hello"},
        secrets={"API_KEY": "env:HOSTED_TEST_SECRET"},
        tools_deny=["env_deny_probe"],
    ),
    "aliceonly": script_entry("echoenv.py", principals=["alice"]),
    "shared": script_entry("snoop.py", scope="shared"),
    "persession": script_entry("snoop.py", scope="session"),
    "hog": script_entry("hog.py", memory_mb=64, pids=16),
    "broken": {"command": ["/bin/true"], "scope": "everyone"},  # left out; the others load
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    os.environ["HOSTED_TEST_SECRET"] = "the-entry-secret"
    with catalog_server(
        tmp_path_factory.mktemp("hosted"),
        CATALOG,
        f"alice:{ALICE},bob:{BOB}",
        HOSTED_TEST_SECRET="the-entry-secret",
        SANDBOX_POOL_SIZE="0",
    ) as server:
        yield server


async def still_answering(server: ServerProcess) -> None:
    """The other servers, and the server itself, answer promptly."""
    started = time.monotonic()
    async with open_client(f"{server.base_url}/servers/echoenv/mcp", ALICE) as conn:
        result = await conn.client.call_tool("echo", {"text": "still here"})
        assert result.structured_content == {"text": "still here"}, result
    assert httpx2.get(f"{server.base_url}/health", timeout=5).status_code == 200
    assert time.monotonic() - started < 5


async def test_snoop_sees_nothing_it_should_not(server: ServerProcess) -> None:
    url = f"{server.base_url}/servers/snoop/mcp"
    state = str(server.state_dir)
    args = {
        "paths": ["/etc/shadow", f"{state}/servers.toml", "/root/.bashrc"],
        "dirs": [state, "/opt/srt-server", "/run", "/home"],
        "host": "1.1.1.1",
        "port": 80,
        "write_paths": ["/opt/srt-server/x.txt", "/usr/x.txt"],
        "mark": "alice-was-here",
    }
    async with open_client(url, ALICE) as conn:
        report = json.loads(text_of(await conn.client.call_tool("snoop", args)))
    attempts = {a["what"]: a for a in report["attempts"]}
    assert report["uid"] != 0 and report["euid"] != 0, report
    assert report["cwd"] == "/workspace", report
    for what in (
        "read /etc/shadow",
        f"read {state}/servers.toml",
        "read /root/.bashrc",
        f"list {state}",
        "tcp 1.1.1.1:80",
        "write /opt/srt-server/x.txt",
        "write /usr/x.txt",
    ):
        assert not attempts[what]["ok"], attempts[what]
    for what in ("environ self", "read /proc/1/environ"):
        if attempts[what]["ok"]:
            detail = attempts[what]["detail"]
            assert not detail["token_in_values"], detail
            assert not any(n.startswith(("SANDBOX_", "REDIS")) for n in detail["names"]), detail
    # Bob's instance is his own: another workspace, another process.
    async with open_client(url, BOB) as conn:
        report = json.loads(text_of(await conn.client.call_tool("snoop", {"mark": "bob"})))
    readback = [a for a in report["attempts"] if a["what"].startswith("readback")]
    assert [a["detail"] for a in readback] == ["bob"], readback


async def test_state_is_per_principal_and_survives_a_restart(server: ServerProcess) -> None:
    url = f"{server.base_url}/servers/snoop/mcp"
    async with open_client(url, ALICE) as conn:
        await conn.client.call_tool("write_state", {"key": "note", "value": "alice's note"})
    async with open_client(url, BOB) as conn:
        result = await conn.client.call_tool("read_state", {"key": "note"})
        assert result.is_error, result  # not alice's
    # idle_timeout=2: the instance stops, and a new one finds the state where it was.
    async with open_client(server.url, ALICE) as conn:

        async def stopped() -> bool:
            listed = (await conn.client.call_tool("list_servers", {})).structured_content
            assert listed is not None
            return next(s for s in listed["servers"] if s["name"] == "snoop")["instances_here"] == 0

        deadline = time.monotonic() + 20
        while not await stopped():
            assert time.monotonic() < deadline, "the idle instances were not stopped"
            await asyncio.sleep(0.5)
    async with open_client(url, ALICE) as conn:
        result = await conn.client.call_tool("read_state", {"key": "note"})
        assert text_of(result) == "alice's note", result


async def test_a_crash_mid_call_is_reported_and_the_server_restarts(
    server: ServerProcess,
) -> None:
    url = f"{server.base_url}/servers/crash/mcp"
    async with open_client(url, ALICE) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("crash", {})
        assert "exited with code 3" in message_of(failed.value), failed.value
        await still_answering(server)
        # The next call waits out the backoff (1 s after a first crash) and starts it again.
        result = await conn.client.call_tool("ok", {})
        assert text_of(result) == "fine"
    log = (server.state_dir / "servers" / "logs" / "crash.log").read_text()
    assert "crashed" in log, log


@pytest.mark.parametrize("mode", ["junk", "bigline"])
async def test_a_server_flooding_stdout_is_ended(server: ServerProcess, mode: str) -> None:
    url = f"{server.base_url}/servers/flood/mcp"
    async with open_client(url, BOB) as conn:
        call = asyncio.ensure_future(conn.client.call_tool("flood", {"mode": mode}))
        await asyncio.sleep(0.3)
        await still_answering(server)
        with pytest.raises(Exception) as failed:
            await call
    expected = "not JSON-RPC" if mode == "junk" else "message over"
    assert expected in message_of(failed.value), failed.value


async def test_a_server_flooding_stderr_is_ended_and_its_log_bounded(
    server: ServerProcess,
) -> None:
    url = f"{server.base_url}/servers/flood/mcp"
    async with open_client(url, ALICE) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("stderr_flood", {})
    assert "stderr" in message_of(failed.value), failed.value
    logs = server.state_dir / "servers" / "logs"
    total = sum(p.stat().st_size for p in logs.glob("flood.log*"))
    assert total < 16 << 20, total


async def test_a_server_that_never_answers_is_ended_at_its_timeout(
    server: ServerProcess,
) -> None:
    async with open_client(f"{server.base_url}/servers/silent/mcp", ALICE) as conn:
        started = time.monotonic()
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("hang", {})
        assert "did not answer tools/call within 2 s" in message_of(failed.value), failed.value
        assert time.monotonic() - started < 10
    await still_answering(server)
    with pytest.raises(Exception) as failed:
        async with open_client(f"{server.base_url}/servers/mute/mcp", ALICE):
            pass
    text = message_of(failed.value)
    assert "could not start" in text and "initialize" in text, text


async def test_a_giant_result_is_refused_and_notifications_arrive(server: ServerProcess) -> None:
    url = f"{server.base_url}/servers/giant/mcp"
    async with open_client(url, ALICE) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("giant", {"mb": 64})
        assert "over 1024 KiB" in message_of(failed.value), failed.value
    await still_answering(server)
    seen: list[tuple[float, float | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, total))

    async with open_client(url, ALICE) as conn:
        result = await conn.client.call_tool("progress", {"steps": 3}, progress_callback=progress)
        assert not result.is_error, result
    assert len(seen) == 3, seen


async def test_only_the_entrys_environment_and_secrets_reach_it(server: ServerProcess) -> None:
    for mode in ("legacy", "auto"):
        async with open_client(f"{server.base_url}/servers/echoenv/mcp", ALICE, mode) as conn:
            env = json.loads(text_of(await conn.client.call_tool("env", {})))
            assert env["GREETING"] == "hello" and env["API_KEY"] == "the-entry-secret", env
            assert not [k for k in env if k.startswith(("SANDBOX", "HOSTED", "REDIS"))], env
            assert ALICE not in json.dumps(env) and BOB not in json.dumps(env)
            listed = await conn.client.list_tools()
            names = {t.name for t in listed.tools}
            assert {"env", "echo", "slow"} <= names, names
    log_text = server.stderr_text()
    assert "the-entry-secret" not in log_text and ALICE not in log_text


async def test_a_cancelled_call_is_cancelled_in_the_instance(server: ServerProcess) -> None:
    async with open_client(f"{server.base_url}/servers/echoenv/mcp", BOB) as conn:
        call = asyncio.ensure_future(conn.client.call_tool("slow", {"seconds": 30}))
        await asyncio.sleep(0.5)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        result = await conn.client.call_tool("echo", {"text": "after"})
        assert result.structured_content == {"text": "after"}
    log = server.state_dir / "servers" / "logs" / "echoenv.log"
    await eventually(lambda: "cancelled" in log.read_text(), 5, "the cancel reached it")


async def test_who_may_use_what(server: ServerProcess) -> None:
    async with open_client(f"{server.base_url}/servers/aliceonly/mcp", ALICE) as conn:
        assert (await conn.client.call_tool("echo", {"text": "a"})).structured_content
    with pytest.raises(Exception) as refused:
        async with open_client(f"{server.base_url}/servers/aliceonly/mcp", BOB):
            pass
    # To Bob it does not exist: the words for a server nobody has (a JSON-RPC error, which
    # every client shows), and never a hint that names it.
    assert "no hosted server 'aliceonly'" in message_of(refused.value), refused.value
    response = httpx2.post(
        f"{server.base_url}/servers/aliceonly/mcp",
        headers={"Authorization": f"Bearer {BOB}", "Accept": "application/json"},
        json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
    )
    assert response.status_code == 200, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("no hosted server 'aliceonly'"), message
    assert "did you mean 'aliceonly'" not in message, message
    response = httpx2.get(
        f"{server.base_url}/servers/aliceonly/mcp", headers={"Authorization": f"Bearer {BOB}"}
    )
    assert response.status_code == 404 and "no hosted server 'aliceonly'" in response.text
    response = httpx2.post(
        f"{server.base_url}/servers/echoenv/mcp",
        headers={"Authorization": "Bearer wrong-token", "Accept": "application/json"},
        json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
    )
    assert response.status_code == 401, response.text
    async with open_client(server.url, BOB) as conn:
        listed = (await conn.client.call_tool("list_servers", {})).structured_content
        assert listed is not None
        names = {s["name"] for s in listed["servers"]}
        assert "aliceonly" not in names and "echoenv" in names, names
        assert all(s["endpoint"] == f"/servers/{s['name']}/mcp" for s in listed["servers"])
        assert "the-entry-secret" not in json.dumps(listed)


async def test_session_scope_and_logging(server: ServerProcess) -> None:
    """A session-scoped server has an instance per session (/s/SESSION/servers/NAME/mcp); a
    server's logging reaches the caller; a broken catalog entry is left out, and said so."""
    marks = {}
    for session in ("one", "two"):
        url = f"{server.base_url}/s/{session}/servers/persession/mcp"
        async with open_client(url, ALICE) as conn:
            await conn.client.call_tool("write_state", {"key": "who", "value": session})
            marks[session] = text_of(await conn.client.call_tool("read_state", {"key": "who"}))
    assert marks == {"one": "one", "two": "two"}, marks
    logged: list[Any] = []

    async def on_log(params: Any) -> None:
        logged.append(params.data)

    url = f"{server.base_url}/servers/giant/mcp"
    async with open_client(url, BOB, logging_callback=on_log) as conn:
        result = await conn.client.call_tool("many", {"count": 3})
        assert "sent 3" in text_of(result), result
        await eventually(lambda: len(logged) == 3, 5, "the log messages")
    assert logged == ["message 0", "message 1", "message 2"], logged
    async with open_client(server.url, ALICE) as conn:
        listed = (await conn.client.call_tool("list_servers", {})).structured_content
    assert listed is not None
    assert "broken" not in {s["name"] for s in listed["servers"]}
    assert "servers.broken.scope" in (listed["catalog_problem"] or ""), listed


async def test_a_server_past_its_limits_is_ended_or_held(server: ServerProcess) -> None:
    """memory_mb=64: past it the kernel ends the instance and the call says so; pids=16: a
    fork bomb is held at the limit and the server answers."""
    url = f"{server.base_url}/servers/hog/mcp"
    async with open_client(url, ALICE) as conn:
        with pytest.raises(Exception) as failed:
            await conn.client.call_tool("hog", {"mb": 512})
        assert "memory limit" in message_of(failed.value), failed.value
        await still_answering(server)
        bombed = await conn.client.call_tool("forkbomb", {})
        assert not bombed.is_error, text_of(bombed)
        started = int(text_of(bombed).split()[1])
        assert 0 < started < 16, bombed
