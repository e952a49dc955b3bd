"""The mirror's reaction to a store that lost what it wrote (its heartbeat gone), and to a
replica id whose heartbeat is another process's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from mcp_harness import eventually
from redis_harness import RedisServer

from sandbox_runtime.sessions.flushes import Flushes
from sandbox_runtime.sessions.mirror import Mirror
from sandbox_runtime.state.keys import Keys
from sandbox_runtime.state.redis_store import RedisStore
from sandbox_runtime.state.store import MemoryStore


@contextlib.asynccontextmanager
async def mirror_on(store: MemoryStore, hook: Callable[[], object]) -> AsyncIterator[Mirror]:
    """A running mirror of replica r1 that beats every 20 ms, once its first beat is in."""
    mirror = Mirror(
        store,
        "r1",
        session_key=lambda e: "alice:s",
        heartbeat_payload=lambda: {"replica_id": "r1"},
        heartbeat_ttl=30,
        on_store_lost=hook,
    )
    mirror.heartbeat_interval = 0.02
    mirror.start()
    try:
        await eventually(lambda: mirror.connected, 5, "the first heartbeat")
        yield mirror
    finally:
        await mirror.stop()


async def test_a_vanished_heartbeat_runs_the_loss_hooks_each_time_and_only_then() -> None:
    store = MemoryStore(ttl_seconds=60, max_events=50)
    calls: list[int] = []
    async with mirror_on(store, lambda: calls.append(1)):
        await asyncio.sleep(0.2)  # several beats
        assert calls == [], "the first beat finds no heartbeat: that is no loss"
        await store.drop_replica("r1")  # as a store restarted empty
        await eventually(lambda: len(calls) == 1, 5, "the hooks after the loss")
        await store.drop_replica("r1")
        await eventually(lambda: len(calls) == 2, 5, "the hooks after a second loss")


async def test_a_failing_loss_hook_does_not_stop_the_heartbeat() -> None:
    store = MemoryStore(ttl_seconds=60, max_events=50)
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise RuntimeError("hook failed")

    async with mirror_on(store, failing) as mirror:
        await store.drop_replica("r1")
        await eventually(lambda: len(calls) == 1, 5, "the failing hook")
        await store.drop_replica("r1")
        await eventually(lambda: len(calls) == 2, 5, "the heartbeat still beating")
        assert mirror.connected and await store.replica_alive("r1")


class FlakyStore(MemoryStore):
    """An in-memory store whose heartbeats fail while `down` (Redis out of reach)."""

    down = False

    async def heartbeat(self, replica_id: str, payload: dict[str, object], ttl: int) -> bool:
        if self.down:
            raise ConnectionError("store unreachable")
        return await super().heartbeat(replica_id, payload, ttl)


async def test_coming_back_after_an_outage_runs_the_loss_hooks_once() -> None:
    """Back after an outage the store may have lost what we wrote, heartbeat or not."""
    store = FlakyStore(ttl_seconds=60, max_events=50)
    calls: list[int] = []
    async with mirror_on(store, lambda: calls.append(1)) as mirror:
        store.down = True
        await eventually(lambda: not mirror.connected, 5, "the outage noticed")
        assert calls == []
        store.down = False  # (its heartbeat is still there: the outage was short)
        await eventually(lambda: mirror.connected, 5, "reconnected")
        await asyncio.sleep(0.2)
        assert calls == [1]


def beat_of(incarnation: str) -> dict[str, Any]:
    return {"replica_id": "w1", "incarnation": incarnation, "last_seen": time.time()}


@contextlib.asynccontextmanager
async def restarted_while_redis_is_slow(redis_server: RedisServer) -> AsyncIterator[Mirror]:
    """A new process (incarnation `new`) of replica w1 whose first contact with the store
    times out (Redis paused), then beats every 50 ms (heartbeat TTL 2 s)."""
    store = RedisStore(redis_server.url, timeout=0.3)
    mirror = Mirror(
        store,
        "w1",
        session_key=lambda e: "alice:s",
        heartbeat_payload=lambda: beat_of("new"),
        heartbeat_ttl=2,
    )
    mirror.heartbeat_interval = 0.05
    redis_server.cli("CLIENT", "PAUSE", "700", "ALL")
    await mirror.take_id()  # (times out: serves, beats later)
    assert not mirror.connected and not mirror.beaten.is_set() and mirror.evicted is None
    mirror.start()
    try:
        yield mirror
    finally:
        await mirror.stop()
        redis_server.cli("DEL", Keys().replica("w1"))


async def test_a_restart_whose_first_contact_fails_takes_the_id_when_the_dead_ones_beat_expires(
    redis_server: RedisServer,
) -> None:
    """SIGKILLed and restarted at once: the dead process's heartbeat (TTL 2 s) refuses the
    first beats, then expires; the new process is not fenced by it."""
    dead = RedisStore(redis_server.url)
    await dead.heartbeat("w1", beat_of("dead"), 2)
    async with restarted_while_redis_is_slow(redis_server) as mirror:
        await eventually(lambda: mirror.beaten.is_set(), 10, "the id taken")
        assert mirror.evicted is None and mirror.connected
        assert (await dead.replica_beat("w1") or {}).get("incarnation") == "new"
    await dead.aclose()


async def test_a_restart_whose_first_contact_fails_is_refused_while_the_id_is_renewed(
    redis_server: RedisServer,
) -> None:
    """Another live process beats under the same id: refused (fenced), the other unharmed."""
    live = RedisStore(redis_server.url)
    await live.heartbeat("w1", beat_of("live"), 2)
    async with restarted_while_redis_is_slow(redis_server) as mirror:
        deadline = time.monotonic() + 10
        while mirror.evicted is None and time.monotonic() < deadline:
            await live.heartbeat("w1", beat_of("live"), 2)  # (the live one renews its beat)
            await asyncio.sleep(0.1)
        assert mirror.evicted is not None and "in use by another live process" in mirror.evicted
        assert not mirror.beaten.is_set()
        assert (await live.replica_beat("w1") or {}).get("incarnation") == "live"
    await live.aclose()


async def test_a_missing_heartbeat_means_a_dead_replica_only_once_the_store_has_settled() -> None:
    """Back from an outage with its data, the store has let every heartbeat expire: until it
    has been reachable for a heartbeat TTL (each replica beats again within it), a reader must
    not take another replica's running executions for lost (sessions/elsewhere.py)."""
    store = FlakyStore(ttl_seconds=60, max_events=50)
    mirror = Mirror(
        store,
        "r1",
        session_key=lambda e: "alice:s",
        heartbeat_payload=lambda: {"replica_id": "r1"},
        heartbeat_ttl=1,
    )
    mirror.heartbeat_interval = 0.02
    assert not mirror.settled()  # (never reached yet)
    mirror.start()
    try:
        await eventually(lambda: mirror.connected, 5, "the first heartbeat")
        assert mirror.settled()  # (a first contact is no return from an outage)
        store.down = True
        await eventually(lambda: not mirror.connected, 5, "the outage noticed")
        assert not mirror.settled()
        store.down = False
        await eventually(lambda: mirror.connected, 5, "the store back")
        assert not mirror.settled()
        await eventually(mirror.settled, 5, "settled again")
    finally:
        await mirror.stop()


