"""Code mode's bridge: a Unix socket per sandbox through which code calls hosted servers.

The socket is the sandbox's identity: a call that arrives on it is the execution's, for its
principal and session, whatever the frame says. Each request is one frame (4-byte big-endian
length, then JSON) on a connection of its own, answered by one frame. The host checks every
call against what the execution may call (the principal's servers, narrowed by the call's own
`servers=[...]`; an entry's tool filter), calls the server on the principal's behalf through
the hosted-servers layer, and reports each call as a `tool_call` event of the execution.
Bounded: frame size, calls, calls at once, bytes, and each call's time (its entry's).
An interpreter's bridge is one cell's: a request that says it comes from another cell (code
an earlier cell left running) is refused, and neither counted nor reported.

Its files (the library, a stub per tool: servers/stubs.py) are written by the stub writers'
threads, never on the event loop, within a budget per bridge; the stubs are those of the tools
the execution's own instances (or shared ones) listed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.execution.code_mode import write_library
from sandbox_runtime.servers.bridge_hints import server_refusal, tool_refusal
from sandbox_runtime.servers.catalog import Entry
from sandbox_runtime.servers.stubs import STUB_WRITERS, StubBudget, write_stubs
from sandbox_runtime.supervisor import scoped

SOCKET_NAME = "bridge.sock"
MAX_FRAME = 4 << 20  # a request; answers are bounded by the servers' own message bounds
PREVIEW = 200  # characters of arguments and results shown in a tool_call event
MAX_CONNECTIONS = 64  # open at once per bridge; more are closed at once
LARGE_RESULT = 64 * 1024  # bytes past which a result is also kept as a workspace file
ENDED = (
    "the run_code call that allowed these servers has ended (this code was left running by "
    "it); call them from a run_code call that names servers=[...]"
)
MAX_SEEN = 1000  # tools per server whose returns are noted for the stubs
# Seconds a closing bridge gives its cancelled calls to end; then they are left to end on their
# own (each within its call's timeout): the sandbox's end, and its execution's, never wait
# on a server.
CLOSE_GRACE = 2.0
REPLY_WAIT = 10.0  # seconds the sandbox's code has to read an answer (then it is dropped)

# (server, method, params, progress) -> {"result": ...} | {"error": {...}}
Call = Callable[[Entry, str, dict[str, Any], Any], Awaitable[dict[str, Any]]]
# A finished call, for the execution's events: server, tool, ms, outcome, sizes, previews.
OnCall = Callable[["CallRecord"], None]


@dataclass(frozen=True)
class BridgeLimits:
    calls: int = 1000  # per execution
    concurrent: int = 8
    bytes: int = 64 << 20  # requests and answers, in all


@dataclass(frozen=True)
class CallRecord:
    server: str
    tool: str
    duration_ms: int
    outcome: str  # ok, error (the tool's), refused (by the host), failed (the server's end)
    sent: int
    received: int
    arguments: str
    result: str


@dataclass
class Bridge:
    """One sandbox's bridge: start() makes the socket in `directory` (bound into the sandbox
    at /run/srt-bridge, with the library), aclose() ends it and its calls."""

    directory: Path
    entries: dict[str, Entry]  # what this execution may call, by name
    call: Call
    on_call: OnCall | None = None
    limits: BridgeLimits = field(default_factory=BridgeLimits)
    owns_directory: bool = True  # (an interpreter's directory is bound: kept, emptied)
    owner_ids: tuple[int, int] | None = None  # the sandbox user's uid and gid
    tools_cache: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # The tools/list each server's instance for this execution's owner (or the shared one)
    # last gave on this replica, by server name (servers/host.py known_tools)
    known_tools: dict[str, list[Any]] = field(default_factory=dict)
    # What tools without an output schema were seen to return, by server then tool (this
    # principal's calls to that instance, kept across bridges by the BridgeMaker)
    seen_returns: dict[str, dict[str, str]] = field(default_factory=dict)
    # An interpreter's cell (its execute request's id; "" until it is sent): a request that
    # names another cell is refused. None: not a cell's (an execution's), nothing checked.
    cell: str | None = None
    # Every server the principal may use (what `entries` was narrowed from): a refusal names
    # the close ones, and how to allow one this execution did not name. No other name.
    usable: frozenset[str] = frozenset()
    _server: asyncio.AbstractServer | None = None
    _calls: int = 0
    _bytes: int = 0
    _active: set[asyncio.Future[Any]] = field(default_factory=set)
    _budget: StubBudget = field(default_factory=lambda: StubBudget())
    _writes: set[concurrent.futures.Future[Any]] = field(default_factory=set)

    async def start(self) -> None:
        known = {n: t for n, t in self.known_tools.items() if n in self.entries}

        def files() -> None:  # (discovery files from the start)
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            write_library(self.directory, list(self.entries))
            for name, tools in known.items():
                seen = dict(self.seen_returns.get(name, {}))
                write_stubs(self.directory / "servers" / name, name, tools, seen, self._budget)

        await self._in_thread(files)
        path = self.directory / SOCKET_NAME
        path.unlink(missing_ok=True)  # (an interpreter's previous bridge)
        self._server = await asyncio.start_unix_server(self._serve, path=str(path))
        # Only the sandbox's user may connect (a host user could read the path off /proc).
        if self.owner_ids is not None and os.geteuid() == 0:
            os.chown(path, *self.owner_ids)
        path.chmod(0o600)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for work in list(self._active):
            work.cancel()
        if self._active:
            # (Their connections' tasks await them and take their errors.)
            _, left = await asyncio.wait(list(self._active), timeout=CLOSE_GRACE)
            if left:
                logger.warning("a closing bridge left {} calls still ending", len(left))
        await self._remove_files()

    async def _in_thread(self, work: Callable[[], None]) -> None:
        """Run `work` (the bridge's file writing) on a stub writer, off the event loop; the
        bridge's files are written one job at a time."""
        job = STUB_WRITERS.submit(self._budget.serially, work)
        self._writes.add(job)
        job.add_done_callback(self._writes.discard)
        await asyncio.wrap_future(job)

    async def _remove_files(self) -> None:
        """Stop the stub writing (a job queued never runs; one running ends at its next
        file), then remove the directory (or, an interpreter's, the socket), in a thread."""
        self._budget.stopped.set()
        for job in list(self._writes):
            if not job.cancel():  # (running: it ends at its next file)
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(job)
        if self.owns_directory:  # (not behind other bridges' stubs: the loop's own threads)
            await asyncio.to_thread(shutil.rmtree, self.directory, ignore_errors=True)
        else:
            (self.directory / SOCKET_NAME).unlink(missing_ok=True)

    @property
    def env(self) -> dict[str, str]:
        return {"MCP_SERVERS_SOCKET": f"/run/srt-bridge/{SOCKET_NAME}"}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._active) >= MAX_CONNECTIONS:  # (each holds a descriptor of the host's)
            writer.close()
            return
        work = scoped(self._one(reader, writer))
        self._active.add(work)
        try:
            await work
        except (asyncio.CancelledError, ConnectionError):
            pass
        except Exception:  # (the root of a connection's task: a hostile answer, our bug)
            logger.exception("a code-mode bridge request failed")
        finally:
            self._active.discard(work)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                (size,) = struct.unpack(">I", await reader.readexactly(4))
                if size > MAX_FRAME:
                    await _reply(writer, _refusal("protocol", f"a request over {MAX_FRAME} bytes"))
                    return
                body = await reader.readexactly(size)
        except (TimeoutError, asyncio.IncompleteReadError):
            return
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            request = None
        if not isinstance(request, dict):
            await _reply(writer, _refusal("protocol", "a request is a JSON object"))
            return
        try:
            answer = await self._answer(request, size)
        except Exception:  # (a hostile server's answer we could not take apart, our bug)
            logger.exception("a code-mode bridge request failed")
            answer = _refusal("failed", "the host could not answer this request (see its log)")
        await _reply(writer, answer)

    async def _answer(self, request: dict[str, Any], size: int) -> dict[str, Any]:
        if self.cell is not None and "cell" in request and request["cell"] != self.cell:
            return _refusal("ended", ENDED)  # (not this cell's: not its calls, nor its events)
        op = request.get("op")
        if op == "servers":
            return _ok([{**e.describe(), "stubs": f"/run/srt-bridge/servers/{n}"}
                        for n, e in self.entries.items()])  # fmt: skip
        if op == "tools":
            entry = self.entries.get(str(request.get("server")))
            if entry is None:
                return self._not_allowed(str(request.get("server")))
            tools = await self._tools(entry)
            return tools if isinstance(tools, dict) else _ok(tools)
        if op == "search":
            return _ok(await self._search(request))
        if op == "call":
            return await self._call(request, size)
        return _refusal("protocol", f"unknown op {op!r} (servers, tools, search, call)")

    def _not_allowed(self, name: str) -> dict[str, Any]:
        tool = "run_code" if self.cell is not None else "execute_code"
        return _refusal("not_allowed", server_refusal(name, self.entries, self.usable, tool))

    async def _unknown_tool(self, entry: Entry, tool: str) -> dict[str, Any] | None:
        """A refusal for a tool the server does not list (None: it may have it). Checked only
        against a list this bridge already has, listed again before it refuses (a server's
        tools can change); a server never listed is simply called."""
        if entry.name not in self.tools_cache and entry.name not in self.known_tools:
            return None
        tools = await self._tools(entry)
        if not isinstance(tools, dict) and any(t.get("name") == tool for t in tools):
            return None
        self.tools_cache.pop(entry.name, None)
        self.known_tools.pop(entry.name, None)
        tools = await self._tools(entry)
        if isinstance(tools, dict):  # (it could not be listed: the call will say why)
            return None
        names = {str(t.get("name")) for t in tools if entry.allows_tool(str(t.get("name")))}
        if tool in names:
            return None
        return _refusal("unknown_tool", tool_refusal(entry.name, tool, names))

    async def _tools(self, entry: Entry) -> list[dict[str, Any]] | dict[str, Any]:
        """The entry's tools (as filtered for it), listed once per bridge."""
        if entry.name in self.tools_cache:
            return self.tools_cache[entry.name]
        known = self.known_tools.get(entry.name)
        if known is not None:
            self.tools_cache[entry.name] = [t for t in known if isinstance(t, dict)]
            return self.tools_cache[entry.name]
        answer = await self.call(entry, "tools/list", {}, None)
        if "error" in answer or not isinstance(answer.get("result"), dict):
            error = answer.get("error") or {}
            return _refusal("failed", str(error.get("message", "tools/list failed")))
        listed = answer["result"].get("tools")
        tools = [t for t in listed if isinstance(t, dict)] if isinstance(listed, list) else []
        self.tools_cache[entry.name] = tools
        await self._stubs(entry.name, tools)
        return tools

    async def _stubs(self, server: str, tools: list[dict[str, Any]]) -> None:
        seen = dict(self.seen_returns.get(server, {}))
        directory = self.directory / "servers" / server
        await self._in_thread(lambda: write_stubs(directory, server, tools, seen, self._budget))

    async def _search(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        words = query_words(str(request.get("query", "")))
        detail = request.get("detail", "summary")
        limit = request.get("limit")
        limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else 20
        found = []
        for entry in self.entries.values():
            tools = await self._tools(entry)
            if isinstance(tools, dict):
                continue
            found += [
                describe_tool(entry.name, t, str(detail)) for t in tools if matches(words, entry, t)
            ]
        return found[: max(1, min(limit, 200))]

    async def _call(self, request: dict[str, Any], size: int) -> dict[str, Any]:
        name, tool = str(request.get("server")), str(request.get("tool"))
        arguments = request.get("arguments") or {}
        started = time.perf_counter()
        entry = self.entries.get(name)
        if entry is None:
            answer = self._not_allowed(name)
        elif not entry.allows_tool(tool):
            answer = _refusal("not_allowed", f"tool {tool!r} of server {name!r} is not allowed")
        elif not isinstance(arguments, dict):
            answer = _refusal("invalid", "arguments must be an object")
        elif self._calls >= self.limits.calls:
            answer = _refusal("limit", f"this execution made {self.limits.calls} calls already")
        elif len(self._active) > self.limits.concurrent:
            answer = _refusal(
                "limit",
                f"{self.limits.concurrent} calls at once at most per execution: make the next "
                "when one has ended (the library queues a process's calls past it itself)",
            )
        elif self._bytes + size > self.limits.bytes:
            answer = _refusal("limit", f"this execution moved {self.limits.bytes} bytes already")
        elif (unknown := await self._unknown_tool(entry, tool)) is not None:
            self._calls += 1  # (it listed the server's tools again: a request, as a call is)
            self._bytes += size
            answer = unknown
        else:
            self._calls += 1
            self._bytes += size
            reply = await self.call(
                entry, "tools/call", {"name": tool, "arguments": arguments}, None
            )
            answer = _ok(reply["result"]) if "result" in reply else _refusal(
                "failed", str(reply.get("error", {}).get("message", "the call failed"))
            )  # fmt: skip
        received = len(json.dumps(answer.get("result", answer.get("error")), default=str))
        if answer.get("ok") and entry is not None and tool not in self.seen_returns.get(name, {}):
            await self._note_returns(entry, tool, answer["result"])
        if answer.get("ok") and received > LARGE_RESULT:
            # Kept as a file of the workspace too (the library writes it, in the sandbox): a
            # later call or the agent reads it there instead of calling the tool again.
            answer["file"] = (
                f"/workspace/.mcp_results/{name}.{tool}.{self.directory.name}-{self._calls}.json"
            )
        self._bytes += received
        self._report(name, tool, started, answer, size, received, arguments)
        return answer

    async def _note_returns(self, entry: Entry, tool: str, result: Any) -> None:
        """A tool without an output schema: what it returned, for its stub from now on."""
        listed = {t.get("name"): t for t in self.tools_cache.get(entry.name, [])}
        if tool not in listed or listed[tool].get("outputSchema") is not None:
            return
        if not isinstance(result, dict) or result.get("isError"):
            return
        content = result.get("content")
        content = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        if isinstance(result.get("structuredContent"), dict):
            seen = f"dict|seen: keys {', '.join(sorted(result['structuredContent']))[:200]}"
        elif len(content) == 1 and content[0].get("type") == "text":
            seen = "str|seen: one text block"
        else:
            kinds = sorted({str(b.get("type")) for b in content})
            seen = f"list|seen: content blocks ({', '.join(kinds)})"
        noted = self.seen_returns.setdefault(entry.name, {})
        if len(noted) < MAX_SEEN:
            noted[tool] = seen
        await self._stubs(entry.name, [listed[tool]])

    def _report(
        self,
        name: str,
        tool: str,
        started: float,
        answer: dict[str, Any],
        sent: int,
        received: int,
        arguments: Any,
    ) -> None:
        if answer.get("ok"):
            outcome = "error" if answer["result"].get("isError") else "ok"
        else:
            outcome = "refused" if answer["error"]["kind"] != "failed" else "failed"
        record = CallRecord(
            server=name,
            tool=tool,
            duration_ms=round((time.perf_counter() - started) * 1000),
            outcome=outcome,
            sent=sent,
            received=received,
            arguments=json.dumps(arguments, default=str)[:PREVIEW],
            result=f"kept in {answer['file']}"
            if "file" in answer
            else json.dumps(answer.get("result", answer.get("error")), default=str)[:PREVIEW],
        )
        if self.on_call is not None:
            try:
                self.on_call(record)
            except Exception:
                logger.exception("a tool_call event was not recorded")


def query_words(query: str) -> list[str]:
    return [w for w in re.split(r"\W+", query.lower()) if w][:20]


def matches(words: list[str], entry: Entry, tool: dict[str, Any]) -> bool:
    """Every word of the query in the server's name, the tool's name or its description."""
    text = f"{entry.name} {tool.get('name', '')} {tool.get('description', '')}".lower()
    return all(w in text for w in words)


def describe_tool(server: str, tool: dict[str, Any], detail: str) -> dict[str, Any]:
    """A tool as search shows it: names, one-line summaries, or full schemas."""
    out: dict[str, Any] = {"server": server, "tool": tool.get("name")}
    if detail in ("summary", "full"):
        description = str(tool.get("description") or "").strip()
        out["summary"] = description.splitlines()[0][:200] if description else ""
    if detail == "full":
        out["description"] = tool.get("description")
        out["input_schema"] = tool.get("inputSchema")
        if tool.get("outputSchema") is not None:
            out["output_schema"] = tool.get("outputSchema")
    return out


def _ok(result: Any) -> dict[str, Any]:
    return {"ok": True, "result": result}


def _refusal(kind: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"kind": kind, "message": message}}


async def _reply(writer: asyncio.StreamWriter, answer: dict[str, Any]) -> None:
    body = json.dumps(answer, separators=(",", ":"), default=str).encode()
    writer.write(struct.pack(">I", len(body)) + body)
    # (Code that does not read its answer holds its connection this long at most, not until
    # its bridge closes.)
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(REPLY_WAIT):
            await writer.drain()
