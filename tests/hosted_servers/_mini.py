"""A tiny MCP stdio server, standard library only, for the hostile test servers next to it.

One JSON-RPC 2.0 message per line on stdin and stdout (`json.dumps(msg) + "\\n"`, flushed).
Handled: `initialize` (answers the client's own protocolVersion), `notifications/initialized`
(ignored), `ping`, `tools/list`, `tools/call`, `notifications/cancelled` (recorded, logged to
stderr, and the call's `ctx.cancelled` set). Any other request: error -32601; any other
notification: ignored; a line that is not JSON: error -32700 (id null).

Each `tools/call` runs in a thread of its own, so a call that hangs or floods does not stop
the server reading: pings, cancellations and other calls are still answered. A tool is
`fn(args, ctx)` returning a str (one text content), a dict (the whole result, as it is) or
None (no response at all). An exception becomes a result with `isError: true`; `RpcError`
a JSON-RPC error. A call cancelled before it returns gets no response (as MCP says).

On EOF on stdin the server waits up to a second for calls in flight, then exits 0 (unless
`exit_on_eof=False`: then it sleeps until it is killed).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PROTOCOL = "2025-06-18"


class RpcError(Exception):
    """Raised by a tool or method: answered as a JSON-RPC error."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


@dataclass
class Tool:
    fn: Callable[[dict, Context], dict | str | None]
    description: str = ""
    properties: dict = field(default_factory=dict)  # JSON Schema of each argument
    required: list[str] = field(default_factory=list)
    output_schema: dict | None = None


def tool(
    fn: Callable[[dict, Context], dict | str | None],
    description: str = "",
    properties: dict | None = None,
    required: list[str] | None = None,
    output_schema: dict | None = None,
) -> Tool:
    return Tool(
        fn,
        description or (fn.__doc__ or "").strip(),
        properties or {},
        required or [],
        output_schema,
    )


def text(value: str, is_error: bool = False) -> dict:
    """A tools/call result of one text content."""
    return {"content": [{"type": "text", "text": value}], "isError": is_error}


class Context:
    """One request as its handler sees it, and the server's output."""

    def __init__(self, server: Server, request_id: Any, params: dict) -> None:
        self.server = server
        self.id = request_id
        self.params = params
        meta = params.get("_meta")
        self.meta: dict = meta if isinstance(meta, dict) else {}
        self.progress_token = self.meta.get("progressToken")
        self.cancelled = threading.Event()

    def notify(self, method: str, params: dict | None = None) -> None:
        self.server.notify(method, params)

    def send(self, msg: Any) -> None:
        self.server.send(msg)

    def write_raw(self, data: bytes) -> None:
        self.server.write_raw(data)

    def write_parts(self, parts: Iterable[bytes]) -> None:
        self.server.write_parts(parts)

    def log(self, line: str) -> None:
        self.server.log(line)


