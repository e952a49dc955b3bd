"""The placement queue against a real redis-server: what a writer to Redis can put in it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from mcp_harness import eventually
from redis_harness import RedisServer

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.sessions.queue import SIGNED_FIELDS, PlacementQueue
from sandbox_runtime.sessions.signing import ClusterSigner
from sandbox_runtime.state.redis_store import redis_client

pytestmark = pytest.mark.integration

SECRET = "a-cluster-secret-of-some-length"


async def test_a_placement_request_whose_mac_is_not_ascii_is_refused_and_serving_goes_on(
    redis_server: RedisServer,
) -> None:
    redis = redis_client(redis_server.url, decode_responses=True, socket_timeout=10)
    queue = PlacementQueue(redis, "t1:", "w1", 5, ClusterSigner(SECRET, "w1"))
    api = PlacementQueue(redis, "t1:", "api1", 5, ClusterSigner(SECRET, "api1"))
    taken: list[Owner] = []

    async def take(owner: Owner) -> str:
        taken.append(owner)
        return "w1"

    serving = asyncio.get_running_loop().create_task(queue.serve(take, lambda: True))
    try:
        fields = dict(
            zip(
                SIGNED_FIELDS,
                ("bob", "s:one", "t1:srt:placement-reply:x", "0", "5", "f"),
                strict=True,
            )
        )
        await redis.xadd(queue.stream, {**fields, "mac": "é" * 64})  # a forger's MAC
        await eventually(lambda: queue.refused == 1, 10, "the forged request refused")
        assert await api.place(Owner("bob", "s:two")) == "w1"  # (the loop still serves)
        assert taken == [Owner("bob", "s:two")] and not serving.done()
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await redis.delete(queue.stream)
        await redis.aclose()
