"""The split deployment (DESIGN §16) as real processes: a redis-server, api replicas and
worker replicas (each its own state dir, as separate machines), and nginx with the shipped
round-robin config (deploy/nginx/split.conf) in front of the api replicas."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mcp_harness import ServerProcess, Servers, free_port, replica_process, stop_all
from nginx_harness import ROOT, Nginx, main_config
from redis_harness import RedisServer

TOKEN = "split-test-token-0123456789"
SPLIT_CONF = ROOT / "deploy" / "nginx" / "split.conf"


def worker_process(workdir: Path, redis: RedisServer, name: str, **settings: str) -> ServerProcess:
    """A worker (not started): it listens only on its cluster port, which is the harness's
    port (its probes are there). It lets what runs finish for 5 s on SIGTERM, not 60: a test
    that failed with an execution still running must not fail its teardown too (the harness
    waits 20 s); the tests of draining say how long."""
    settings = {"SANDBOX_WORKER_DRAIN_SECONDS": "5", **settings}
    server = replica_process(workdir, redis.url, name, TOKEN, SANDBOX_ROLE="worker", **settings)
    server.settings.update(SANDBOX_CLUSTER_PORT=str(server.port), SANDBOX_PORT=str(free_port()))
    return server


def api_process(workdir: Path, redis: RedisServer, name: str, **settings: str) -> ServerProcess:
    return replica_process(workdir, redis.url, name, TOKEN, SANDBOX_ROLE="api", **settings)


def split_site(listen: str, apis: list[str]) -> str:
    """deploy/nginx/split.conf with this run's listen address and api replicas."""
    text = SPLIT_CONF.read_text()
    servers = "\n".join(f"    server {a} max_fails=1 fail_timeout=5s;" for a in apis)
    text, count = re.subn(r"(?m)^    server api\d+:8080[^\n]*\n(    server api\d+:8080[^\n]*\n)*",
                          servers + "\n", text)  # fmt: skip
    assert count == 1, "split.conf's upstream servers were not found"
    text, count = re.subn(r"(?m)^    listen 8080;", f"    listen {listen};", text)
    assert count == 1, "split.conf's listen line was not found"
    return text


class SplitNginx(Nginx):
    def __init__(self, directory: Path, port: int, apis: list[str]) -> None:
        self.directory = directory
        self.port = port
        directory.mkdir(parents=True, exist_ok=True)
        self.site = directory / "split.conf"
        self.site.write_text(split_site(f"127.0.0.1:{port}", apis))
        self.conf = main_config(directory, self.site)
        self.proc = None


@dataclass
class Split:
    redis: RedisServer
    apis: list[ServerProcess]
    workers: list[ServerProcess]
    nginx: SplitNginx
    servers: Servers

    def add_worker(self, name: str, **settings: str) -> ServerProcess:
        workdir = self.workers[0].workdir.parent if self.workers else self.apis[0].workdir.parent
        server = worker_process(workdir, self.redis, name, **settings)
        self.servers.add(server, healthy=False)
        self.workers.append(server)
        return server


@contextlib.contextmanager
def running_split(
    tmp_path: Path, apis: int = 2, workers: int = 2, **settings: str
) -> Iterator[Split]:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    suffix = uuid.uuid4().hex[:4]
    api_list = [api_process(tmp_path, redis, f"api{i}{suffix}", **settings) for i in range(apis)]
    worker_list = [
        worker_process(tmp_path, redis, f"wk{i}{suffix}", **settings) for i in range(workers)
    ]
    servers = Servers(lambda name: tmp_path / name, release=True)
    nginx: SplitNginx | None = None
    try:
        with ThreadPoolExecutor(apis + workers) as pool:
            list(pool.map(lambda s: servers.add(s, healthy=False), worker_list + api_list))
        nginx = SplitNginx(
            tmp_path / "nginx", free_port(), [f"127.0.0.1:{s.port}" for s in api_list]
        ).start()
        yield Split(redis, api_list, worker_list, nginx, servers)
    finally:
        stop_all(*([nginx.stop] if nginx is not None else []), servers.close, redis.stop)
