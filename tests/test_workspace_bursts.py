"""New sessions in bursts: the blank-workspace pool grows with demand within its bound
(SANDBOX_WORKSPACE_POOL_MAX), a blank carries a sandbox started ahead so that a new session's
first call finds one waiting, and the server gives everything back at its end (no mount, loop
device, blank or sandbox left).

A real server with workspace images (root, loop devices), real bwrap, the official client.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from mcp_harness import ServerProcess, Servers, alive, eventually, open_client

from sandbox_runtime.workspaces.blanks import peak
from sandbox_runtime.workspaces.images import loop_devices_under, mounts_under

TOKEN = "bursts-token-1"
FLOOR, BOUND = 2, 6
HITS = "srt_sandbox_pool_hits_total"
MISSES = "srt_sandbox_pool_misses_total"


def blanks(server: ServerProcess) -> list[Path]:
    return sorted((server.state_dir / "workspaces").glob("blank-*.img"))


def wait_for(check, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


@pytest.mark.unit
def test_the_demand_is_the_most_arrivals_within_a_window() -> None:
    assert peak([], since=0.0) == 0
    assert peak([1.0, 5.0, 9.0], since=0.0, window=0.25) == 1
    burst = [10.0 + i * 0.01 for i in range(12)]
    assert peak([1.0, 1.1, *burst, 20.0], since=0.0, window=0.25) == 12
    assert peak([1.0, 1.1, *burst, 20.0], since=15.0, window=0.25) == 1  # (forgotten)


@pytest.mark.e2e
async def test_a_burst_grows_the_pool_within_its_bound_and_gives_it_all_back(
    serve: Servers,
) -> None:
    server = serve(
        "bursts",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_WORKSPACE_MB="64",
        SANDBOX_WORKSPACE_POOL=str(FLOOR),
        SANDBOX_WORKSPACE_POOL_MAX=str(BOUND),
        SANDBOX_MAX_CONCURRENT="64",
    )
    wait_for(lambda: len(blanks(server)) == FLOOR)
    names = [f"burst-{i}-{uuid.uuid4().hex[:6]}" for i in range(3 * BOUND)]
    async with AsyncExitStack() as stack:
        conns = [await stack.enter_async_context(open_client(server.url, TOKEN)) for _ in range(6)]
        results = await asyncio.gather(
            *(
                conns[i % len(conns)].ok(
                    "execute_code", command=f"echo {n} > mine; ls -A", session=n
                )
                for i, n in enumerate(names)
            )
        )
        # Each new session has its own empty workspace, whether it took a blank or not.
        assert [r["output"][1]["data"] for r in results] == ["mine\n"] * len(names)

        # The pool grows past its floor with the burst, never past its bound.
        seen: list[int] = []

        def grown() -> bool:
            seen.append(len(blanks(server)))
            return seen[-1] > FLOOR

        await eventually(grown, 30, "the blank pool to grow past its floor", 0.05)
        for _ in range(20):
            seen.append(len(blanks(server)))
            await asyncio.sleep(0.05)
        assert max(seen) <= BOUND, seen

        # A new session's first call finds a sandbox started ahead in its blank: a hit where
        # a first call would otherwise miss ("empty"). (Blanks being made may not have theirs
        # yet: a few tries.)
        conn = conns[0]
        for attempt in range(20):
            hits, empty = server.metric(TOKEN, HITS), server.metric(TOKEN, MISSES, '"empty"')
            fresh = f"fresh-{attempt}-{uuid.uuid4().hex[:6]}"
            done = await conn.ok("execute_code", command="ls -A; echo hi", session=fresh)
            stdout = "".join(e["data"] for e in done["output"] if e["type"] == "stdout")
            assert (done["exit_code"], stdout) == (0, "hi\n")  # (its workspace empty)
            if server.metric(TOKEN, HITS) == hits + 1:
                assert server.metric(TOKEN, MISSES, '"empty"') == empty
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("no new session's first call found a sandbox waiting")
        for name in names[:3]:  # (and the sessions keep their own files)
            read = await conn.ok("execute_code", command="cat mine", session=name)
            assert read["output"][1]["data"] == f"{name}\n"

    below = server.descendants()
    root = server.state_dir / "workspaces"
    server.stop()  # (asserts a clean exit)
    assert mounts_under(root) == []
    assert blanks(server) == []
    assert [pid for pid, started in below if alive(pid, started)] == []
    # (A loop device goes once the kernel has let its filesystem go: soon after, not at once.)
    wait_for(lambda: loop_devices_under(root) == 0)
