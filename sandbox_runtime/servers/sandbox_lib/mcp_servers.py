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
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from typing import Any

SOCKET = os.environ.get("MCP_SERVERS_SOCKET", "/run/srt-bridge/bridge.sock")
MAX_FRAME = 64 << 20
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


def _ask(request: dict) -> Any:
    body = json.dumps(request, separators=(",", ":")).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(SOCKET)
        except OSError as exc:
            raise BridgeError(
                "unavailable", f"no MCP servers bridge in this sandbox ({SOCKET}: {exc})"
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
            return loop.run_in_executor(None, lambda: self.call_sync(**arguments))
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


def __getattr__(name: str) -> Server:  # `from mcp_servers import time`
    if name.startswith("_"):
        raise AttributeError(name)
    return Server(name)