# -- a call waiting for the store's write (sessions/flushes.py, sessions/written.py) ----------


@pytest.mark.unit
async def test_a_waiting_call_cuts_the_pause_between_flushes_short() -> None:
    flushes = Flushes()
    pausing = asyncio.create_task(flushes.pause(60))
    await asyncio.sleep(0.01)
    assert not pausing.done()
    flushes.hurry()
    await asyncio.wait_for(pausing, 5)
    with pytest.raises(TimeoutError):  # (that hurry is spent: the next pause is whole again)
        await asyncio.wait_for(flushes.pause(60), 0.05)


@pytest.mark.unit
async def test_the_end_of_a_flush_wakes_its_waiters_whatever_its_outcome() -> None:
    flushes = Flushes()
    ended = flushes.next_end()
    assert await flushes.around(asyncio.sleep(0, "ok")) == "ok"
    assert ended.is_set() and not flushes.next_end().is_set()
    assert (flushes.begun, flushes.written) == (1, 1)

    async def refused() -> None:
        raise ConnectionError("the store is down")

    ended = flushes.next_end()
    with pytest.raises(ConnectionError):
        await flushes.around(refused())
    assert ended.is_set() and not flushes.next_end().is_set()
    assert (flushes.begun, flushes.written) == (2, 1)  # (begun, never written)