class Server:
    def __init__(
        self,
        name: str,
        tools: Mapping[str, Tool | Callable[[dict, Context], dict | str | None]],
        version: str = "0.1.0",
        capabilities: dict | None = None,
        methods: Mapping[str, Callable[[dict, Context], dict | None]] | None = None,
        exit_on_eof: bool = True,
    ) -> None:
        self.name = name
        self.version = version
        self.tools = {k: v if isinstance(v, Tool) else tool(v) for k, v in tools.items()}
        self.capabilities = capabilities if capabilities is not None else {"tools": {}}
        self.methods = dict(methods or {})  # these override the built-in methods
        self.exit_on_eof = exit_on_eof  # False: after EOF on stdin, sleep until killed
        self.out = sys.stdout.buffer
        self.lock = threading.Lock()
        self.in_flight: dict[Any, Context] = {}
        self.cancellations: list[tuple[Any, Any]] = []  # (request id, reason), every one received
        self.initialized = False

    # -- output ---------------------------------------------------------------------------------

    def write_raw(self, data: bytes) -> None:
        try:
            with self.lock:
                self.out.write(data)
                self.out.flush()
        except OSError:  # the host closed our stdout: nobody is listening any more
            os._exit(0)

    def write_parts(self, parts: Iterable[bytes]) -> None:
        """Write `parts` as one piece: no other message comes between them."""
        try:
            with self.lock:
                for part in parts:
                    self.out.write(part)
                self.out.flush()
        except OSError:
            os._exit(0)

    def send(self, msg: Any) -> None:
        self.write_raw((json.dumps(msg) + "\n").encode())

    def notify(self, method: str, params: dict | None = None) -> None:
        msg: dict = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)

    def respond(self, request_id: Any, result: dict) -> None:
        self.send({"jsonrpc": "2.0", "id": request_id, "result": result})

    def error(self, request_id: Any, code: int, message: str, data: Any = None) -> None:
        err: dict = {"code": code, "message": message}
        if data is not None:
            err["data"] = data
        self.send({"jsonrpc": "2.0", "id": request_id, "error": err})

    def log(self, line: str) -> None:
        try:
            sys.stderr.write(f"[{self.name}] {line}\n")
            sys.stderr.flush()
        except OSError:
            pass

    # -- built-in methods -----------------------------------------------------------------------

    def initialize(self, params: dict, ctx: Context) -> dict | None:
        version = params.get("protocolVersion")
        return {
            "protocolVersion": version if isinstance(version, str) else DEFAULT_PROTOCOL,
            "capabilities": self.capabilities,
            "serverInfo": {"name": self.name, "version": self.version},
        }

    def list_tools(self, params: dict, ctx: Context) -> dict | None:
        listed = []
        for name, t in self.tools.items():
            schema: dict = {"type": "object", "properties": t.properties}
            if t.required:
                schema["required"] = t.required
            entry: dict = {"name": name, "description": t.description, "inputSchema": schema}
            if t.output_schema is not None:
                entry["outputSchema"] = t.output_schema
            listed.append(entry)
        return {"tools": listed}

    def call_tool(self, params: dict, ctx: Context) -> None:
        name = params.get("name")
        t = self.tools.get(name) if isinstance(name, str) else None
        if t is None:
            raise RpcError(-32602, f"Unknown tool: {name!r}")
        args = params.get("arguments")
        args = args if isinstance(args, dict) else {}
        self.in_flight[ctx.id] = ctx
        threading.Thread(target=self._run_tool, args=(t, args, ctx), daemon=True).start()

    def _run_tool(self, t: Tool, args: dict, ctx: Context) -> None:
        try:
            try:
                out = t.fn(args, ctx)
            except RpcError as e:
                if not ctx.cancelled.is_set():
                    self.error(ctx.id, e.code, e.message, e.data)
                return
            except Exception as e:
                out = text(f"{type(e).__name__}: {e}", is_error=True)
            if out is None or ctx.cancelled.is_set():
                return
            self.respond(ctx.id, text(out) if isinstance(out, str) else out)
        finally:
            self.in_flight.pop(ctx.id, None)

    def on_cancelled(self, params: dict) -> None:
        request_id = params.get("requestId")
        reason = params.get("reason")
        self.cancellations.append((request_id, reason))
        self.log(f"cancelled request {request_id!r}: {reason!r}")
        for key, ctx in list(self.in_flight.items()):
            if key == request_id and type(key) is type(request_id):
                ctx.cancelled.set()

    # -- the loop -------------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        if not isinstance(msg, dict):
            self.error(None, -32600, "Invalid Request")
            return
        method = msg.get("method")
        params = msg.get("params")
        params = params if isinstance(params, dict) else {}
        if "id" not in msg:  # a notification
            if method == "notifications/cancelled":
                self.on_cancelled(params)
            elif method == "notifications/initialized":
                self.initialized = True
            return
        request_id = msg["id"]
        if not isinstance(method, str):
            return  # a response to something we never asked, or nonsense: not answered
        ctx = Context(self, request_id, params)
        builtin: dict[str, Callable[[dict, Context], dict | None]] = {
            "initialize": self.initialize,
            "ping": lambda p, c: {},
            "tools/list": self.list_tools,
            "tools/call": self.call_tool,
        }
        handler = self.methods.get(method) or builtin.get(method)
        if handler is None:
            self.error(request_id, -32601, f"Method not found: {method}")
            return
        try:
            result = handler(params, ctx)
        except RpcError as e:
            self.error(request_id, e.code, e.message, e.data)
            return
        except Exception as e:
            self.error(request_id, -32603, f"{type(e).__name__}: {e}")
            return
        if result is not None:
            self.respond(request_id, result)

    def run(self) -> None:
        stdin = sys.stdin.buffer
        while True:
            line = stdin.readline()
            if not line:
                break
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                self.error(None, -32700, "Parse error")
                continue
            self.handle(msg)
        while not self.exit_on_eof:
            time.sleep(3600)
        deadline = time.monotonic() + 1.0
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            sys.stderr.flush()
        finally:
            os._exit(0)  # not a normal exit: daemon threads may hold stdout's lock


def serve(
    tools: Mapping[str, Tool | Callable[[dict, Context], dict | str | None]],
    name: str,
    **options: Any,
) -> None:
    """Serve `tools` on stdin/stdout until stdin closes. `options`: see `Server`."""
    Server(name, tools, **options).run()


def ok_tool() -> Tool:
    """The `ok` tool every test server has: answers "fine"."""
    return tool(lambda args, ctx: "fine", "Answers 'fine'.")
