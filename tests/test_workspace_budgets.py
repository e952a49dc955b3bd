"""Retention measured in what idle workspaces hold (issue 41): byte budgets per principal and
per replica, least recently used removed first, never one in use; snapshotted first where a
store is set, so the session's next call gets its files back (`session_reset:
workspace_removed`, restored_from), and afresh without one. Real servers, real images.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import uuid
from pathlib import Path

import httpx2
import pytest
from mcp_harness import Conn, eventually, open_client, release_disk, running_server

from sandbox_runtime.workspaces.budget import Held, directory_bytes, over_budget

TOKEN = "budget-token-0123456789"
MIB = 1024 * 1024
SETTINGS = {
    "SANDBOX_AUTH_TOKEN": TOKEN,
    "SANDBOX_WORKSPACE_MB": "16",
    "SANDBOX_RETENTION_SECONDS": "8",  # (the sweep runs every quarter of it)
    "SANDBOX_IDLE_WORKSPACE_SECONDS": "2",
    "SANDBOX_WORKSPACE_POOL": "0",
    "SANDBOX_POOL_SIZE": "0",
    "SANDBOX_INTERPRETER_WARM": "python=0",
    "SANDBOX_SNAPSHOT_IDLE_SECONDS": "0",  # (only the budget's own snapshot before removal)
}
needs_images = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.ext4") is None,
    reason="needs root and mkfs.ext4 for workspace images",
)


def held(name: str, principal: str | None, size: int, used: float) -> Held:
    return Held(name, principal, size, used)


@pytest.mark.unit
def test_the_least_recently_used_go_first_per_principal_then_per_replica() -> None:
    idle = [
        held("a1", "a", 10, 1),
        held("b1", "b", 10, 2),
        held("a2", "a", 10, 3),
        held("b2", "b", 10, 4),
        held("a3", "a", 10, 5),
        held("x", None, 10, 0),  # (no owner recorded: the replica's budget only)
    ]
    assert over_budget(idle, 0, 0) == []
    assert [h.name for h in over_budget(idle, 0, 20)] == ["a1"]
    assert [h.name for h in over_budget(idle, 30, 20)] == ["a1", "x", "b1"]
    assert [h.name for h in over_budget(idle, 1000, 0)] == []
    assert [h.name for h in over_budget(idle, 5, 0)] == ["x", "a1", "b1", "a2", "b2", "a3"]


@pytest.mark.unit
def test_one_that_cannot_be_snapshotted_is_passed_over_not_a_stall() -> None:
    """A workspace whose snapshot failed lately (too many files to keep, a store down) still
    counts, and the next oldest go in its place: the budget holds for everyone else."""
    idle = [held("a1", "a", 10, 1), held("a2", "a", 10, 2), held("b1", "b", 10, 3)]
    assert [h.name for h in over_budget(idle, 0, 10, {"a1"})] == ["a2"]
    assert [h.name for h in over_budget(idle, 15, 0, {"a1"})] == ["a2", "b1"]
    assert [h.name for h in over_budget(idle, 0, 10, {"a1", "a2"})] == []


@pytest.mark.unit
def test_a_directorys_measure_is_bounded(tmp_path: Path) -> None:
    for i in range(50):
        (tmp_path / f"f{i}").write_bytes(b"x" * 8192)
    whole = directory_bytes(tmp_path)
    assert whole >= 50 * 8192
    assert directory_bytes(tmp_path, limit=10) < whole


def images(state: Path) -> set[Path]:
    return set((state / "workspaces").glob("ws-*.img"))


async def fill(conn: Conn, s: str, mb: int, then: str = "true") -> None:
    command = f"dd if=/dev/urandom of=f.bin bs=1M count={mb} status=none && {then}"
    done = await conn.ok("execute_code", command=command, session=s)
    assert done["exit_code"] == 0, done


async def sessions_writing(conn: Conn, state: Path, count: int, mb: int) -> list[tuple[str, Path]]:
    """`count` sessions, each writing `mb` MiB, one after another: (session, its image)."""
    made = []
    for i in range(count):
        s, before = f"b{i}-{uuid.uuid4().hex[:6]}", images(state)
        await fill(conn, s, mb)
        (image,) = images(state) - before
        made.append((s, image))
        await asyncio.sleep(0.3)  # (distinct last uses)
    return made


def removed_in_order(log: str) -> list[str]:
    return re.findall(r"removed the idle workspace (ws-[0-9a-f]+) ", log)


def metric(text: str, reason: str) -> float:
    for line in text.splitlines():
        if line.startswith("srt_workspaces_removed_total") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.e2e
@needs_images
async def test_idle_workspaces_over_a_principals_budget_go_oldest_first(tmp_path: Path) -> None:
    """Six idle sessions of one token, 4 MiB each, a 10 MiB budget: the four least recently
    used are removed (oldest first, snapshotted first), the two newest kept; a session whose
    command still runs is never removed, though it was used first. A removed session's next
    call restores its files from that snapshot and says so once."""
    state = tmp_path / "state"
    settings = {**SETTINGS, "SANDBOX_IDLE_WORKSPACES_MB_PER_PRINCIPAL": "10"}
    try:
        with running_server(tmp_path, **settings) as server:
            async with open_client(server.url, TOKEN, "auto") as conn:
                busy, before = f"busy-{uuid.uuid4().hex[:6]}", images(state)
                running = asyncio.create_task(fill(conn, busy, 3, then="sleep 90"))
                await eventually(lambda: images(state) - before, 10, "the busy one's image")
                (busy_image,) = images(state) - before
                made = await sessions_writing(conn, state, 6, 4)
                doomed, kept = made[:4], made[4:]

                await eventually(
                    lambda: not any(i.exists() for _, i in doomed), 40, "the four oldest removed"
                )
                assert all(i.exists() for _, i in kept)
                assert busy_image.exists()
                assert not running.done(), running.exception() if running.done() else None
                # (each removal is logged just after its image goes: the log may lag)
                order = await eventually(
                    lambda: o if len(o := removed_in_order(server.stderr_text())) >= 4 else None,
                    10,
                    "four removals logged",
                )
                assert order == [i.with_suffix("").name for _, i in doomed], order
                auth = {"Authorization": f"Bearer {TOKEN}"}
                text = httpx2.get(f"{server.base_url}/metrics", headers=auth, timeout=5).text
                assert metric(text, "budget") == 4, text

                s = doomed[0][0]
                got = await conn.ok("execute_code", command="sha256sum f.bin | wc -c", session=s)
                reset = got.get("session_reset") or {}
                assert reset.get("reason") == "workspace_removed", got
                assert reset.get("restored_from"), got  # (its snapshot, taken before removal)
                again = await conn.ok("list_files", session=s)
                assert "f.bin" in {e["path"] for e in again["entries"]}, again
                assert not again.get("session_reset"), again
                assert busy_image.exists()
                running.cancel()
    finally:
        release_disk(state)


@pytest.mark.e2e
@needs_images
async def test_without_a_store_a_removed_session_starts_afresh(tmp_path: Path) -> None:
    """The replica's budget, no snapshot store: the oldest idle workspaces go, and their
    session's next call says workspace_removed and finds an empty workspace."""
    state = tmp_path / "state"
    settings = {**SETTINGS, "SANDBOX_IDLE_WORKSPACES_MB": "5", "SANDBOX_SNAPSHOT_STORE": "none"}
    try:
        with running_server(tmp_path, **settings) as server:
            async with open_client(server.url, TOKEN, "auto") as conn:
                made = await sessions_writing(conn, state, 3, 3)
                s, newest = made[0][0], made[2]
                await eventually(
                    lambda: not made[0][1].exists() and not made[1][1].exists(),
                    40,
                    "the two oldest removed",
                )
                assert newest[1].exists()
                got = await conn.ok("list_files", session=s)
                assert got.get("session_reset", {}).get("reason") == "workspace_removed", got
                assert got["entries"] == [], got
                again = await conn.ok("write_file", path="new.txt", content="fresh", session=s)
                assert not again.get("session_reset"), again
    finally:
        release_disk(state)


