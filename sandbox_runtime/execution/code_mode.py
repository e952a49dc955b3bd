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
# The libraries (the servers layer's files, read here by path: no import crosses layers)
LIBRARY = Path(__file__).resolve().parents[1] / "servers" / "sandbox_lib" / "mcp_servers.py"
JS_LIBRARY = LIBRARY.with_suffix(".mjs")
JS_RESERVED = frozenset(
    "BridgeError ToolError server servers search default await break case catch class const "
    "continue debugger delete do else enum export extends false finally for function if "
    "import in instanceof let new null return static super switch this throw true try typeof "
    "var void while with yield".split()
)
BRIDGE_ENV = {"MCP_SERVERS_SOCKET": f"{BRIDGE_DIR}/bridge.sock", "PYTHONPATH": LIBRARY_PATH}


class OpenBridge(Protocol):
    directory: Path
    # An interpreter's: the cell whose requests it answers (see servers/bridge.py)
    cell: str | None

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


def write_library(directory: Path, servers: list[str]) -> None:
    """The libraries in a bridge's directory: `python/mcp_servers.py`, and
    `node_modules/mcp_servers` (bound at /node_modules, so `import ... from "mcp_servers"`
    resolves from anywhere) with a named export per server that is an identifier."""
    python = directory / "python"
    python.mkdir(mode=0o755, parents=True, exist_ok=True)
    (python / LIBRARY.name).write_bytes(LIBRARY.read_bytes())
    package = directory / "node_modules" / "mcp_servers"
    package.mkdir(mode=0o755, parents=True, exist_ok=True)
    exports = [
        f'export const {name} = server("{name}");'
        for name in servers
        if name.isidentifier() and name.isascii() and name not in JS_RESERVED
    ]
    source = JS_LIBRARY.read_text() + "\n" + "\n".join(exports) + "\n"
    (package / "index.mjs").write_text(source)
    (package / "package.json").write_text(
        '{"name": "mcp_servers", "type": "module", "main": "index.mjs", "exports": "./index.mjs"}\n'
    )
    for path in (directory, python, directory / "node_modules", package):
        path.chmod(0o755)
