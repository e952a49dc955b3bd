"""A thin workspace cannot take the state filesystem's floor through space it reserved with
fallocate (issue 41 review): blocks fallocated in a thin image are promised by its ext4 without
the host holding them, and writes into them pass the watchdog's stop (ext4's reserved
clusters stop only new allocations). A real server, real images, the official client, a small
loop-mounted state filesystem (test_disk_full.py's)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp_harness import open_client, running_server
from test_disk_full import FLOOR_MB, MIB, SETTINGS, STATE_FS_MB, TOKEN, free_bytes, state_filesystem

pytestmark = pytest.mark.e2e

RESERVE_THEN_WRITE = """
fallocate -l 200M pre && echo reserved
dd if=/dev/urandom of=pre bs=1M count=200 conv=notrunc,fsync status=none; echo "dd $?"
rm -f pre
"""
# posix_fallocate still works (glibc writes the blocks when fallocate is not supported), and
# punching a hole (which frees blocks) is allowed.
POSIX_FALLOCATE = """
import os
fd = os.open("p", os.O_CREAT | os.O_WRONLY, 0o600)
os.posix_fallocate(fd, 0, 1 << 20)
print("size", os.fstat(fd).st_size)
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    with state_filesystem(tmp_path, STATE_FS_MB) as work:
        yield work


async def test_space_reserved_by_fallocate_cannot_take_the_floor(workdir: Path) -> None:
    """A session fallocates 200 MiB of its 256 MiB thin workspace on a 256 MiB state
    filesystem that keeps 48 MiB free, then writes into it: the floor holds (what it
    reserved is either refused or really taken from the host when reserved)."""
    state = workdir / "state"
    with running_server(workdir, **SETTINGS) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            s = f"f-{uuid.uuid4().hex[:8]}"
            command = f"python3 -c '{POSIX_FALLOCATE}' && fallocate -p -o 0 -l 65536 p && echo ok"
            ran = await conn.ok("execute_code", command=command, session=s)
            said = "".join(e.get("data") or "" for e in ran["output"])
            assert "size 1048576" in said and said.endswith("ok\n"), said

            ran = await conn.ok("execute_code", command=RESERVE_THEN_WRITE, session=s,
                                timeout_seconds=120)  # fmt: skip
            os.sync()
            assert free_bytes(state) >= FLOOR_MB // 2 * MIB, (free_bytes(state), ran)
            said = "".join(e.get("data") or "" for e in ran["output"])
            assert "reserved" not in said and "Operation not supported" in said, said
