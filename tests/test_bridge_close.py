"""Closing code mode's bridge never waits on a call for long: a call that does not end when
cancelled (a server's write that ignores it) is left to end on its own after CLOSE_GRACE, so
the sandbox's end, and its execution's, come on time."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from sandbox_runtime.servers.bridge import CLOSE_GRACE, SOCKET_NAME, Bridge
from sandbox_runtime.servers.catalog import Entry

pytestmark = pytest.mark.integration


async def test_closing_a_bridge_leaves_a_call_that_ignores_its_cancel(tmp_path: Path) -> None:
    entered, release = asyncio.Event(), asyncio.Event()
    cancels = 0

    async def stubborn(entry: Entry, method: str, params: dict[str, Any], _: Any) -> Any:
        nonlocal cancels
        entered.set()
        while True:
            try:
                await release.wait()
                return {"result": {"content": [], "isError": False}}
            except asyncio.CancelledError:
                cancels += 1  # (ignored, as a write stuck under a shield would)

    # (This test's own bound, whatever the bridge does: the call gives up at last.)
    asyncio.get_running_loop().call_later(CLOSE_GRACE + 8, release.set)
    bridge = Bridge(tmp_path / "bridge", {"stuck": Entry(name="stuck", command=("x",))}, stubborn)
    await bridge.start()
    reader, writer = await asyncio.open_unix_connection(str(bridge.directory / SOCKET_NAME))
    try:
        body = json.dumps({"op": "call", "server": "stuck", "tool": "t", "arguments": {}})
        writer.write(struct.pack(">I", len(body)) + body.encode())
        await asyncio.wait_for(entered.wait(), 5)
        started = time.monotonic()
        await asyncio.wait_for(bridge.aclose(), CLOSE_GRACE + 5)
        took = time.monotonic() - started
        print(f"the bridge closed in {took:.2f} s, its call left running")
        assert cancels == 1
        assert CLOSE_GRACE - 0.1 < took < CLOSE_GRACE + 1, took
        assert not (bridge.directory / SOCKET_NAME).exists()
        release.set()  # (the call ends on its own, and its connection with it)
        assert await asyncio.wait_for(reader.read(), 5) != b""
    finally:
        writer.close()
