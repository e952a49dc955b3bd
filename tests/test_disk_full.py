"""A full state disk loses no acknowledged write and says so (issue 32, finding 1).

The state directory is a small ext4 filesystem of the test's own (a loop-mounted image), filled
from the sessions' own `dd` and from outside (a file written straight into it); every write
the server acknowledged must read back identical after `sync; echo 3 > drop_caches` and after
a restart; refusals name the cause and the setting; /ready is unready while the disk is low and
ready again once space returns. A real server, real images, the official client.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import Conn, ServerProcess, error_text, eventually, open_client, running_server

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("mkfs.ext4") is None,
        reason="needs root and mkfs.ext4 to mount a small state filesystem",
    ),
]

TOKEN = "disk-full-token-0123456789"
MIB = 1024 * 1024
STATE_FS_MB = 96
SETTINGS = {
    "SANDBOX_AUTH_TOKEN": TOKEN,
    "SANDBOX_WORKSPACE_MB": "16",
    "SANDBOX_MIN_FREE_DISK_MB": "8",
    "SANDBOX_INTERPRETER_WARM": "python=0",
}


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A server workdir whose state directory is a fresh STATE_FS_MB ext4 filesystem."""
    image, state = tmp_path / "state-fs.img", tmp_path / "work" / "state"
    state.mkdir(parents=True)
    with open(image, "wb") as f:
        f.truncate(STATE_FS_MB * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(state)], check=True)
    try:
        yield tmp_path / "work"
    finally:
        # (The server unmounted its workspaces when it stopped; a lazy unmount covers a
        # failed test whose server was killed.)
        if subprocess.run(["umount", str(state)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(state)], check=False)
        image.unlink(missing_ok=True)


def session() -> str:
    return f"d-{uuid.uuid4().hex[:8]}"


def fill_from_outside(state: Path, mb: int | None = None, name: str = "outside.fill") -> Path:
    """Write a file straight into the state filesystem: `mb` MiB, or until it is full."""
    path = state / name
    chunk = b"\xa5" * MIB
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(mb if mb is not None else 2**20):
            try:
                os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
    return path


def break_superblock(image: Path) -> None:
    with open(image, "r+b") as f:
        f.write(b"\0" * 8192)  # the primary superblock (e2fsck -p does not look for backups)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def ready(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    resp = httpx2.get(f"{server.base_url}/ready", timeout=5)
    return resp.status_code, resp.json()


def metric(server: ServerProcess, prefix: str, *labels: str) -> float:
    return server.metric(TOKEN, prefix, *labels)


def output(ran: dict[str, Any]) -> str:
    return "".join(e.get("data") or "" for e in ran["output"] if e.get("type") != "stderr")


async def dd(conn: Conn, s: str, path: str, mb: int) -> Any:
    """Random bytes into `path` with dd; the result (its sha256 as output) or the call."""
    command = f"dd if=/dev/urandom of={path} bs=1M count={mb} status=none && sha256sum {path}"
    return await conn.call("execute_code", command=command, session=s)


async def sha256_in(conn: Conn, s: str, path: str) -> str:
    ran = await conn.ok("execute_code", command=f"sha256sum {path}", session=s)
    assert not ran.get("session_reset"), ran
    assert ran["exit_code"] == 0, ran
    return output(ran).split()[0]


async def check_all(conn: Conn, written: dict[tuple[str, str], str]) -> None:
    for (s, path), digest in written.items():
        assert await sha256_in(conn, s, path) == digest, f"{s}:{path} changed"


