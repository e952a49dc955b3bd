"""Bridges for executions that name hosted servers (code mode): what the execution's code may
call is the principal's servers, narrowed by the execution's `servers=[...]` (never
widened: a name the principal may not use is simply not there), each instance the one the
principal (and session) would reach through /servers/NAME/mcp. What its stubs show is what
those instances (or shared ones) said: their tool lists, and what their tools returned to
this principal."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sandbox_runtime.domain.owner import Owner, session_name
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.servers.bridge import Bridge
from sandbox_runtime.servers.catalog import Entry
from sandbox_runtime.servers.host import ServerHost
from sandbox_runtime.servers.learned import owner_of

MAX_SEEN_KEPT = 4096  # (principal, instance, server) whose tools' returns are kept

# (the instance's owner, its entry, method, params, progress) -> {"result"} | {"error"}
Route = Callable[[Owner, Entry, str, dict[str, Any], Any], Awaitable[dict[str, Any]]]


class BridgeMaker:
    """Opens bridges under `root` (one directory each, removed with the bridge)."""

    def __init__(self, host: ServerHost, root: Path, route: Route) -> None:
        self.host = host
        self.root = root
        self.route = route
        # What tools returned, by (principal, the instance's owner, server) -> tool
        self.seen_returns: dict[tuple[str, Owner, str], dict[str, str]] = {}
        self.owner_ids: tuple[int, int] | None = None  # the sandbox user's (set by the root)
        shutil.rmtree(root, ignore_errors=True)  # (a previous run's)
        root.mkdir(mode=0o711, parents=True, exist_ok=True)

    async def open(
        self,
        owner: Owner,
        servers: list[str],
        on_call: Callable[[Any], None],
        directory: Path | None = None,
    ) -> Bridge:
        allowed = {e.name: e for e in self.host.catalog().for_principal(owner.principal)}
        usable = frozenset(allowed)
        if servers != ["*"]:
            allowed = {name: e for name, e in allowed.items() if name in servers}
        session = session_name(owner.session_id)

        async def call(
            entry: Entry, method: str, params: dict[str, Any], progress: Any
        ) -> dict[str, Any]:
            instance_owner = owner_of(entry, owner.principal, session)
            try:
                return await self.route(instance_owner, entry, method, params, progress)
            except SandboxRuntimeError as exc:
                return {"error": {"code": -32603, "message": str(exc)}}

        place = directory or self.root / f"b-{secrets.token_hex(8)}"
        bridge = Bridge(place, allowed, call, on_call, owns_directory=directory is None)
        for name, entry in allowed.items():
            instance_owner = owner_of(entry, owner.principal, session)
            known = self.host.known_tools(instance_owner, entry)
            if known is not None:
                bridge.known_tools[name] = known
            # (What one principal's calls returned is not shown in another's stubs.)
            bridge.seen_returns[name] = self._seen((owner.principal, instance_owner, name))
        bridge.owner_ids = self.owner_ids
        bridge.usable = usable
        await bridge.start()
        return bridge

    def _seen(self, key: tuple[str, Owner, str]) -> dict[str, str]:
        seen = self.seen_returns.pop(key, None) or {}
        self.seen_returns[key] = seen  # (last: the most recently used)
        while len(self.seen_returns) > MAX_SEEN_KEPT:
            del self.seen_returns[next(iter(self.seen_returns))]
        return seen
