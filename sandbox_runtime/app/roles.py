"""Split roles (DESIGN §16): the placement queue an api replica asks and a worker serves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.sessions.cluster import LocalCluster, RedisCluster
from sandbox_runtime.sessions.queue import PlacementQueue, QueueMetrics
from sandbox_runtime.sessions.router import Router
from sandbox_runtime.supervisor import Supervisor

if TYPE_CHECKING:
    from sandbox_runtime.app.services import Services

API_ROLE = "this replica's role is api: its sessions run on workers"


def placement_queue(settings: Settings, cluster: LocalCluster) -> PlacementQueue | None:
    """The placement queue of split roles (None: role all)."""
    if settings.role == "all" or not isinstance(cluster, RedisCluster):
        return None
    from sandbox_runtime.state.redis_store import redis_client

    # A client of its own: its reads block (BLPOP, XREADGROUP) longer than the store's timeout.
    wait = settings.placement_wait_seconds
    redis = redis_client(
        settings.redis_url or "",
        decode_responses=True,
        socket_connect_timeout=2.0,
        socket_timeout=max(wait, 2.0) + 5.0,
    )
    return PlacementQueue(redis, "", settings.replica_id, wait, cluster.signer)


def serve_placements(
    settings: Settings,
    supervisor: Supervisor,
    queue: PlacementQueue,
    router: Router,
    services: Services,
) -> None:
    """A worker takes new sessions from the queue while it has room for more (none once it
    is stopping); an api replica reports the queue's depth for autoscalers."""
    metrics = QueueMetrics(router.metrics.registry)
    if settings.role == "api":

        async def measure() -> None:
            depth, oldest = await queue.depth()
            metrics.depth.set(depth)
            metrics.oldest.set(oldest)

        supervisor.every("placement queue depth", 5.0, measure, at_once=True)
        return

    def homed() -> int:
        return len(router.placements.homed_at(settings.replica_id))

    async def take(owner: Owner) -> str:
        return (await router.place(owner)).home

    def has_room() -> bool:
        accepting = router.manager.accepting and not services.stopping.is_set()
        accepting = accepting and router.cluster.evicted is None  # (fenced for good)
        return accepting and homed() < settings.worker_max_sessions

    metrics.sessions.set_function(homed)
    metrics.capacity.set(settings.worker_max_sessions)
    router.cluster.capacity = lambda: {
        "sessions": homed(),
        "capacity": settings.worker_max_sessions,
    }
    supervisor.run("placements", lambda: queue.serve(take, has_room))
