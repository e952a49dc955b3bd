"""Mounted workspaces are capped per token and per replica; idle ones make room, files kept.

Each mounted workspace holds a loop device and a kernel thread: one token writing to ever new
session names made 1,424 loop devices (issue 24). Real servers with low caps, real images and
sandboxes, the official client, two tokens.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import Conn, ServerProcess, eventually, open_client, running_server

pytestmark = pytest.mark.e2e

ALICE = "caps-alice-token-1"
BOB = "caps-bob-token-2"


def session() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


def metric(server: ServerProcess, prefix: str, *labels: str) -> float:
    return server.metric(ALICE, prefix, *labels)


def mounted(server: ServerProcess, kind: str = "session") -> int:
    return int(metric(server, "srt_workspaces_mounted{", f'kind="{kind}"'))


async def loop_devices_are(server: ServerProcess, count: int) -> None:
    def settled() -> bool:
        return metric(server, "srt_workspace_loop_devices") == count

    await eventually(settled, 10, f"{count} loop devices for the workspaces")


async def write(conn: Conn, s: str, text: str) -> None:
    await conn.ok("write_file", path="f.txt", content=text, session=s)


async def read(conn: Conn, s: str) -> str:
    return str((await conn.ok("read_file", path="f.txt", session=s))["content"])


async def busy(conn: Conn, s: str) -> str:
    started: dict[str, Any] = await conn.ok("execute_code_async", command="sleep 120", session=s)
    return str(started["execution_id"])


async def test_past_a_tokens_cap_the_least_recently_used_idle_workspace_makes_room(
    tmp_path: Path,
) -> None:
    with running_server(
        tmp_path,
        SANDBOX_AUTH_TOKENS=f"alice:{ALICE},bob:{BOB}",
        SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL="2",
        SANDBOX_MAX_MOUNTED_WORKSPACES="5",
        SANDBOX_INTERPRETER_WARM="python=1",
        SANDBOX_WORKSPACE_POOL="0",  # (exact mount counts: no blanks made ahead)
    ) as server:
        await eventually(lambda: mounted(server, "slot") == 1, 60, "the warm interpreter")
        a1, a2, a3, b1, b2 = (session() for _ in range(5))
        async with open_client(server.url, ALICE, "auto") as alice:
            await write(alice, a1, "one")
            await write(alice, a2, "two")
            await write(alice, a3, "three")  # a1, least recently used, is unmounted
            assert mounted(server) == 2
            await loop_devices_are(server, 3)  # (and the warm interpreter's)
            assert await read(alice, a1) == "one", "an unmounted workspace keeps its files"
            assert await read(alice, a2) == "two"
            ran = await alice.ok("execute_code", command="cat f.txt", session=a3)
            assert "".join(e.get("data") or "" for e in ran["output"]) == "three"
            assert mounted(server) == 2
            async with open_client(server.url, BOB, "auto") as bob:
                await write(bob, b1, "b-one")
                await write(bob, b2, "b-two")  # the replica's cap of 5: 2 + 2 + the slot
                assert mounted(server) == 4 and mounted(server, "slot") == 1
                await write(alice, a1, "one again")  # alice's own LRU makes room
                assert await read(bob, b1) == "b-one" and await read(bob, b2) == "b-two"
            assert await read(alice, a1) == "one again"
            await loop_devices_are(server, 5)


async def test_when_every_workspace_is_in_use_the_call_is_refused_and_says_why(
    tmp_path: Path,
) -> None:
    with running_server(
        tmp_path,
        SANDBOX_AUTH_TOKENS=f"alice:{ALICE},bob:{BOB}",
        SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL="2",
        SANDBOX_MAX_MOUNTED_WORKSPACES="3",
        SANDBOX_INTERPRETER_WARM="python=0",
    ) as server:
        a1, a2, a3, b1, b2, b3 = (session() for _ in range(6))
        async with (
            open_client(server.url, ALICE, "auto") as alice,
            open_client(server.url, BOB, "auto") as bob,
        ):
            first = await busy(alice, a1)
            await alice.ok("run_code", code="x = 1", session=a2)  # an interpreter holds a2
            for tool, args in [
                ("write_file", {"path": "f.txt", "content": "x"}),
                ("execute_code", {"command": "true"}),
                ("run_code", {"code": "1"}),
            ]:
                refused = await alice.error(tool, session=a3, **args)
                assert "SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL" in refused, refused
            # Another token keeps working: one mount left on the replica, then bob's LRU.
            await write(bob, b1, "b-one")
            await write(bob, b2, "b-two")
            assert mounted(server) == 3
            await busy(bob, b2)
            refused = await bob.error("write_file", path="f.txt", content="x", session=b3)
            assert "SANDBOX_MAX_MOUNTED_WORKSPACES)" in refused, refused
            assert "PER_PRINCIPAL" not in refused
            assert metric(server, "srt_concurrency_rejections_total{", "principal_mounted") == 3
            assert metric(server, "srt_concurrency_rejections_total{", '"mounted_work') == 1
            # A workspace no longer in use makes room again, and keeps its files.
            await alice.ok("cancel_execution", execution_id=first, session=a1)

            async def ended() -> bool:
                info = await alice.ok("get_execution_status", execution_id=first, session=a1)
                return info["status"] == "cancelled"

            await eventually(ended, 20, "the cancelled execution to end")
            wrote = await alice.ok("write_file", path="f.txt", content="three", session=a3)
            assert not wrote.get("session_reset"), "a refused mount lost nothing"
            assert await read(bob, b1) == "b-one"
            assert await read(alice, a3) == "three"
            assert mounted(server) == 3