@pytest.mark.e2e
@needs_images
@pytest.mark.parametrize("store", ["none", "local"])
async def test_the_budget_holds_across_a_restart(tmp_path: Path, store: str) -> None:
    """Whose each workspace is stays recorded beside it: a server started later applies the
    per-principal budget to a previous run's unmounted images (measured by their allocated
    blocks: sparse images here), oldest first. The session, forgotten by the restart, is told
    on its next call (`workspace_removed`) and, with a store, gets its files back."""
    state = tmp_path / "state"
    settings = {**SETTINGS, "SANDBOX_WORKSPACE_RESERVE": "sparse"}
    if store == "none":
        settings["SANDBOX_SNAPSHOT_STORE"] = "none"
    try:
        with running_server(tmp_path, **settings) as server:
            async with open_client(server.url, TOKEN, "auto") as conn:
                made = await sessions_writing(conn, state, 3, 3)
        assert all(i.exists() and i.with_suffix(".owner").exists() for _, i in made)
        budget = {**settings, "SANDBOX_IDLE_WORKSPACES_MB_PER_PRINCIPAL": "5"}
        with running_server(tmp_path, **budget) as server:
            await eventually(
                lambda: not made[0][1].exists() and not made[1][1].exists(),
                40,
                "the two oldest removed after the restart",
            )
            assert made[2][1].exists()
            assert not made[0][1].with_suffix(".owner").exists()
            order = removed_in_order(server.stderr_text())
            assert order == [i.with_suffix("").name for _, i in made[:2]], order
            async with open_client(server.url, TOKEN, "auto") as conn:
                got = await conn.ok("list_files", session=made[0][0])
                names = [e["path"] for e in got["entries"]]
                assert names == ([] if store == "none" else ["f.bin"]), got
                reset = got.get("session_reset") or {}
                assert reset.get("reason") == "workspace_removed", got
                assert bool(reset.get("restored_from")) == (store == "local"), got
                again = await conn.ok("list_files", session=made[0][0])
                assert not again.get("session_reset"), again
    finally:
        release_disk(state)
