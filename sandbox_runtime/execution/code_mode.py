"""Code mode, as the execution layer sees it: an execution that names hosted servers
(`servers=[...]`) gets a bridge to them, bound into its sandbox, whose calls become its
`tool_call` events. The bridge itself is the servers layer's (servers/bridge.py), handed in by
the composition root as a `Bridges`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sandbox_runtime.domain.models import EventType
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.sandbox.host import BRIDGE_DIR

LIBRARY_PATH = f"{BRIDGE_DIR}/python"  # where `import mcp_servers` is found in the sandbox
# The library itself (the servers layer's file, read here by path: no import crosses layers)
LIBRARY = Path(__file__).resolve().parents[1] / "servers" / "sandbox_lib" / "mcp_servers.py"
BRIDGE_ENV = {"MCP_SERVERS_SOCKET": f"{BRIDGE_DIR}/bridge.sock", "PYTHONPATH": LIBRARY_PATH}


class OpenBridge(Protocol):
    directory: Path

    @property
    def env(self) -> dict[str, str]: ...

    async def aclose(self) -> None: ...


class Bridges(Protocol):
    async def open(
        self,
        owner: Owner,
        servers: list[str],
        on_call: Callable[[Any], None],
        directory: Path | None = None,
    ) -> OpenBridge:
        """A started bridge for `owner`'s code to the servers named (narrowing what the
        principal may call), in a directory of its own or in `directory` (an interpreter's,
        bound into its sandbox when it started). Raises InvalidRequestError."""
        ...


async def open_bridge(
    makers: list[Bridges],
    owner: Owner,
    servers: list[str] | None,
    execution: Execution,
    directory: Path | None = None,
) -> OpenBridge | None:
    """The execution's bridge, if it names servers. Raises InvalidRequestError."""
    if servers is None:
        return None
    if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
        raise InvalidRequestError('servers must be a list of server names (["*"]: all)')
    if not makers:
        raise InvalidRequestError("this server hosts no MCP servers (servers=[...] needs some)")
    return await makers[0].open(owner, servers, tool_calls_of(execution), directory)


def bridged_env(env: dict[str, str], bridge: OpenBridge | None) -> dict[str, str]:
    """The command's environment with the bridge's (the library first on PYTHONPATH)."""
    if bridge is None:
        return env
    python_path = env.get("PYTHONPATH")
    path = f"{LIBRARY_PATH}:{python_path}" if python_path else LIBRARY_PATH
    return {**env, **bridge.env, "PYTHONPATH": path}


def tool_calls_of(execution: Execution) -> Callable[[Any], None]:
    """Where a bridge reports a finished call: a `tool_call` event of the execution (counted
    against its output like any event)."""

    def record(call: Any) -> None:
        if execution.status.finished:
            return
        message = (
            f"{call.server}.{call.tool}: {call.outcome} in {call.duration_ms} ms "
            f"({call.sent} bytes sent, {call.received} received); arguments {call.arguments}; "
            f"result {call.result}"
        )
        execution.record_event(
            EventType.TOOL_CALL,
            len(message),
            name=f"{call.server}.{call.tool}",
            reason=call.outcome,
            duration_ms=call.duration_ms,
            message=message,
        )

    return record
