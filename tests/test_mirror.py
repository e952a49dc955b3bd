"""The mirror's reaction to a store that lost what it wrote (its heartbeat gone)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from mcp_harness import eventually

from sandbox_runtime.sessions.mirror import Mirror
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
