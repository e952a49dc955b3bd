"""The audit log (SANDBOX_AUDIT_LOG): a real server called by two principals over the official
MCP client, file URLs used over plain HTTP, calls that fail; one line per call with the right
fields and no secret or content anywhere; a flood against a log that cannot keep up stays
bounded; rotation; `srt-mcp-server audit` reading and filtering the rotated files."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp.shared.exceptions import MCPError
from mcp_harness import (
    ServerProcess,
    Servers,
    eventually,
    memory_of,
    open_client,
    run_server_once,
)

pytestmark = pytest.mark.e2e

ALICE = "audit-alice-token-0123456789"
BOB = "audit-bob-token-9876543210"
MARKER = "AUDIT-MARKER-7f3c9e"  # in code, file contents and arguments: never in the log


def lines_of(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def audit_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_runtime.cli", "audit", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")},
    )


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("audit")


@pytest.fixture(scope="module")
def server(serve: Servers, audit_dir: Path) -> ServerProcess:
    return serve(
        "audited",
        SANDBOX_AUTH_TOKENS=f"alice:{ALICE},bob:{BOB}",
        SANDBOX_AUDIT_LOG=str(audit_dir / "audit.log"),
        SANDBOX_E2B="true",
    )


async def test_one_line_per_call_with_who_what_and_how_and_no_secret(
    server: ServerProcess, audit_dir: Path
) -> None:
    log = audit_dir / "audit.log"
    before = len(lines_of(log))
    async with open_client(server.url, ALICE) as alice, open_client(server.url, BOB, "auto") as bob:
        ran = await alice.ok("execute_code", command=f"echo {MARKER}", session="work")
        await alice.ok("write_file", path="note.txt", content=f"{MARKER}\n" * 100, session="work")
        download = await alice.ok("create_file_url", path="note.txt", session="work")
        upload = await alice.ok("create_file_url", path="up.txt", method="PUT", session="work")
        started = await bob.ok("execute_code_async", command="true")
        await bob.error("get_execution_output", execution_id="no-such-execution")
        await bob.error("execute_code")  # (no command: invalid arguments)
        await bob.error(f"no_such_tool_{MARKER}")
    async with httpx2.AsyncClient(trust_env=False, timeout=30) as http:
        got = await http.get(download["url"])
        assert got.status_code == 200 and MARKER in got.text
        put = await http.put(upload["url"], content=f"{MARKER} uploaded".encode())
        assert put.status_code < 300, put.text
        refused = await http.get(download["url"].replace("/files/", "/files/x"))
        assert refused.status_code == 403

    expected = 8 + 3
    await eventually(lambda: len(lines_of(log)) >= before + expected, 10, "the audit lines")
    await asyncio.sleep(0.3)  # (nothing more comes: exactly one line per call)
    lines = lines_of(log)[before:]
    assert len(lines) == expected, lines
    calls = [line for line in lines if line["event"] == "tool_call"]
    by_tool = {line["tool"]: line for line in reversed(calls)}  # (each tool's first call)
    assert [line["principal"] for line in calls] == ["alice"] * 4 + ["bob"] * 4

    execute = by_tool["execute_code"]
    assert execute["session"] == "work" and execute["outcome"] == "ok"
    assert execute["execution_id"] == ran["execution_id"]
    assert execute["argument_bytes"] == {"command": len(f"echo {MARKER}"), "session": 4}
    assert execute["token_id"].startswith("st-") and execute["client_id"] is None
    assert execute["duration_ms"] > 0
    assert by_tool["write_file"]["argument_bytes"]["content"] == len(f"{MARKER}\n") * 100
    assert by_tool["execute_code_async"]["execution_id"] == started["execution_id"]
    assert by_tool["execute_code_async"]["session"] == "default"
    assert by_tool["get_execution_output"]["outcome"] == "not_found"
    assert by_tool["get_execution_output"]["execution_id"] == "no-such-execution"
    invalid = [c for c in calls if c["tool"] == "execute_code" and c["principal"] == "bob"]
    assert [c["outcome"] for c in invalid] == ["invalid_arguments"]
    unknown = [c for c in calls if c["tool"] == "(unknown)"]
    assert [c["outcome"] for c in unknown] == ["not_found"]
    alice_ids = {c["token_id"] for c in calls if c["principal"] == "alice"}
    bob_ids = {c["token_id"] for c in calls if c["principal"] == "bob"}
    assert len(alice_ids) == len(bob_ids) == 1 and alice_ids != bob_ids

    files = [line for line in lines if line["event"] == "file_url"]
    assert [(f["tool"], f["principal"], f["session"], f["outcome"]) for f in files] == [
        ("file_url.get", "alice", "work", "ok"),
        ("file_url.put", "alice", "work", "ok"),
        ("file_url.get", None, None, "http_403"),
    ]
    assert files[0]["bytes_out"] == len(f"{MARKER}\n") * 100
    assert files[1]["bytes_in"] == len(f"{MARKER} uploaded")
    assert files[0]["token_id"].startswith("url-")

    # (the lines above came from the direct tools/call path, server/dispatch.py, which runs
    # the audit middleware as the library's path does)
    assert "fixed tools on the direct path" in server.stderr_text()

    text = log.read_text()
    download_token = download["url"].split("/files/")[1].split("/")[0]
    upload_token = upload["url"].split("/files/")[1].split("/")[0]
    for secret in (ALICE, BOB, MARKER, download_token, upload_token):
        assert secret not in text


async def test_a_caller_cannot_make_its_line_huge_or_carry_content(
    server: ServerProcess, audit_dir: Path
) -> None:
    """A session argument is the caller's text: 200 KB of it (with a marker) is refused by the
    tool, and its line says the session was invalid, neither the text nor 200 KB."""
    log = audit_dir / "audit.log"
    before = len(lines_of(log))
    async with open_client(server.url, ALICE) as alice:
        await alice.error("execute_code", command="true", session=MARKER + "x" * 200_000)
    await eventually(lambda: len(lines_of(log)) > before, 10, "the call's line")
    raw = log.read_text().splitlines()[before:]
    assert len(raw) == 1 and len(raw[0]) < 2000, len(raw[0])
    line = json.loads(raw[0])
    assert (line["tool"], line["session"], line["outcome"]) == (
        "execute_code",
        "(invalid)",
        "invalid",
    )
    assert MARKER not in raw[0]


async def test_the_cli_filters_by_principal_tool_session_outcome_and_time(
    server: ServerProcess, audit_dir: Path
) -> None:
    log = str(audit_dir / "audit.log")
    async with open_client(server.url, BOB) as bob:
        await bob.ok("list_executions", session="cli")
    await eventually(
        lambda: any(line["tool"] == "list_executions" for line in lines_of(Path(log))),
        10,
        "the call's line",
    )
    every = audit_cli("--file", log, "--json")
    assert every.returncode == 0, every.stderr
    records = [json.loads(line) for line in every.stdout.splitlines()]
    assert records == lines_of(Path(log))

    def picked(*filters: str) -> list[dict[str, Any]]:
        done = audit_cli("--file", log, "--json", *filters)
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines()]

    assert {r["principal"] for r in picked("--principal", "bob")} == {"bob"}
    assert [r["tool"] for r in picked("--session", "cli")] == ["list_executions"]
    assert {r["tool"] for r in picked("--tool", "file_url.*")} == {"file_url.get", "file_url.put"}
    failed = picked("--outcome", "error")
    assert failed and all(r["outcome"] != "ok" for r in failed)
    assert {r["outcome"] for r in picked("--outcome", "not_found")} == {"not_found"}
    assert picked("--since", "1h") == records
    assert picked("--since", "2999-01-01T00:00:00Z") == []
    people = audit_cli("--file", log, "--principal", "bob", "--session", "cli")
    assert people.returncode == 0 and "bob" in people.stdout and "list_executions" in people.stdout
    wrong = audit_cli("--file", log, "--since", "yesterday")
    assert wrong.returncode == 2 and "--since" in wrong.stderr


async def test_a_flood_against_a_log_that_cannot_keep_up_stays_bounded(
    serve: Servers, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The log is a FIFO opened for reading and not read: the writer blocks as on a hung
    disk. Calls go on at their pace, lines past the queue are dropped and counted, the
    server's memory does not follow the number of calls, and the next line written after the
    reader comes back says how many were lost."""
    fifo = tmp_path_factory.mktemp("slow") / "audit.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # (the writer's open needs a reader)
    try:
        server = serve(
            "flooded",
            SANDBOX_AUTH_TOKEN=ALICE,
            SANDBOX_AUDIT_LOG=str(fifo),
            SANDBOX_AUDIT_LOG_QUEUE_MB="0.05",  # (~20 of these lines)
        )
        # The longest line a call makes: 32 arguments named with 64 characters (~2.5 KiB).
        many = {f"argument_{n:02d}".ljust(64, "x"): MARKER for n in range(32)}

        async def flood(calls: int) -> float:
            began = time.monotonic()
            async with open_client(server.url, ALICE) as conn:

                async def worker(n: int) -> None:
                    for _ in range(n):
                        await conn.call("list_executions", **many)

                await asyncio.gather(*(worker(calls // 8) for _ in range(8)))
            return time.monotonic() - began

        await flood(400)  # past the pipe's buffer and the queue: the writer is stuck
        dropped_before = server.metric(ALICE, "srt_audit_dropped_lines_total")
        assert dropped_before > 0
        rss_before = memory_of(server.pid)["VmRSS"]
        seconds = await flood(2000)
        rss_after = memory_of(server.pid)["VmRSS"]
        dropped = server.metric(ALICE, "srt_audit_dropped_lines_total") - dropped_before
        print(
            f"\nflood: 2000 calls in {seconds:.1f} s, {dropped:.0f} lines dropped, RSS "
            f"{rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB"
        )
        assert dropped == 2000, dropped  # (the queue was full all along)
        assert rss_after - rss_before < 20 * 2**20, (rss_before, rss_after)
        assert seconds < 100, seconds  # the calls did not wait for the log

        said: list[dict[str, Any]] = []
        buffer = b""

        def drain() -> bool:
            nonlocal buffer
            try:
                while chunk := os.read(reader, 1 << 16):
                    buffer += chunk
            except BlockingIOError:
                pass
            whole = [json.loads(line) for line in buffer.split(b"\n")[:-1]]
            said[:] = [line for line in whole if line["event"] == "dropped"]
            return bool(said)

        async with open_client(server.url, ALICE) as conn:
            for _ in range(3):  # (the writer unblocks, writes its queue, then this)
                await conn.call("list_executions")
        await eventually(drain, 30, "a line saying how many were dropped")
        assert sum(line["lines"] for line in said) >= dropped
        assert MARKER not in buffer.decode() and ALICE not in buffer.decode()
    finally:
        threading.Thread(target=_drain_until_closed, args=(reader,), daemon=True).start()


def _drain_until_closed(fd: int) -> None:
    """Keep the FIFO read (the server's last lines at its stop), then close it."""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                if os.read(fd, 1 << 16) == b"":
                    return
            except BlockingIOError:
                time.sleep(0.05)
    finally:
        os.close(fd)


def test_a_second_server_on_the_same_audit_file_refuses_to_start(
    server: ServerProcess, audit_dir: Path, tmp_path: Path
) -> None:
    code, stderr = run_server_once(tmp_path, SANDBOX_AUDIT_LOG=str(audit_dir / "audit.log"))
    assert code != 0
    assert "is written by another process: give each replica its own file" in stderr, stderr


async def test_e2b_api_calls_have_their_lines(server: ServerProcess, audit_dir: Path) -> None:
    log = audit_dir / "audit.log"
    before = len(lines_of(log))
    async with httpx2.AsyncClient(trust_env=False, timeout=30) as http:
        listed = await http.get(f"{server.base_url}/e2b/sandboxes", headers={"X-API-KEY": BOB})
        assert listed.status_code == 200, listed.text
        wrong = await http.get(f"{server.base_url}/e2b/sandboxes", headers={"X-API-KEY": MARKER})
        assert wrong.status_code == 401
        made = await http.post(
            f"{server.base_url}/e2b/v2/sandboxes",
            json={"templateID": "base"},
            headers={"X-API-KEY": BOB},
        )
        assert made.status_code == 201, made.text
        sandbox = made.json()
        envd = {
            "E2b-Sandbox-Id": sandbox["sandboxID"],
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sandbox["envdAccessToken"],
        }
        path = f"/home/user/{MARKER}.txt"  # (a query: never in the line)
        put = await http.post(
            f"{server.base_url}/e2b/files",
            params={"path": path},
            files={"file": (f"{MARKER}.txt", MARKER.encode())},
            headers=envd,
        )
        assert put.status_code < 300, put.text
        got = await http.get(f"{server.base_url}/e2b/files", params={"path": path}, headers=envd)
        assert got.status_code == 200 and got.text == MARKER
    await eventually(lambda: len(lines_of(log)) >= before + 5, 10, "the E2B calls' lines")
    lines = lines_of(log)[before:]
    assert [(x["event"], x["principal"], x["tool"], x["outcome"]) for x in lines] == [
        ("e2b_call", "bob", "GET /sandboxes", "ok"),
        ("e2b_call", None, "GET /sandboxes", "http_401"),
        ("e2b_call", "bob", "POST /v2/sandboxes", "ok"),
        ("e2b_call", "bob", "POST /files", "ok"),
        ("e2b_call", "bob", "GET /files", "ok"),
    ]
    assert lines[0]["token_id"].startswith("e2b-")
    assert lines[4]["sandbox_id"] == sandbox["sandboxID"]
    assert lines[4]["token_id"] != lines[0]["token_id"]  # (the sandbox's token, not the key)
    text = log.read_text()
    for secret in (BOB, MARKER, sandbox["envdAccessToken"]):
        assert secret not in text


async def test_hosted_server_tool_calls_have_their_lines(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from hosted_harness import catalog_server, script_entry

    workdir = tmp_path_factory.mktemp("hosted-audit")
    log = workdir / "audit.log"
    catalog = {"echoes": script_entry("echoenv.py")}
    with catalog_server(workdir, catalog, f"alice:{ALICE}", SANDBOX_AUDIT_LOG=str(log)) as server:
        async with open_client(f"{server.base_url}/servers/echoes/mcp", ALICE) as conn:
            echoed = await conn.call("echo", text=MARKER)
            assert MARKER in str(echoed.content)
            with pytest.raises(MCPError, match="no_such_tool"):
                await conn.call("no_such_tool")
        await eventually(lambda: len(lines_of(log)) >= 2, 20, "the hosted calls' lines")
        lines = lines_of(log)
    assert [(x["event"], x["principal"], x["server"], x["tool"]) for x in lines] == [
        ("hosted_call", "alice", "echoes", "echo"),
        ("hosted_call", "alice", "echoes", "no_such_tool"),
    ]
    assert lines[0]["outcome"] == "ok" and lines[0]["argument_bytes"] == {"text": len(MARKER)}
    assert lines[1]["outcome"] != "ok"
    assert MARKER not in log.read_text() and ALICE not in log.read_text()