async def test_a_full_state_disk_loses_no_acknowledged_write(workdir: Path) -> None:
    """Sessions fill the state filesystem, then a file from outside fills the rest: every
    write acknowledged before and while it is full reads back identical after the caches
    are dropped and after a restart; new sessions are refused naming the setting; /ready is
    503 while the disk is low and 200 again once the outside file is gone."""
    state = workdir / "state"
    written: dict[tuple[str, str], str] = {}
    ballast = fill_from_outside(state, 16, "ballast.fill")  # (given back at the end)
    server = ServerProcess(workdir, dict(SETTINGS)).start()
    try:
        assert ready(server)[0] == 200
        async with open_client(server.url, TOKEN, "auto") as conn:
            sessions: list[str] = []
            refused = ""
            for _ in range(12):  # 16 MiB each on ~70 MiB with 8 kept free: about 3 fit
                s = session()
                result = await dd(conn, s, "big", 6)
                if result.is_error:
                    refused = error_text(result)
                    break
                ran = dict(result.structured_content or {})
                assert ran["exit_code"] == 0, ran
                written[(s, "big")] = output(ran).split()[0]
                sessions.append(s)
            assert len(sessions) >= 2, refused
            assert "SANDBOX_MIN_FREE_DISK_MB" in refused and "SANDBOX_WORKSPACE_MB" in refused

            outside = fill_from_outside(state)
            status, body = ready(server)
            assert status == 503 and any(r.startswith("disk:") for r in body["reasons"]), body
            assert server.health()["disk"]["status"] == "low"
            assert metric(server, "srt_state_disk_low") == 1

            # The sessions that have a workspace keep working on a full host disk: their
            # images hold their blocks already.
            first, second, last = sessions[0], sessions[1], sessions[-1]
            result = await dd(conn, first, "more", 3)
            ran = dict(result.structured_content or {})
            assert not result.is_error and ran["exit_code"] == 0, error_text(result) or ran
            written[(first, "more")] = output(ran).split()[0]
            data = os.urandom(1_900_000)
            wrote = await conn.ok(
                "write_file",
                path="inline.bin",
                content=base64.b64encode(data).decode(),
                encoding="base64",
                session=second,
            )
            assert wrote["size"] == len(data)
            written[(second, "inline.bin")] = hashlib.sha256(data).hexdigest()
            made = await conn.ok("create_file_url", path="up.bin", method="PUT", session=last)
            upload = os.urandom(1_500_000)
            put = httpx2.put(made["url"], content=upload, timeout=30)
            assert put.status_code == 201, put.text
            written[(last, "up.bin")] = hashlib.sha256(upload).hexdigest()
            refused = await conn.error("execute_code", command="true", session=session())
            assert "SANDBOX_MIN_FREE_DISK_MB" in refused, refused

            drop_caches()
            await check_all(conn, written)

            outside.unlink()
            await eventually(lambda: ready(server)[0] == 200, 10, "/ready once space returns")
            ballast.unlink()  # (room for one more workspace above the floor)
            assert server.health()["disk"]["status"] == "ok"
            assert metric(server, "srt_state_disk_low") == 0
            ran = await conn.ok("execute_code", command="echo fresh", session=session())
            assert output(ran) == "fresh\n"
        server.stop()

        # Files survive a restart, even one on a full disk (which must not turn the images
        # into empty directories: the start's test image has no room either).
        outside = fill_from_outside(state)
        server = ServerProcess(workdir, dict(SETTINGS)).start()
        drop_caches()
        assert server.health()["disk"]["status"] == "low"
        async with open_client(server.url, TOKEN, "auto") as conn:
            await check_all(conn, written)
        assert metric(server, "srt_workspace_damage_total", 'event="detected"') == 0
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


async def test_a_workspace_whose_filesystem_fails_says_so_and_is_checked(workdir: Path) -> None:
    """With sparse images (SANDBOX_WORKSPACE_RESERVE=sparse) a full host disk fails writes
    inside an image: the write_file that meets it is an error, never a success; the workspace
    is marked and, once there is room, checked by e2fsck before it is served again; the
    caller learns how that ended; what was acknowledged before reads back identical."""
    state = workdir / "state"
    settings = {**SETTINGS, "SANDBOX_WORKSPACE_RESERVE": "sparse", "SANDBOX_WORKSPACE_MB": "64"}
    with running_server(workdir, **settings) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            s = session()
            kept = os.urandom(300_000)
            await conn.ok(
                "write_file",
                path="kept.bin",
                content=base64.b64encode(kept).decode(),
                encoding="base64",
                session=s,
            )
            outside = fill_from_outside(state)
            failed = await conn.error(
                "write_file",
                path="lost.bin",
                content=base64.b64encode(os.urandom(1_900_000)).decode(),
                encoding="base64",
                session=s,
            )
            assert "filesystem failed" in failed, failed
            assert metric(server, "srt_workspace_damage_total", 'event="detected"') == 1
            assert server.health()["disk"]["damaged_workspaces"] == 1
            refused = await conn.error("read_file", path="kept.bin", session=s)
            assert "filesystem failed" in refused, refused  # not served until checked

            outside.unlink()
            got = await conn.ok("read_file", path="kept.bin", encoding="base64", session=s)
            reset = got.get("session_reset")
            checked = [
                e
                for e in ("clean", "repaired", "quarantined")
                if metric(server, "srt_workspace_damage_total", f'event="{e}"') == 1
            ]
            assert len(checked) == 1, checked
            if checked == ["quarantined"]:
                assert reset and reset["reason"] == "workspace_quarantined", got
                assert any((state / "workspaces" / ".quarantine").iterdir())
            else:
                assert base64.b64decode(got["content"]) == kept
                if checked == ["repaired"]:
                    assert reset and reset["reason"] == "workspace_repaired", got
                else:
                    assert not reset, got
            assert server.health()["disk"]["damaged_workspaces"] == 0
            await conn.ok("write_file", path="after.txt", content="works", session=s)


async def test_an_image_that_will_not_mount_is_set_aside_and_the_session_told(
    tmp_path: Path,
) -> None:
    """A workspace image left unusable (its superblock gone) is not a dead session for ever:
    e2fsck cannot repair it, so it is moved to .quarantine/ for the operator and the session
    starts afresh with session_reset workspace_quarantined."""
    settings = {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_INTERPRETER_WARM": "python=0"}
    s = session()
    with running_server(tmp_path, **settings) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="f.txt", content="one", session=s)
    images = [p for p in (tmp_path / "state" / "workspaces").glob("*.img")]
    assert len(images) == 1, images
    break_superblock(images[0])
    with running_server(tmp_path, **settings) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            got = await conn.ok("write_file", path="g.txt", content="two", session=s)
            assert got.get("session_reset", {}).get("reason") == "workspace_quarantined", got
            listed = await conn.ok("list_files", session=s)
            assert [e["path"] for e in listed["entries"]] == ["g.txt"]
            assert metric(server, "srt_workspace_damage_total", 'event="quarantined"') == 1
    assert len(list((tmp_path / "state" / "workspaces" / ".quarantine").iterdir())) == 1
