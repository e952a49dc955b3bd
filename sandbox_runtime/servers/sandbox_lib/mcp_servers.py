"""Call the hosted MCP servers from code in the sandbox (code mode).

    from mcp_servers import time
    now = time.get_current_time(timezone="UTC")      # the tool's structured result

    import mcp_servers
    mcp_servers.servers()                            # what this code may call
    mcp_servers.search("graph", detail="summary")    # tools by name and description
    everything = mcp_servers.server("everything")
    everything["get-sum"](a=1, b=2)                  # a tool whose name is not an identifier

A call returns the tool's structured content when it has one, else its text (one text
block), else its content blocks as dicts. A tool error raises ToolError; a call the host
refuses (a server or tool not allowed, a limit reached) raises BridgeError. In a running
event loop (a Jupyter kernel's cell) a call returns an awaitable instead: `await time.x()`.

Calls go over a Unix socket to the host, which checks each against what the execution may
call and calls the server on its behalf: no credential is in this sandbox. Standard library
only (any Python 3.8+).

In a run_code interpreter (a Jupyter kernel) a call's bridge is its cell's: each request says
which cell its code belongs to, and the host answers only the running cell's. The cell's own
code and the asyncio tasks it creates belong to it (a context variable, set when each cell
starts); a thread to the cell that started it, work handed to a thread pool to the cell that
handed it over, a process to the cell during which it started (MCP_SERVERS_CELL in its
environment).
What a cell left running gets BridgeError kind `ended` once its cell is over.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import socket
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SOCKET = os.environ.get("MCP_SERVERS_SOCKET", "/run/srt-bridge/bridge.sock")
MAX_FRAME = 64 << 20
CELL_ENV = "MCP_SERVERS_CELL"  # the cell (execute request) that started this process
ENDED = (
    "the run_code call that allowed these servers has ended (this code was left running by "
    "it); call them from a run_code call that names servers=[...]"
)
# The cell the running code belongs to (in an interpreter; see the module's docstring).
_CELL: contextvars.ContextVar[str | None] = contextvars.ContextVar("mcp_servers_cell", default=None)
_current: str | None = None  # the cell the interpreter runs now (None: between cells)
_watching = False  # cells are followed (this process is a Jupyter kernel)
__all__ = ["BridgeError", "ToolError", "search", "server", "servers"]


class BridgeError(Exception):
    """The host refused or could not make the call (`kind` says which)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ToolError(Exception):
    """The tool answered with an error (`result` is its whole result)."""

    def __init__(self, message: str, result: dict) -> None:
        super().__init__(message)
        self.result = result


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise BridgeError("closed", "the host closed the bridge")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _cell() -> str | None:
    """The cell the calling code belongs to: its context's, else its thread's, else its
    process's (None outside an interpreter: an execution's code is all its own)."""
    cell = _CELL.get()
    if cell is None:
        cell = getattr(threading.current_thread(), "_mcp_servers_cell", None)
    return cell if cell is not None else os.environ.get(CELL_ENV) or None


def _ask(request: dict) -> Any:
    cell = _cell()
    if cell is not None:
        request = {**request, "cell": cell}
    body = json.dumps(request, separators=(",", ":")).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(SOCKET)
        except OSError as exc:
            if _watching and cell != _current:
                raise BridgeError("ended", ENDED) from None
            if _watching:
                why = " (this run_code call names no servers: servers=[...])"
            elif cell is not None:  # (a process a cell started: which is the case it can't know)
                why = " (the run_code call that started it named no servers, or has ended)"
            else:
                why = ""
            raise BridgeError(
                "unavailable", f"no MCP servers bridge in this sandbox ({SOCKET}: {exc}){why}"
            ) from None
        sock.sendall(struct.pack(">I", len(body)) + body)
        (size,) = struct.unpack(">I", _recv_exact(sock, 4))
        if size > MAX_FRAME:
            raise BridgeError("protocol", f"an answer of {size} bytes")
        answer = json.loads(_recv_exact(sock, size))
    if not answer.get("ok"):
        error = answer.get("error") or {}
        raise BridgeError(str(error.get("kind", "error")), str(error.get("message", answer)))
    if isinstance(answer.get("file"), str):  # a large result: kept in the workspace too
        _keep(answer["file"], answer.get("result"))
    return answer.get("result")


def _keep(path: str, result: Any) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f)
    except OSError:
        pass  # (a full or read-only workspace: the value is still returned)


