"""Quota escapes in project mode (issue 41 review): whatever a sandbox can write lands in a
place a quota bounds. On a loop-mounted btrfs with quotas (as test_workspace_quota.py), a real
server, real sandboxes, the official client."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopfs_harness import loop_filesystem
from mcp_harness import open_client, running_server

pytestmark = pytest.mark.e2e

TOKEN = "quota-escapes-token-0123"
MIB = 1024 * 1024
SETTINGS = {
    "SANDBOX_AUTH_TOKEN": TOKEN,
    "SANDBOX_WORKSPACE_MB": "16",
    "SANDBOX_WORKSPACE_QUOTA": "project",
    "SANDBOX_MIN_FREE_DISK_MB": "16",
    "SANDBOX_INTERPRETER_WARM": "python=0",
}
FILL_KERNEL_DIR = """
import os
written = 0
try:
    with open('/run/srt-kernel/fill', 'wb') as f:
        for _ in range(48):
            f.write(b'x' * (1 << 20))
            written += 1 << 20
        f.flush()
        os.fsync(f.fileno())
except OSError as exc:
    print('refused', exc.errno)
print('written', written >> 20)
"""


@pytest.fixture(scope="module")
def quotafs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with loop_filesystem(tmp_path_factory.mktemp("escapes"), "btrfs", 1024) as point:
        yield point


def stdout_of(ran: dict[str, object]) -> str:
    output = ran["output"]
    assert isinstance(output, list)
    return "".join(e.get("data") or "" for e in output if e.get("type") == "stdout")


async def test_an_interpreter_cannot_write_past_its_quota_beside_its_workspace(
    quotafs: Path,
) -> None:
    """An interpreter's kernel directory (bound writable at /run/srt-kernel for its sockets)
    holds no more than a few MiB: writing 48 MiB there is refused, not taken from the shared
    state filesystem beside the workspace's 16 MiB quota."""
    with running_server(quotafs / uuid.uuid4().hex[:8], **SETTINGS) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            s = f"e-{uuid.uuid4().hex[:8]}"
            ran = await conn.ok("run_code", code=FILL_KERNEL_DIR, session=s)
            out = stdout_of(ran)
            assert "refused" in out, out
            written = int(out.split("written")[1].split()[0])
            assert written <= 4, out
            kernels = server.state_dir / "kernels"
            held = sum(p.stat().st_size for p in kernels.rglob("*") if p.is_file())
            assert held < 8 * MIB, held


async def test_a_workspace_being_removed_over_a_budget_is_not_handed_out(quotafs: Path) -> None:
    """While the byte budget removes an idle workspace (its lock held, waiting for what must
    end before a release), a call for that session waits for the removal and gets a fresh
    workspace: it is never handed the one being destroyed under it."""
    from sandbox_runtime.workspaces.store import WorkspaceStore

    root = quotafs / uuid.uuid4().hex[:8] / "workspaces"
    store = WorkspaceStore(root, size_mb=16, inodes=4096, quota="project",
                           retention_seconds=3600, idle_budget_mb=1,
                           idle_after_seconds=0)  # fmt: skip
    store.start(os.geteuid(), os.getegid())
    assert store.mode == "project"
    path, _ = await store.ensure("ws-a")
    (path / "old.bin").write_bytes(os.urandom(2 * MIB))
    os.sync()
    entered, gate = asyncio.Event(), asyncio.Event()

    async def releasing(name: str) -> None:  # (a sandbox started ahead of need ending)
        entered.set()
        await gate.wait()

    store.before_release.append(releasing)
    removal = asyncio.create_task(store.apply_budgets())
    await asyncio.wait_for(entered.wait(), 30)
    ensuring = asyncio.create_task(store.ensure("ws-a"))
    await asyncio.sleep(0.2)
    handed_early = ensuring.done()
    gate.set()
    assert await removal == 1
    path, existed = await ensuring
    assert not handed_early, "ensure returned the workspace while it was being removed"
    assert not existed and not (path / "old.bin").exists()
    await store.remove("ws-a")


async def test_copies_inside_a_workspace_count_against_its_quota(quotafs: Path) -> None:
    """btrfs counts an extent once per subvolume however many files share it: copies made by
    reflink (copy_file_range shares extents on btrfs) would hold ten times the quota in files
    for the quota's count of one, and no snapshot could keep them (restored, they need ten
    times the quota). Copies are real copies: `cp` of 3 MiB ten times meets the 16 MiB quota,
    and the workspace's snapshot is taken."""
    copies = "head -c 3000000 /dev/urandom > a; for i in 1 2 3 4 5 6 7 8 9 10; do cp a c$i; done"
    with running_server(quotafs / uuid.uuid4().hex[:8], **SETTINGS) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            s = f"e-{uuid.uuid4().hex[:8]}"
            ran = await conn.ok("execute_code", command=f"{copies}; du -sb --apparent-size .",
                                session=s)  # fmt: skip
            said = "".join(e.get("data") or "" for e in ran["output"])
            assert "Disk quota exceeded" in said, said
            held = int(stdout_of(ran).split()[0])
            assert held <= 16 * MIB, said
            taken = await conn.ok("snapshot_session", session=s)
            assert taken["snapshot_id"], taken
