"""The snapshot slots (snapshots/gates.py FairSlots) on their own: one principal never holds
them all, a slot that comes free goes to the principals waiting in turn, and a wait ends at
the caller's deadline with a clear error (and takes nothing with it). Pure asyncio: the
end-to-end latency under load is in tests/test_snapshot_takeovers.py."""

from __future__ import annotations

import asyncio

import pytest

from sandbox_runtime.errors import LimitExceededError
from sandbox_runtime.snapshots.gates import FairSlots, SlotsBusyError

pytestmark = pytest.mark.unit


async def _held_until(slots: FairSlots, principal: str, release: asyncio.Event, log: list) -> None:
    async with slots.hold(principal):
        log.append(principal)
        await release.wait()


async def test_one_principal_leaves_a_slot_for_another() -> None:
    slots = FairSlots(3, 2)
    release = asyncio.Event()
    started: list[str] = []
    alice = [asyncio.create_task(_held_until(slots, "alice", release, started)) for _ in range(5)]
    await asyncio.sleep(0)
    assert started == ["alice", "alice"], "alice holds her two, no more"
    async with asyncio.timeout(1):  # (at once: the third slot is free for anyone else)
        async with slots.hold("bob"):
            assert slots.held("bob") == 1 and slots.held("alice") == 2
    release.set()
    await asyncio.gather(*alice)
    assert slots.held("alice") == 0


async def test_a_freed_slot_goes_to_the_principals_waiting_in_turn() -> None:
    slots = FairSlots(1, 1)
    order: list[str] = []
    gate = asyncio.Event()

    async def one(principal: str) -> None:
        async with slots.hold(principal):
            order.append(principal)
            await gate.wait()

    first = asyncio.create_task(one("alice"))
    await asyncio.sleep(0)
    queued = [asyncio.create_task(one("alice")) for _ in range(3)]
    await asyncio.sleep(0)
    queued += [asyncio.create_task(one(p)) for p in ("bob", "carol")]
    await asyncio.sleep(0)
    gate.set()  # (each holder then lets go at once)
    await asyncio.gather(first, *queued)
    # alice asked four times before bob and carol asked once: they are not behind all of hers
    assert order == ["alice", "alice", "bob", "carol", "alice", "alice"], order


async def test_a_wait_ends_at_the_deadline_and_takes_nothing() -> None:
    slots = FairSlots(1, 1)
    release = asyncio.Event()
    log: list[str] = []
    holder = asyncio.create_task(_held_until(slots, "alice", release, log))
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(SlotsBusyError, match="snapshot slots stayed busy") as raised:
        async with slots.hold("bob", loop.time() + 0.2):
            pytest.fail("bob got a slot that was not free")
    assert isinstance(raised.value, LimitExceededError)
    assert 0.15 <= loop.time() - started < 2
    assert slots.held("bob") == 0
    release.set()
    await holder
    async with asyncio.timeout(1), slots.hold("bob", loop.time() + 0.2):  # (free again)
        assert slots.held("bob") == 1


async def test_a_waiter_cancelled_as_it_is_granted_hands_the_slot_on() -> None:
    slots = FairSlots(1, 1)
    release = asyncio.Event()
    log: list[str] = []
    holder = asyncio.create_task(_held_until(slots, "alice", release, log))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(_held_until(slots, "bob", asyncio.Event(), log))
    third = asyncio.create_task(_held_until(slots, "carol", release, log))
    await asyncio.sleep(0)
    release.set()
    await holder  # (grants bob's waiter) ...
    waiter.cancel()  # ... who gives up before running
    with pytest.raises(asyncio.CancelledError):
        await waiter
    async with asyncio.timeout(1):
        await third
    assert "carol" in log and slots.held("bob") == 0 and slots.held("carol") == 0


async def test_a_waiter_cancelled_before_its_task_runs_is_skipped() -> None:
    """A waiter whose future is cancelled (its deadline passed) while a slot is freed, before
    its task has run to take itself out of the queue: the slot goes to the next one."""
    slots = FairSlots(1, 1)
    release = asyncio.Event()
    log: list[str] = []
    holder = asyncio.create_task(_held_until(slots, "alice", release, log))
    await asyncio.sleep(0)
    gone = asyncio.create_task(_held_until(slots, "bob", asyncio.Event(), log))
    after = asyncio.create_task(_held_until(slots, "carol", asyncio.Event(), log))
    await asyncio.sleep(0)
    release.set()  # (alice's task is woken first ...)
    gone.cancel()  # (... bob's future is cancelled at once, his task runs after hers)
    await holder  # (frees the slot while bob's cancelled future is still queued)
    with pytest.raises(asyncio.CancelledError):
        await gone
    await asyncio.sleep(0)
    assert log == ["alice", "carol"] and slots.held("carol") == 1 and slots.held("bob") == 0
    after.cancel()
    with pytest.raises(asyncio.CancelledError):
        await after
    assert slots.held("carol") == 0
