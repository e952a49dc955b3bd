"""Call the hosted MCP servers from code in the sandbox (code mode).

    from mcp_servers import time
    now = time.get_current_time(timezone="UTC")      # the tool's structured result

    import asyncio, mcp_servers
    mcp_servers.servers()                            # what this code may call
    mcp_servers.search("graph", detail="summary")    # tools by name and description
    everything = mcp_servers.server("everything")
    everything["get-sum"](a=1, b=2)                  # a tool whose name is not an identifier
    await asyncio.gather(*(time.get_current_time.aio(timezone=z) for z in ("UTC", "CET")))

A call returns the tool's structured content when it has one, else its text (one text
block), else its content blocks as dicts. A tool error raises ToolError; a call the host
refuses (a server or tool not allowed, a limit reached) raises BridgeError. A call is the
same everywhere: it blocks until the result is there, in a script as in a Jupyter kernel's
cell (where a cell's interrupt stops it). `tool.aio(...)` is the same call as a coroutine,
for concurrency in an event loop (a kernel's top-level await, asyncio.run): `asyncio.gather`
over them runs up to CONCURRENT at once, the rest waiting their turn in this process.

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
import difflib
import json
import os
import socket
import struct
import sys
import threading
import types
import weakref
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
# Calls at once: the host refuses an execution's calls past 8 at once; here they wait instead
# (blocking calls from threads, and each event loop's .aio calls, 8 at a time each).
CONCURRENT = 8
_THREAD_GATE = threading.BoundedSemaphore(CONCURRENT)
_GATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> its .aio gate
_GATES_KEPT: dict = {}
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


def _frame(request: dict) -> tuple[str | None, bytes]:
    """The request's cell, and the request as one frame (it says which cell it is from)."""
    cell = _cell()
    if cell is not None:
        request = {**request, "cell": cell}
    body = json.dumps(request, separators=(",", ":")).encode()
    return cell, struct.pack(">I", len(body)) + body


def _no_bridge(cell: str | None, request: dict, exc: OSError) -> BridgeError:
    """Why the socket is not there, and what to do about it."""
    if _watching and cell != _current:
        return BridgeError("ended", ENDED)
    name = request.get("server")
    fix = f"servers=[{json.dumps(name)}]" if isinstance(name, str) else "servers=[...]"
    if _watching:
        why = f"this run_code call names no servers: call run_code again with {fix}"
    elif cell is not None:  # (a process a cell started: which is the case it can't know)
        why = "the run_code call that started this process named no servers, or has ended"
    else:
        why = f"this execution names no servers: run it again with {fix}"
    return BridgeError("unavailable", f"no MCP servers bridge in this sandbox ({why})")


def _answer(answer: Any) -> Any:
    if not isinstance(answer, dict):
        raise BridgeError("protocol", "an answer that is not a JSON object")
    if not answer.get("ok"):
        error = answer.get("error") or {}
        message = " ".join(str(error.get("message", answer)).split())  # (one line)
        raise BridgeError(str(error.get("kind", "error")), message)
    if isinstance(answer.get("file"), str):  # a large result: kept in the workspace too
        _keep(answer["file"], answer.get("result"))
    return answer.get("result")


def _ask(request: dict) -> Any:
    cell, frame = _frame(request)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(SOCKET)
        except OSError as exc:
            raise _no_bridge(cell, request, exc) from None
        sock.sendall(frame)
        (size,) = struct.unpack(">I", _recv_exact(sock, 4))
        if size > MAX_FRAME:
            raise BridgeError("protocol", f"an answer of {size} bytes")
        answer = json.loads(_recv_exact(sock, size))
    return _answer(answer)


async def _ask_async(request: dict) -> Any:
    """_ask as a coroutine (the loop runs meanwhile); a cancelled one closes its connection."""
    cell, frame = _frame(request)
    try:
        reader, writer = await asyncio.open_unix_connection(SOCKET)
    except OSError as exc:
        raise _no_bridge(cell, request, exc) from None
    try:
        writer.write(frame)
        await writer.drain()
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        if size > MAX_FRAME:
            raise BridgeError("protocol", f"an answer of {size} bytes")
        answer = json.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        raise BridgeError("closed", "the host closed the bridge") from None
    finally:
        writer.close()
    return _answer(answer)


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


