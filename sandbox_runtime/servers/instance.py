"""One running instance of a hosted stdio MCP server: a sandboxed process the host speaks
JSON-RPC to, one message per line on its stdin and stdout.

The process is hostile until proven otherwise. Every message it sends is bounded in bytes, the
junk it may write between messages is bounded, its stderr is kept only as a bounded tail (and
the operator's log file, rotated), and a request it never answers ends at the entry's call
timeout. Breaking any of these ends the instance, and every call waiting on it is told why.

What the host writes is bounded too: a request is written within its call's timeout, and input
left unread for a call timeout ends the instance (servers/stdin.py). The reader of its output
never waits on a write, nor on a caller (servers/outbox.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from loguru import logger

from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.sandbox.process import SandboxProcess
from sandbox_runtime.servers.log_sink import LogSink
from sandbox_runtime.servers.outbox import NOTIFY_FLUSH, Notify, Outbox
from sandbox_runtime.servers.stdin import Stdin
from sandbox_runtime.supervisor import Supervisor

PROTOCOL_VERSION = "2025-11-25"
# The host as a client: it offers no capabilities (no sampling, elicitation or roots).
INITIALIZE = {
    "protocolVersion": PROTOCOL_VERSION,
    "capabilities": {},
    "clientInfo": {"name": "sandbox_runtime", "version": "1"},
}
LIMITS = ("memory", "cpu", "pids", "file_size", "timeout")
JUNK_BYTES = 1 << 20  # non-JSON-RPC output tolerated on stdout, in all, before the end
STDERR_BURST = 8 << 20  # stderr within STDERR_WINDOW past which an instance is ended
STDERR_WINDOW = 10.0
MAX_IN_FLIGHT = 64  # requests waiting on one instance
READ_CHUNK = 64 * 1024
START_TIMEOUT = 30.0  # initialize, at most


class InstanceError(SandboxRuntimeError):
    """The instance failed the call: it died, timed out or broke the protocol."""


class RemoteError(SandboxRuntimeError):
    """The server answered the request with a JSON-RPC error (passed on as it is)."""

    def __init__(self, error: dict[str, Any]) -> None:
        self.error = error
        super().__init__(str(error.get("message", "error")))


class Instance:
    """A started server process; `initialize` it, then `request` and `notify`."""

    def __init__(
        self,
        name: str,
        process: SandboxProcess,
        *,
        max_message: int,
        call_timeout: float,
        log: LogSink,
        supervisor: Supervisor,
        logs_to_callers: bool = True,
    ) -> None:
        self.name = name
        self.process = process
        self.max_message = max_message
        self.call_timeout = call_timeout
        self.log = log
        # Logging notifications are not tied to a request: they go to the calls in flight when
        # those are all one principal's (not for a shared instance), else to its log only.
        self.logs_to_callers = logs_to_callers
        self.server_info: dict[str, Any] = {}
        self.capabilities: dict[str, Any] = {}
        self.instructions: str | None = None
        self.started_at = time.monotonic()
        self.last_used = time.monotonic()
        self.ended: str | None = None  # why it is no longer usable
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._listeners: dict[int, Outbox] = {}
        self._junk = 0
        self._stdin: Stdin | None = None
        if process.stdin is not None:
            self._stdin = Stdin(process.stdin, name, call_timeout, supervisor, self._kill, log.note)
        self._exit = supervisor.spawn(f"server {name} exit", self._watch_exit())
        self._tasks = [
            supervisor.spawn(f"server {name} stdout", self._read_stdout()),
            supervisor.spawn(f"server {name} stderr", self._read_stderr()),
            self._exit,
        ]

    @property
    def alive(self) -> bool:
        return self.ended is None and self.process.running

    async def exited(self) -> str:
        """Wait for the process to end; why it did."""
        await asyncio.shield(self._exit)
        return self.ended or "exited"

    @property
    def busy(self) -> int:
        return len(self._pending)

    async def initialize(self) -> None:
        result = await self.request(
            "initialize",
            dict(INITIALIZE),
            within=min(START_TIMEOUT, max(self.call_timeout, 5.0)),
        )
        self.server_info = _dict(result.get("serverInfo"))
        self.capabilities = _dict(result.get("capabilities"))
        instructions = result.get("instructions")
        self.instructions = instructions if isinstance(instructions, str) else None
        await self.notify("notifications/initialized", {})

    async def request(
        self,
        method: str,
        params: dict[str, Any] | None,
        *,
        listener: Notify | None = None,
        within: float | None = None,
    ) -> dict[str, Any]:
        """Send a request and wait for its result. Progress notifications naming this
        request's token, and logging notifications meanwhile, go to `listener`.

        Raises RemoteError (the server's JSON-RPC error), InstanceError (it died, broke the
        protocol or did not answer in time). Cancelled: the server is told
        (notifications/cancelled) and the late answer dropped.
        """
        if not self.alive:
            raise InstanceError(f"server {self.name} is not running: {self.ended or 'exited'}")
        if len(self._pending) >= MAX_IN_FLIGHT:
            raise InstanceError(
                f"server {self.name} has {MAX_IN_FLIGHT} requests waiting already; retry later"
            )
        self._next_id += 1
        request_id = self._next_id
        params = with_own_token(params, request_id if listener is not None else None)
        # (Encoded before anything is registered: a request that cannot be sent leaves
        # nothing pending.)
        data = _encode({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        outbox = Outbox(listener) if listener is not None else None
        if outbox is not None:
            self._listeners[request_id] = outbox
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self.last_used = time.monotonic()
        limit = within if within is not None else self.call_timeout
        written = taken = False

        def sent() -> None:
            nonlocal written
            written = True

        try:
            # Writing counts against the call's time: a server that does not read is as
            # stuck as one that does not answer.
            async with asyncio.timeout(limit):
                await self._write(data, sent)
                taken = True
                await asyncio.wait([future])  # (its result or its error: below)
                written = False  # (answered: nothing left to cancel)
            if outbox is not None:  # (the caller's progress goes before its answer)
                await outbox.flush(NOTIFY_FLUSH)
            return future.result()
        except TimeoutError:
            # A server that does not answer (or read) in time is ended (the next call starts
            # it again): whatever holds it may hold every later call too.
            why = (
                f"it did not answer {method} within {limit:g} s"
                if taken
                else f"it did not read its input within {limit:g} s"
            )
            self._pending.pop(request_id, None)
            self._kill(why)
            raise InstanceError(f"server {self.name} was ended: {why}") from None
        except asyncio.CancelledError:
            if written:  # (best effort: never waits on the server)
                cancel = {"requestId": request_id, "reason": "cancelled by the client"}
                self._post(
                    {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": cancel}
                )
            raise
        finally:
            self._pending.pop(request_id, None)
            if not future.cancel() and not future.cancelled():
                future.exception()  # (an end told to it while it was still being written)
            self._listeners.pop(request_id, None)
            if outbox is not None:
                outbox.close(self.name)
            self.last_used = time.monotonic()

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        """Send a notification, within the call timeout (past it the instance is ended).
        Raises InstanceError."""
        try:
            async with asyncio.timeout(self.call_timeout):
                await self._write(_encode({"jsonrpc": "2.0", "method": method, "params": params}))
        except TimeoutError:
            why = f"it did not read its input within {self.call_timeout:g} s"
            self._kill(why)
            raise InstanceError(f"server {self.name} was ended: {why}") from None

    # -- writing -----------------------------------------------------------------------------

    async def _write(self, data: bytes, sent: Callable[[], None] | None = None) -> None:
        """A caller's message, written (its deadline bounds this). Raises InstanceError."""
        if self._stdin is None:
            raise InstanceError(f"server {self.name} has no stdin")
        try:
            await self._stdin.write(data, sent)
        except (ConnectionError, RuntimeError, OSError) as exc:
            self._end(f"its stdin closed ({type(exc).__name__})")  # (or it ended: that)
            raise self._failure() from None

    def _post(self, message: dict[str, Any]) -> None:
        """A message of the host's own, written without waiting (or dropped: see Stdin)."""
        if self._stdin is None or not self.alive:
            return
        try:
            self._stdin.post(_encode(message))
        except (ConnectionError, RuntimeError, OSError) as exc:
            self._end(f"its stdin closed ({type(exc).__name__})")

    # -- reading -----------------------------------------------------------------------------

    async def _read_stdout(self) -> None:
        buffer = bytearray()
        stdout = self.process.stdout
        while True:
            chunk = await stdout.read(READ_CHUNK)
            if not chunk:
                return
            buffer += chunk
            while True:
                end = buffer.find(b"\n")
                if end < 0:
                    break
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                if len(line) > self.max_message:
                    self._kill(f"it sent a message over {self.max_message // 1024} KiB")
                    return
                try:
                    self._on_line(line)
                except Exception as exc:  # (whatever it sent: never a reader left dead)
                    self._kill(f"it broke the protocol ({type(exc).__name__})")
                    return
                if self.ended is not None:
                    return
                # (Lets callers' outboxes take what a burst of lines queued, as it comes:
                # a chunk of many notifications would otherwise overrun them at once.)
                await asyncio.sleep(0)
            if len(buffer) > self.max_message:
                self._kill(f"it sent a message over {self.max_message // 1024} KiB")
                return

    def _on_line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        except RecursionError:  # (it may be the answer a call waits for: end it, at once)
            self._kill("it sent a message nested too deeply to read")
            return
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            self._junk += len(line) + 1
            if self._junk > JUNK_BYTES:
                self._kill("it wrote over 1 MiB to stdout that is not JSON-RPC")
            else:
                self.log.write(b"[stdout, not JSON-RPC] " + line[:500] + b"\n")
            return
        if "method" in message:
            if "id" in message:
                self._answer_server_request(message)
            else:
                self._on_notification(message)
            return
        request_id = message.get("id")
        future = self._pending.get(request_id) if type(request_id) is int else None
        if future is None or future.done():
            return  # (an answer to a cancelled or timed-out request)
        if isinstance(message.get("error"), dict):
            future.set_exception(RemoteError(message["error"]))
        elif isinstance(message.get("result"), dict):
            future.set_result(message["result"])
        else:
            future.set_exception(InstanceError(f"server {self.name} sent a malformed response"))

    def _on_notification(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        params = _dict(message.get("params"))
        if method == "notifications/progress":
            token = params.get("progressToken")
            outbox = self._listeners.get(token) if type(token) is int else None
            if outbox is not None:
                outbox.put(message)
        elif method == "notifications/message":
            if self.logs_to_callers and self._listeners:
                for outbox in self._listeners.values():
                    outbox.put(message)
            else:
                self.log.write(b"[log] " + json.dumps(params)[:2000].encode() + b"\n")

    def _answer_server_request(self, message: dict[str, Any]) -> None:
        """Requests from the server to its client: ping is answered; sampling, elicitation
        and roots are not offered (the capabilities sent at initialize offer none). Never
        waits: a server that does not read its answers loses them (see _post)."""
        if message.get("method") == "ping":
            reply: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"], "result": {}}
        else:
            reply = {
                "jsonrpc": "2.0",
                "id": message["id"],
                "error": {"code": -32601, "message": "not supported by the host"},
            }
        self._post(reply)

    async def _read_stderr(self) -> None:
        stderr = self.process.stderr
        window_start, in_window = time.monotonic(), 0
        while True:
            chunk = await stderr.read(READ_CHUNK)
            if not chunk:
                return
            now = time.monotonic()
            if now - window_start > STDERR_WINDOW:
                window_start, in_window = now, 0
            in_window += len(chunk)
            if in_window > STDERR_BURST:
                self._kill(
                    f"it wrote over {STDERR_BURST >> 20} MiB to stderr within {STDERR_WINDOW:g} s"
                )
                return
            self.log.write(chunk)

    async def _watch_exit(self) -> None:
        outcome = await self.process.wait()
        if outcome.reason in LIMITS:
            how = f"was ended by its {outcome.reason} limit"
        elif outcome.reason is not None:
            how = f"was {outcome.reason}"
        elif outcome.signal is not None:
            how = f"was killed by {outcome.signal_name}"
        else:
            how = f"exited with code {outcome.exit_code}"
        self._end(self.ended or f"it {how}")

    # -- ending ------------------------------------------------------------------------------

    def _kill(self, why: str) -> None:
        self.log.note(f"ended: {why}")
        logger.warning("hosted server {} ended: {}", self.name, why)
        self._end(why)
        self.process.kill("killed")

    def _end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
        error = self._failure()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    def _failure(self) -> InstanceError:
        # Its stderr stays in its log (`servers logs`): it may hold another principal's data
        # (a shared instance) or the entry's secrets.
        return InstanceError(
            f"server {self.name} failed during the call: {self.ended} "
            "(its output is in the operator's log: srt-mcp-server servers logs)"
        )

    async def aclose(self, grace: float = 1.0) -> None:
        """Stop it: stdin closed (stdio servers end at EOF), SIGTERM, then SIGKILL."""
        if self.ended is None:
            self.ended = "stopped"
        stdin = self.process.stdin
        if stdin is not None:
            with contextlib.suppress(Exception):
                stdin.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self.process.ended()
        await self.process.terminate(grace=grace, reason="stopped")
        await self.process.aclose()
        for task in self._tasks:
            task.cancel()
        if self._stdin is not None:
            self._stdin.close()
        self._end(self.ended)


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # (made once, not per call)


def _encode(message: dict[str, Any]) -> bytes:
    """One line of JSON. Raises InstanceError (what cannot be sent as JSON)."""
    try:
        text = _COMPACT.encode(message)
        try:
            return text.encode() + b"\n"
        except UnicodeEncodeError:  # (a lone surrogate, valid in JSON text: sent escaped)
            return json.dumps(message, separators=(",", ":")).encode() + b"\n"
    except (TypeError, ValueError, RecursionError) as exc:
        raise InstanceError(f"the request cannot be sent as JSON ({type(exc).__name__})") from None


def with_own_token(params: dict[str, Any] | None, token: int | None) -> dict[str, Any]:
    """`params` with our own progress token (`token`), or none: the caller's (or another
    caller's) never reaches the server."""
    params = dict(params or {})
    meta = {k: v for k, v in _dict(params.pop("_meta", None)).items() if k != "progressToken"}
    if token is not None:
        meta["progressToken"] = token
    if meta:
        params["_meta"] = meta
    return params


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
