"""An upload cut off by the server's death (SIGKILL) leaves nothing behind: the next server on
the same state directory removes the partial file before the workspace is used, and the
workspace's usage counts only what is listed."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from mcp_harness import ServerProcess, eventually, open_client, stop_all, stop_if_running

from sandbox_runtime.workspaces.fsops import UPLOAD_PREFIX, remove_partial_uploads

pytestmark = pytest.mark.e2e

TOKEN = "upload-cut-token-0123456789"
MiB = 1024 * 1024
SENT_MB = 20


def partial_uploads(state_dir: Path) -> list[Path]:
    return [p for p in state_dir.rglob(f"{UPLOAD_PREFIX}*") if p.is_file()]


async def test_an_upload_cut_off_by_sigkill_leaves_no_partial_file_after_restart(
    tmp_path: Path,
) -> None:
    settings = {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_WORKSPACE_MB": "64"}
    first = ServerProcess(tmp_path / "srv", settings)
    second = ServerProcess(tmp_path / "srv", settings)
    session = f"cut-{uuid.uuid4().hex[:8]}"
    try:
        first.start()
        async with open_client(first.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="small.txt", content="hello world", session=session)
            made = await conn.ok("create_file_url", path="big.bin", method="PUT", session=session)
        sent, killed = asyncio.Event(), asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            for i in range(60):
                yield b"\xa5" * MiB
                if i + 1 == SENT_MB:
                    sent.set()
                    await killed.wait()  # then the next write fails

        async with httpx2.AsyncClient(trust_env=False, timeout=60.0) as client:
            upload = asyncio.create_task(client.put(made["url"], content=body()))
            await asyncio.wait_for(sent.wait(), 30)
            await eventually(
                lambda: any(
                    p.stat().st_size >= (SENT_MB - 2) * MiB
                    for p in partial_uploads(first.state_dir)
                ),
                10,
                "the partial upload on disk",
            )
            first.kill()  # SIGKILL: no clean-up of its own
            killed.set()
            with pytest.raises(httpx2.HTTPError):
                await upload

        second.start()
        async with open_client(second.url, TOKEN, "auto") as conn:
            listing = await conn.ok("list_files", session=session)
        assert [e["path"] for e in listing["entries"]] == ["small.txt"], listing
        assert listing["usage"]["bytes_used"] < 4 * MiB, listing["usage"]
        assert partial_uploads(second.state_dir) == []
        assert "removed 1 partial uploads" in second.stderr_text()
    finally:
        stop_all(first.kill, stop_if_running(second))


@pytest.mark.unit
def test_the_sweep_removes_only_partial_files_and_follows_no_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "ws", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (outside / f"{UPLOAD_PREFIX}theirs").write_bytes(b"x")
    (root / "a" / "b" / f"{UPLOAD_PREFIX}1234").write_bytes(b"partial")
    (root / f"{UPLOAD_PREFIX}dir").mkdir()  # a directory of that name is the user's
    (root / f"{UPLOAD_PREFIX}link").symlink_to(outside / f"{UPLOAD_PREFIX}theirs")
    (root / "a" / "out").symlink_to(outside, target_is_directory=True)
    (root / "keep.txt").write_text("kept")

    assert remove_partial_uploads(root) == 1
    assert not (root / "a" / "b" / f"{UPLOAD_PREFIX}1234").exists()
    assert (root / f"{UPLOAD_PREFIX}dir").is_dir()
    assert (root / f"{UPLOAD_PREFIX}link").is_symlink()
    assert (outside / f"{UPLOAD_PREFIX}theirs").read_bytes() == b"x"
    assert (root / "keep.txt").read_text() == "kept"
