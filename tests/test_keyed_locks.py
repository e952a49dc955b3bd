"""KeyedLocks: one lock per key while it is held or awaited, nothing left after."""

from __future__ import annotations

import asyncio

import pytest

from sandbox_runtime.servers.keyed_locks import KeyedLocks

pytestmark = pytest.mark.unit


async def test_a_key_is_held_by_one_at_a_time_and_forgotten_after() -> None:
    locks = KeyedLocks[str]()
    inside: list[str] = []
    most = 0

    async def hold(key: str, tag: str) -> None:
        nonlocal most
        async with locks.hold(key):
            inside.append(tag)
            most = max(most, sum(1 for t in inside if t.startswith(key)))
            await asyncio.sleep(0.01)
            inside.remove(tag)

    await asyncio.gather(*(hold("a", f"a{i}") for i in range(5)), hold("b", "b0"))
    assert most == 1  # (never two holders of one key)
    assert len(locks) == 0


async def test_endless_new_keys_leave_nothing_behind() -> None:
    locks = KeyedLocks[int]()
    for key in range(1000):
        async with locks.hold(key):
            pass
    assert len(locks) == 0


async def test_a_failure_inside_releases_and_forgets() -> None:
    locks = KeyedLocks[str]()
    with pytest.raises(RuntimeError):
        async with locks.hold("k"):
            raise RuntimeError("boom")
    assert len(locks) == 0
    async with locks.hold("k"):  # (usable again)
        pass