def _gate() -> asyncio.Semaphore:
    """The running loop's gate for .aio calls (CONCURRENT at once; the rest wait here)."""
    loop = asyncio.get_running_loop()
    gate = _GATES_KEPT.get(loop)
    if gate is None:
        try:
            gate = _GATES.get(loop)
            if gate is None:
                gate = _GATES[loop] = asyncio.Semaphore(CONCURRENT)
        except TypeError:  # (a loop without weak references, uvloop's: kept for good)
            gate = _GATES_KEPT[loop] = asyncio.Semaphore(CONCURRENT)
    return gate


class Tool:
    """One tool of a server: call it (blocking) or await its .aio(...) (a coroutine)."""

    def __init__(self, server: str, name: str, description: str = "") -> None:
        self.server, self.name, self.__doc__ = server, name, description

    def __call__(self, **arguments: Any) -> Any:
        try:
            with _THREAD_GATE:
                return _value(_ask(self._request(arguments)))
        except (BridgeError, ToolError) as exc:
            raise exc.with_traceback(None) from None  # (the caller's line, not ours)

    async def aio(self, **arguments: Any) -> Any:
        """The call as a coroutine: `await tool.aio(...)`, or many at once with
        asyncio.gather (CONCURRENT at a time; the others wait their turn)."""
        try:
            async with _gate():
                return _value(await _ask_async(self._request(arguments)))
        except (BridgeError, ToolError) as exc:
            raise exc.with_traceback(None) from None

    def call_sync(self, **arguments: Any) -> Any:  # (its name before calls were all blocking)
        return self(**arguments)

    def _request(self, arguments: dict) -> dict:
        return {"op": "call", "server": self.server, "tool": self.name, "arguments": arguments}

    def __repr__(self) -> str:
        return f"<tool {self.server}.{self.name}: call it, or await .aio(...)>"


class Server:
    def __init__(self, name: str) -> None:
        self._name = name
        self._tools: dict[str, dict] | None = None

    def tools(self) -> list[dict]:
        """Its tools: name, description, input schema (and output schema, if any)."""
        if self._tools is None:
            try:
                listed = _ask({"op": "tools", "server": self._name})
            except BridgeError as exc:
                raise exc.with_traceback(None) from None
            self._tools = {t["name"]: t for t in listed}
        return list(self._tools.values())

    def __getitem__(self, tool: str) -> Tool:
        known = {t["name"]: t for t in self.tools()}
        if tool not in known:
            close = difflib.get_close_matches(tool, list(known), 3, 0.6)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            listed = ", ".join(sorted(known)[:30]) or "none"
            raise BridgeError(
                "unknown_tool",
                f"server {self._name!r} has no tool {tool!r}{hint} (its tools: {listed})",
            )
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
    try:
        return list(_ask({"op": "servers"}))
    except BridgeError as exc:
        raise exc.with_traceback(None) from None


def server(name: str) -> Server:
    return Server(name)


def search(query: str, detail: str = "summary", limit: int = 20) -> list[dict]:
    """Tools whose name or description matches `query` (words, any order). detail: "names",
    "summary" (one line each) or "full" (with schemas)."""
    try:
        return list(_ask({"op": "search", "query": query, "detail": detail, "limit": limit}))
    except BridgeError as exc:
        raise exc.with_traceback(None) from None


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

    def show(self: Any, kind: Any, value: Any, tb: Any, tb_offset: Any = None) -> None:
        # A cell's uncaught BridgeError or ToolError: its lines, not this library's.
        trimmed = _callers_traceback(tb)
        self.showtraceback((kind, value, trimmed), tb_offset, running_compiled_code=True)

    shell.set_custom_exc((BridgeError, ToolError), show)
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


def _callers_traceback(tb: Any) -> Any:
    """`tb` without this library's frames: the caller's lines only."""
    kept = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:
            kept.append(tb)
        tb = tb.tb_next
    trimmed = None
    for frame in reversed(kept):
        trimmed = types.TracebackType(trimmed, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return trimmed


def _show_callers_lines(previous: Any) -> Any:
    """An uncaught BridgeError or ToolError reads as the caller's lines and one line of
    what went wrong (a model reads it: not this library's internals)."""

    def hook(kind: Any, value: BaseException, tb: Any) -> None:
        if isinstance(value, (BridgeError, ToolError)):
            tb = _callers_traceback(tb)
            value.with_traceback(tb)  # (what the interpreter prints from)
        previous(kind, value, tb)

    return hook


sys.excepthook = _show_callers_lines(sys.excepthook)  # (a kernel shows errors its own way)
_watch_cells()


def __getattr__(name: str) -> Server:  # `from mcp_servers import time`
    if name.startswith("_"):
        raise AttributeError(name)
    return Server(name)
