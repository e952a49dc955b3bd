"""Bridges for executions that name hosted servers (code mode): what the execution's code may
call is the principal's servers, narrowed by the execution's `servers=[...]` (never
widened: a name the principal may not use is simply not there), each instance the one the
principal (and session) would reach through /servers/NAME/mcp."""

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
from sandbox_runtime.servers.host import ServerHost, owner_of

# (the instance's owner, its entry, method, params, progress) -> {"result"} | {"error"}
Route = Callable[[Owner, Entry, str, dict[str, Any], Any], Awaitable[dict[str, Any]]]


class BridgeMaker:
    """Opens bridges under `root` (one directory each, removed with the bridge)."""

    def __init__(self, host: ServerHost, root: Path, route: Route) -> None:
        self.host = host
        self.root = root
        self.route = route
        self.seen_returns: dict[str, dict[str, str]] = {}  # principal -> what tools returned
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
        bridge.known_tools = self.host.tool_lists
        # (What one principal's calls returned is not shown in another's stubs.)
        bridge.seen_returns = self.seen_returns.setdefault(owner.principal, {})
        bridge.owner_ids = self.owner_ids
        await bridge.start()
        return bridge