def _value(result: dict) -> Any:
    """A tool result as a plain value (see the module's docstring)."""
    content = result.get("content") or []
    texts = [b.get("text", "") for b in content if b.get("type") == "text"]
    if result.get("isError"):
        raise ToolError("\n".join(texts) or "the tool failed", result)
    if result.get("structuredContent") is not None:
        return result["structuredContent"]
    if len(content) == 1 and texts:
        return texts[0]
    return content


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Tool:
    def __init__(self, server: str, name: str, description: str = "") -> None:
        self.server, self.name, self.__doc__ = server, name, description

    def __call__(self, **arguments: Any) -> Any:
        loop = _running_loop()
        if loop is not None:  # (a kernel's cell: awaitable, the loop left free meanwhile)
            run = contextvars.copy_context().run  # (the thread calls as this code's cell)
            return loop.run_in_executor(None, lambda: run(self.call_sync, **arguments))
        return self.call_sync(**arguments)

    def call_sync(self, **arguments: Any) -> Any:
        request = {"op": "call", "server": self.server, "tool": self.name, "arguments": arguments}
        return _value(_ask(request))

    def __repr__(self) -> str:
        return f"<tool {self.server}.{self.name}>"


class Server:
    def __init__(self, name: str) -> None:
        self._name = name
        self._tools: dict[str, dict] | None = None

    def tools(self) -> list[dict]:
        """Its tools: name, description, input schema (and output schema, if any)."""
        if self._tools is None:
            listed = _ask({"op": "tools", "server": self._name})
            self._tools = {t["name"]: t for t in listed}
        return list(self._tools.values())

    def __getitem__(self, tool: str) -> Tool:
        known = {t["name"]: t for t in self.tools()}
        if tool not in known:
            raise BridgeError("unknown_tool", f"server {self._name} has no tool {tool!r}")
        return Tool(self._name, tool, known[tool].get("description") or "")

    def __getattr__(self, attribute: str) -> Tool:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        names = {t["name"] for t in self.tools()}
        for candidate in (attribute, attribute.replace("_", "-")):
            if candidate in names:
                return self[candidate]
        # Not listed (it does not exist, or it is not allowed): the host says which.
        return Tool(self._name, attribute)

    def __dir__(self) -> list[str]:
        return sorted(t["name"].replace("-", "_") for t in self.tools())

    def __repr__(self) -> str:
        return f"<MCP server {self._name}>"


def servers() -> list[dict]:
    """The servers this code may call: name, kind, and where their stubs are."""
    return list(_ask({"op": "servers"}))


def server(name: str) -> Server:
    return Server(name)


def search(query: str, detail: str = "summary", limit: int = 20) -> list[dict]:
    """Tools whose name or description matches `query` (words, any order). detail: "names",
    "summary" (one line each) or "full" (with schemas)."""
    return list(_ask({"op": "search", "query": query, "detail": detail, "limit": limit}))


def _watch_cells() -> None:
    """In a Jupyter kernel (IPython's): mark each cell's code with the cell (its execute
    request's id, which the host's bridge for that cell expects), and make threads carry
    the cell that started them and thread-pool work the cell that handed it over."""
    global _watching
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    if shell is None or kernel is None or _watching:
        return
    _watching = True

    def started(info: Any = None) -> None:
        global _current
        try:
            parent = kernel.get_parent("shell")
            if parent.get("content", {}).get("silent"):
                return  # (the host's own request: not a cell)
            cell = str(parent["header"]["msg_id"])
        except Exception:
            return
        _current = cell
        _CELL.set(cell)
        os.environ[CELL_ENV] = cell  # (processes started from now carry it)

    def ended(result: Any = None) -> None:
        global _current
        _current = None

    shell.events.register("pre_run_cell", started)
    shell.events.register("post_run_cell", ended)
    start, submit = threading.Thread.start, ThreadPoolExecutor.submit

    def start_in_cell(self: threading.Thread) -> None:
        self._mcp_servers_cell = _cell()  # type: ignore[attr-defined]
        start(self)

    def submit_in_cell(self: ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        cell = _cell()
        if cell is None:
            return submit(self, fn, *args, **kwargs)

        def run() -> Any:
            token = _CELL.set(cell)
            try:
                return fn(*args, **kwargs)
            finally:
                _CELL.reset(token)

        return submit(self, run)

    threading.Thread.start = start_in_cell  # type: ignore[method-assign]
    ThreadPoolExecutor.submit = submit_in_cell  # type: ignore[method-assign, assignment]
    if threading.current_thread() is threading.main_thread():
        started()  # (imported in a cell: it is that cell's)


_watch_cells()


def __getattr__(name: str) -> Server:  # `from mcp_servers import time`
    if name.startswith("_"):
        raise AttributeError(name)
    return Server(name)
