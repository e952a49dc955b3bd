"""The composition root: the one place where the process's parts are built and wired.

Read top to bottom, `build` says how the program is put together:

    Settings
      ├─ Supervisor            every background loop of every part below, named, under one
      │                        policy; stopped last
      └─ ExecutionManager      one per process for its whole life: sandboxes (backend, pool,
         │                     cgroups), workspaces, the egress proxy, the Redis mirror
         ├─ InterpreterManager run_code's kernels, over the manager
         ├─ FileUrlSigner      the key of signed file URLs
         ├─ Router             sessions' homes, forwarding to them, control of other
         │                     replicas' executions; runs the session-bound operations
         │                     (sessions.operations) with the Parts above
         └─ ClockWatch         (with Redis) the replicas' clocks, for /health

Each part gets what it needs in its constructor. They are started in that order inside an
AsyncExitStack and closed in reverse when the server stops. The HTTP edge (server/) reaches
them through a `Root`, which the ASGI lifespan fills: no part is a module global.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sandbox_runtime.config import Settings
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.files.urls import FileUrlSigner, url_key
from sandbox_runtime.interpreters.manager import InterpreterManager
from sandbox_runtime.sessions.clock import ClockWatch
from sandbox_runtime.sessions.operations import Parts
from sandbox_runtime.sessions.router import Router
from sandbox_runtime.supervisor import Supervisor


@dataclass(frozen=True)
class Services:
    """The process's running parts."""

    settings: Settings
    supervisor: Supervisor
    manager: ExecutionManager
    interpreters: InterpreterManager
    signer: FileUrlSigner
    router: Router
    clock: ClockWatch | None


@contextlib.asynccontextmanager
async def build(
    settings: Settings, manager: ExecutionManager | None = None, cluster_address: str = ""
) -> AsyncIterator[Services]:
    """Build and start the parts in dependency order; stop them in reverse on the way out.

    `manager`: one built by the caller (the CLI builds it before binding the cluster port).
    """
    async with contextlib.AsyncExitStack() as stack:
        # Closed last of all: whatever loop a part did not stop itself ends here.
        supervisor = manager.supervisor if manager is not None else Supervisor()
        stack.push_async_callback(supervisor.aclose)
        manager = manager or ExecutionManager(settings, supervisor=supervisor)
        interpreters = InterpreterManager(settings, manager)
        signer = FileUrlSigner(url_key(settings))
        router = Router(settings, Parts(manager, interpreters, signer))
        router.cluster_address = cluster_address
        # Closed last: the manager's shutdown (which stops the interpreters first, and flushes
        # the mirror) still reports through the router's stores.
        stack.push_async_callback(router.aclose)
        await manager.start()
        stack.push_async_callback(manager.shutdown)
        await router.check_cluster(starting=True)
        router.start()
        clock: ClockWatch | None = None
        if manager.store is not None and manager.mirror is not None:
            clock = ClockWatch(manager.store, manager.replica_id, manager.mirror.heartbeat_interval)
            clock.start()
            stack.push_async_callback(clock.aclose)
        interpreters.start()
        yield Services(settings, supervisor, manager, interpreters, signer, router, clock)


class Root:
    """Where the HTTP edge finds the running parts: set for the life of the ASGI app."""

    def __init__(self) -> None:
        self._services: Services | None = None

    @property
    def services(self) -> Services:
        if self._services is None:
            raise SandboxRuntimeError("the server is starting or stopping")
        return self._services

    @property
    def running(self) -> bool:
        return self._services is not None

    @contextlib.asynccontextmanager
    async def serving(self, services: Services) -> AsyncIterator[Services]:
        self._services = services
        try:
            yield services
        finally:
            self._services = None
