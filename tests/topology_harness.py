"""The deployed topology with real parts: nginx (shipped config), N replicas, redis-server.

Each replica has a state directory of its own, as on separate machines: a session's
workspace exists only on its home replica.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2
from mcp_harness import CLUSTER_SECRET, ServerProcess, Servers, free_port, stop_all
from nginx_harness import Nginx
from redis_harness import RedisServer

TOKEN = "topology-test-token-42"


@dataclass
class Topology:
    redis: RedisServer
    replicas: dict[str, ServerProcess]
    nginx: Nginx

    def replica_of(self, execution_id: str, within: float = 5.0) -> str:
        """The replica that runs the execution, from its record in Redis (the mirror writes it
        a few ms after the call that started it may have answered: waited for)."""
        deadline = time.monotonic() + within
        while not (raw := self.redis.cli_raw("get", f"execution:{execution_id}").strip()):
            assert time.monotonic() < deadline, f"execution {execution_id} not in Redis"
            time.sleep(0.02)
        return str(json.loads(raw)["replica_id"])

    def home_of(self, principal: str, session: str) -> str | None:
        """The home replica recorded for a named session (`session` argument or URL path)."""
        home = self.redis.cli_raw("hget", f"session:{principal}:s:{session}:home", "home")
        return home.strip() or None

    def session_url(self, session: str) -> str:
        return f"http://127.0.0.1:{self.nginx.port}/s/{session}/mcp"

    def metric(self, rid: str, name: str) -> float:
        """The sum of a metric's samples (every label) on one replica."""
        server = self.replicas[rid]
        text = httpx2.get(
            f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
        ).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def replica_server(workdir: Path, redis: RedisServer, rid: str, **settings: str) -> ServerProcess:
    return ServerProcess(
        workdir / rid,
        {
            "SANDBOX_AUTH_TOKEN": TOKEN,
            "REDIS_URL": redis.url,
            "SANDBOX_REPLICA_ID": rid,
            "SANDBOX_HEARTBEAT_TTL": "3",
            "SANDBOX_SHUTDOWN_GRACE": "2",
            "SANDBOX_CLUSTER_SECRET": CLUSTER_SECRET,
            **settings,
        },
    )


@contextlib.contextmanager
def running_topology(
    tmp_path: Path, count: int = 3, nginx_port: int | None = None, **settings: str
) -> Iterator[Topology]:
    """redis-server, `count` replicas (each its own state dir) and nginx with the shipped
    config (on `nginx_port` when the replicas' settings must name the public URL, e.g. their
    OAuth resource); everything stopped at the end (and asserted stopped)."""
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    suffix = uuid.uuid4().hex[:4]
    rids = [f"t{i}{suffix}" for i in range(1, count + 1)]
    replicas = {rid: replica_server(tmp_path, redis, rid, **settings) for rid in rids}
    dirs = [s.state_dir for s in replicas.values()]
    assert len(set(dirs)) == len(dirs), "replicas must not share a state directory"
    servers = Servers(lambda name: tmp_path / name, release=True)
    nginx: Nginx | None = None
    try:
        with ThreadPoolExecutor(count) as pool:
            # (not asserted healthy: a replica may not have reached Redis yet)
            list(pool.map(lambda s: servers.add(s, healthy=False), replicas.values()))
        nginx = Nginx(
            tmp_path / "nginx",
            nginx_port or free_port(),
            [f"{rid}=127.0.0.1:{s.port}" for rid, s in replicas.items()],
        ).start()
        yield Topology(redis, replicas, nginx)
    finally:
        stop_all(*([nginx.stop] if nginx is not None else []), servers.close, redis.stop)
    for server in replicas.values():
        assert server.proc is None or server.proc.poll() is not None
