"""Sessions that outlive their replica: snapshots taken on demand and on SIGTERM, restored by
the replica that takes a session over; restore_session, fork_session, list_snapshots; the
principal's snapshots invisible to another; a snapshot store that goes down.

Real parts: real servers (separate state dirs, as separate machines), a real redis-server, a
real S3-compatible server (moto's standalone server), the official MCP client.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import (
    Conn,
    ServerProcess,
    Servers,
    eventually,
    free_port,
    open_client,
    replica_process,
)
from redis_harness import RedisServer

pytestmark = pytest.mark.e2e

TOKEN = "snapshot-test-token-0123"
ALICE, BOB = "snap-alice-token-0123456", "snap-bob-token-01234567"
PACKAGE = "srtsnapdemo"


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


def wheel() -> bytes:
    """A tiny pure-Python wheel, built here (pip installs it with no index and no network)."""
    files = {
        f"{PACKAGE}/__init__.py": b"ANSWER = 42\n",
        f"{PACKAGE}-1.0.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n"
        ).encode(),
        f"{PACKAGE}-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{PACKAGE}-1.0.dist-info/RECORD,,")
    files[f"{PACKAGE}-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out.getvalue()


async def fill_session(conn: Conn, session: str) -> None:
    """Files of every kind a snapshot keeps, and a package installed with pip --user."""
    await conn.ok(
        "write_file",
        path=f"{PACKAGE}-1.0-py3-none-any.whl",
        content=base64.b64encode(wheel()).decode(),
        encoding="base64",
        session=session,
    )
    script = (
        "set -e; mkdir -p data/empty data/sub; echo kept > data/sub/a.txt; chmod 640 "
        "data/sub/a.txt; ln -s sub/a.txt data/link; head -c 300000 /dev/urandom > data/blob; "
        f"python3 -m pip install --user --no-index --no-deps -q ./{PACKAGE}-1.0-py3-none-any.whl"
        " 2>&1 | tail -2; sha256sum data/blob > data/blob.sum"
    )
    result = await conn.ok("execute_code", command=script, session=session, timeout_seconds=120)
    assert result["exit_code"] == 0, result


CHECK = (
    "cat data/sub/a.txt; stat -c %a data/sub/a.txt; readlink data/link; test -d data/empty && "
    "echo empty-dir; sha256sum -c --quiet data/blob.sum && echo blob-ok; "
    f'python3 -c "import {PACKAGE}; print({PACKAGE}.ANSWER)"; ls after.txt 2>&1 | head -1'
)
KEPT = "kept\n640\nsub/a.txt\nempty-dir\nblob-ok\n42\n"


# -- one server: the tools ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve("snapshots", SANDBOX_AUTH_TOKENS=f"alice:{ALICE},bob:{BOB}")


async def test_snapshot_restore_fork_and_list(server: ServerProcess) -> None:
    session, fork = f"s-{uuid.uuid4().hex[:8]}", f"f-{uuid.uuid4().hex[:8]}"
    async with open_client(server.url, ALICE, "auto") as conn:
        await fill_session(conn, session)
        await conn.ok("run_code", code="x = 1", session=session)
        taken = await conn.ok("snapshot_session", session=session)
        assert taken["snapshot_id"].startswith("snap-") and len(taken["snapshot_id"]) == 37
        assert taken["files"] >= 4 and taken["size_bytes"] >= 300_000, taken
        assert taken["session"] == session and taken["trigger"] == "on_demand"

        again = await conn.ok("snapshot_session", session=session)
        assert again["stored_bytes"] < 10_000, "an unchanged workspace stores almost nothing"

        await conn.ok(
            "execute_code", command="rm -rf data; echo later > after.txt", session=session
        )
        restored = await conn.ok("restore_session", snapshot_id=taken["snapshot_id"],
                                 session=session)  # fmt: skip
        assert restored["restored_from"]["snapshot_id"] == taken["snapshot_id"]
        assert restored["interpreters_stopped"] == ["python"]
        checked = await conn.ok("execute_code", command=CHECK, session=session)
        assert stdout_of(checked).startswith(KEPT), stdout_of(checked)
        assert "No such file" in stdout_of(checked), "a file made after the snapshot is gone"
        state = await conn.ok("run_code", code="print('x' in dir())", session=session)
        assert state["state_reset"] == {"reason": "restored"}
        assert "False" in stdout_of(state)

        forked = await conn.ok("fork_session", from_session=session, to_session=fork)
        assert forked["session"] == fork and forked["restored_from"]["trigger"] == "fork"
        checked = await conn.ok("execute_code", command=CHECK, session=fork)
        assert stdout_of(checked).startswith(KEPT), stdout_of(checked)
        refused = await conn.error("fork_session", from_session=session, to_session=fork)
        assert "already has files" in refused

        listed = await conn.ok("list_snapshots", session=session)
        ids = [s["snapshot_id"] for s in listed["snapshots"]]
        assert taken["snapshot_id"] in ids and again["snapshot_id"] in ids
        assert all(s["session"] == session for s in listed["snapshots"])
        everything = await conn.ok("list_snapshots")
        assert {s["session"] for s in everything["snapshots"]} >= {session}

        bad = await conn.error("restore_session", snapshot_id="../../etc/passwd", session=session)
        assert "snapshot_id" in bad

    async with open_client(server.url, BOB, "legacy") as conn:
        listed = await conn.ok("list_snapshots")
        assert taken["snapshot_id"] not in [s["snapshot_id"] for s in listed["snapshots"]]
        refused = await conn.error("restore_session", snapshot_id=taken["snapshot_id"])
        assert "no snapshot" in refused
        refused = await conn.error(
            "fork_session", snapshot_id=taken["snapshot_id"], to_session="bobs"
        )
        assert "no snapshot" in refused
        result = await conn.ok("execute_code", command="ls", session="bobs")
        assert stdout_of(result) == "", "nothing of alice's reached bob's session"


async def test_restore_refused_while_an_execution_runs(server: ServerProcess) -> None:
    session = f"busy-{uuid.uuid4().hex[:8]}"
    async with open_client(server.url, ALICE, "auto") as conn:
        await conn.ok("execute_code", command="echo one > one.txt", session=session)
        taken = await conn.ok("snapshot_session", session=session)
        running = await conn.ok(
            "execute_code_async", command="sleep 30; echo two > two.txt", session=session
        )
        refused = await conn.error(
            "restore_session", snapshot_id=taken["snapshot_id"], session=session
        )
        assert "execution is running" in refused
        await conn.ok("cancel_execution", execution_id=running["execution_id"], session=session)


# -- replicas: a killed or stopped home, and a store that goes down ---------------------------


def replica(workdir: Path, redis: RedisServer, store: str, name: str) -> ServerProcess:
    return replica_process(
        workdir, redis.url, name, TOKEN, SANDBOX_SNAPSHOT_STORE=store, SANDBOX_WORKSPACE_POOL="0"
    )


async def rehomed(conn: Conn, session: str, command: str) -> dict[str, Any]:
    async def attempt() -> dict[str, Any] | None:
        result = await conn.call("execute_code", command=command, session=session)
        if result.is_error:  # the home's heartbeat has not expired yet
            return None
        assert result.structured_content is not None
        return dict(result.structured_content)

    return await eventually(attempt, 30, "the session to be re-homed", interval=0.5)


async def test_a_killed_replicas_session_comes_back_from_its_snapshot(
    tmp_path: Path, redis_server: RedisServer, serve: Servers
) -> None:
    store = tmp_path / "shared-store"  # (a shared filesystem, as NFS would be)
    a = serve.add(replica(tmp_path, redis_server, str(store), f"ka-{uuid.uuid4().hex[:6]}"))
    b = serve.add(replica(tmp_path, redis_server, str(store), f"kb-{uuid.uuid4().hex[:6]}"))
    session = f"k-{uuid.uuid4().hex[:8]}"
    async with open_client(a.url, TOKEN, "auto") as on_a:
        await fill_session(on_a, session)
        taken = await on_a.ok("snapshot_session", session=session)
        await on_a.ok("execute_code", command="echo later > after.txt", session=session)
    a.kill()
    async with open_client(b.url, TOKEN, "legacy") as on_b:
        result = await rehomed(on_b, session, CHECK)
        reset = result["session_reset"]
        assert reset["reason"] == "home_lost", reset
        assert reset["restored_from"]["snapshot_id"] == taken["snapshot_id"], reset
        assert "after the snapshot" in reset["lost"]
        out = stdout_of(result)
        assert out.startswith(KEPT) and "No such file" in out, out
        again = await on_b.ok("execute_code", command="cat data/sub/a.txt", session=session)
        assert "session_reset" not in again or again["session_reset"] is None
    assert b.metric(TOKEN, "srt_snapshot_restores_total", 'outcome="ok"') >= 1


async def test_sigterm_snapshots_the_sessions_first(
    tmp_path: Path, redis_server: RedisServer, serve: Servers
) -> None:
    store = tmp_path / "shared-store"
    a = serve.add(replica(tmp_path, redis_server, str(store), f"ta-{uuid.uuid4().hex[:6]}"))
    b = serve.add(replica(tmp_path, redis_server, str(store), f"tb-{uuid.uuid4().hex[:6]}"))
    session = f"t-{uuid.uuid4().hex[:8]}"
    async with open_client(a.url, TOKEN, "legacy") as on_a:
        await fill_session(on_a, session)
        await on_a.ok("execute_code", command="echo last > after.txt", session=session)
    a.stop(timeout=60)
    async with open_client(b.url, TOKEN, "auto") as on_b:
        result = await rehomed(on_b, session, CHECK + "; cat after.txt")
        reset = result["session_reset"]
        assert reset["reason"] == "home_stopped", reset
        assert reset["restored_from"]["trigger"] == "drain", reset
        assert stdout_of(result).startswith(KEPT) and stdout_of(result).endswith("last\n")


@pytest.fixture
def s3_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    """A real S3-compatible server (moto's standalone server) with a bucket: (endpoint, proc)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                request = urllib.request.Request(f"{endpoint}/snaps", method="PUT")
                urllib.request.urlopen(request, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield endpoint, proc
    finally:
        proc.kill()
        proc.wait()


async def test_s3_store_and_a_store_that_goes_down(
    s3_server: tuple[str, Any], serve: Servers
) -> None:
    endpoint, proc = s3_server
    server = serve(
        "s3",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_SNAPSHOT_STORE="s3://snaps/cluster-a",
        SANDBOX_SNAPSHOT_S3_ENDPOINT=endpoint,
        SANDBOX_SNAPSHOT_STORE_TIMEOUT="3",
        AWS_ACCESS_KEY_ID="test-key",
        AWS_SECRET_ACCESS_KEY="test-secret",
    )
    session = f"s3-{uuid.uuid4().hex[:8]}"
    async with open_client(server.url, TOKEN, "auto") as conn:
        await fill_session(conn, session)
        taken = await conn.ok("snapshot_session", session=session)
        listed = await conn.ok("list_snapshots", session=session)
        assert [s["snapshot_id"] for s in listed["snapshots"]] == [taken["snapshot_id"]]
        await conn.ok("execute_code", command="rm -rf data", session=session)
        await conn.ok("restore_session", snapshot_id=taken["snapshot_id"], session=session)
        checked = await conn.ok("execute_code", command=CHECK, session=session)
        assert stdout_of(checked).startswith(KEPT), stdout_of(checked)

        proc.kill()
        proc.wait()
        started = time.monotonic()
        result = await conn.ok("execute_code", command="echo still-here", session=session)
        assert stdout_of(result) == "still-here\n", "a store outage never fails other calls"
        refused = await conn.error("snapshot_session", session=session)
        assert "snapshot store (S3) failed" in refused, refused
        # no endpoint, bucket, prefix, principal hash or workspace name reaches the caller
        for leak in (endpoint, "127.0.0.1", "s3://", "snaps/", "cluster-a", "v1/", "ws-"):
            assert leak not in refused, (leak, refused)
        assert re.search(r"[0-9a-f]{32}", refused) is None, refused
        assert "cluster-a" in server.stderr_text(), "the operator's log has the detail"
        assert time.monotonic() - started < 30, "a store that does not answer is given up on"
        assert "test-secret" not in server.stderr_text()


async def test_a_corrupt_snapshot_starts_the_session_empty_and_says_why(
    tmp_path: Path, redis_server: RedisServer, serve: Servers
) -> None:
    store = tmp_path / "shared-store"
    a = serve.add(replica(tmp_path, redis_server, str(store), f"ca-{uuid.uuid4().hex[:6]}"))
    b = serve.add(replica(tmp_path, redis_server, str(store), f"cb-{uuid.uuid4().hex[:6]}"))
    session = f"c-{uuid.uuid4().hex[:8]}"
    async with open_client(a.url, TOKEN, "auto") as on_a:
        await fill_session(on_a, session)
        await on_a.ok("snapshot_session", session=session)
    packs = [p for p in store.rglob("packs/*") if p.is_file()]
    assert packs, "the snapshot's data is in packs"
    for pack in packs:  # one byte flipped in each: every chunk check fails
        data = bytearray(pack.read_bytes())
        data[len(data) // 2] ^= 0xFF
        pack.write_bytes(bytes(data))
    a.kill()
    async with open_client(b.url, TOKEN, "auto") as on_b:
        result = await rehomed(on_b, session, "ls -A | wc -l")
        reset = result["session_reset"]
        assert reset["reason"] == "home_lost" and "restored_from" not in reset, reset
        assert "checksum" in reset["restore_failed"] or "decompress" in reset["restore_failed"]
        assert stdout_of(result) == "0\n", "not half-restored: the workspace is empty"
    assert b.metric(TOKEN, "srt_snapshot_restores_total", 'outcome="failed"') >= 1


async def test_idle_sessions_are_snapshotted_once_per_change(serve: Servers) -> None:
    server = serve("idle", SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_SNAPSHOT_IDLE_SECONDS="2")
    session = f"i-{uuid.uuid4().hex[:8]}"
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("execute_code", command="echo one > one.txt", session=session)

        async def idle_snapshots() -> list[dict[str, Any]] | None:
            listed = await conn.ok("list_snapshots", session=session)
            found = [s for s in listed["snapshots"] if s["trigger"] == "idle"]
            return found or None

        first = await eventually(idle_snapshots, 30, "an idle snapshot", interval=0.5)
        assert first[0]["files"] == 1
        await asyncio.sleep(5)  # (idle, unchanged: no second snapshot)
        assert len(await idle_snapshots() or []) == 1
        # (written by an interpreter, which stays alive: a live kernel does not keep its
        # session from being snapshotted once idle)
        await conn.ok("run_code", code="open('two.txt', 'w').write('two')", session=session)
        await eventually(
            lambda: _more_than(idle_snapshots, 1), 30, "a second idle snapshot", interval=0.5
        )


async def _more_than(listing: Any, count: int) -> bool:
    return len(await listing() or []) > count


async def test_packs_a_newer_snapshot_reuses_survive_the_pruning_of_the_older_one(
    serve: Servers,
) -> None:
    """Session x's second snapshot reuses the packs of its first; session y's snapshot prunes
    x's first (one snapshot per token) when those packs are past their grace period: x's
    second snapshot must still restore."""
    server = serve("gc", SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_SNAPSHOT_MAX_PER_PRINCIPAL="1")
    store = server.state_dir / "snapshots"
    x, y = f"x-{uuid.uuid4().hex[:6]}", f"y-{uuid.uuid4().hex[:6]}"
    async with open_client(server.url, TOKEN, "auto") as conn:
        script = "head -c 1000000 /dev/urandom > big; sha256sum big > big.sum"
        await conn.ok("execute_code", command=script, session=x)
        await conn.ok("snapshot_session", session=x)
        old = time.time() - 7200
        for pack in store.rglob("packs/*"):
            os.utime(pack, (old, old))  # (written two hours ago)
        await conn.ok("execute_code", command="echo y > y.txt", session=y)
        await conn.ok("snapshot_session", session=y)  # (prunes x's first)
        await conn.ok("execute_code", command="echo small > small.txt", session=x)
        second = await conn.ok("snapshot_session", session=x)
        await conn.ok("execute_code", command="rm -f big small.txt", session=x)
        await conn.ok("restore_session", snapshot_id=second["snapshot_id"], session=x)
        checked = await conn.ok(
            "execute_code", command="sha256sum -c --quiet big.sum && cat small.txt", session=x
        )
        assert stdout_of(checked) == "small\n", checked
