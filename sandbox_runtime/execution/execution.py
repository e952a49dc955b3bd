"""One execution: its sandboxed process, the pumps that read its output, its event log."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from loguru import logger

from sandbox_runtime.domain.models import (
    EventType,
    ExecutionInfo,
    ExecutionStatus,
    OutputEvent,
)
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import ExecutionFinishedError, InvalidRequestError
from sandbox_runtime.sandbox import SandboxOutcome, SandboxProcess

CHUNK_BYTES = 64 * 1024  # largest piece of output one event carries
MAX_EVENTS_IN_MEMORY = 20_000
GATHER_SECONDS = 0.01  # after a small read, how long output gathers before the next
GATHER_AFTER = 32  # reads of a stream before gathering starts (short commands never wait)
MAX_STDIN_BYTES = 1024 * 1024

LIMIT_MESSAGES = {
    "memory": "memory limit reached: the kernel killed the process",
    "cpu": "CPU time limit reached",
    "file_size": "file size limit reached",
    "pids": "process limit reached: fork() failed inside the sandbox",
}


class CallRunner(Protocol):
    """What runs an execution that is not a process of its own (an interpreter call)."""

    async def write_stdin(self, data: str, close: bool) -> int: ...

    async def cancel(self, force: bool, grace: float) -> None: ...


class Execution:
    """An execution and its output. The ExecutionManager creates, runs and evicts these."""

    def __init__(self, info: ExecutionInfo, owner: Owner, output_limit: int) -> None:
        self.info = info
        self.owner = owner
        self.output_limit = output_limit
        self.process: SandboxProcess | None = None
        self.runner: CallRunner | None = None
        self.finished = asyncio.Event()
        self.events: deque[OutputEvent] = deque()
        self._sizes: deque[int] = deque()  # each event's bytes held (retention's measure)
        self.first_seq = 1  # oldest seq still held in memory
        self.listeners: list[Callable[[Execution, list[OutputEvent]], None]] = []
        self._wakeup = asyncio.Event()  # set and replaced on every change
        self._retained_bytes = 0
        self._other_bytes = 0  # an interpreter call's results, errors, prompts and drops
        self._truncated = False
        self._drops_noted = False  # an interpreter call's dropped messages were said
        self.kept_log: dict[str, object] | None = None  # its output's file (output_log)

    @property
    def execution_id(self) -> str:
        return self.info.execution_id

    @property
    def status(self) -> ExecutionStatus:
        return self.info.status

    @property
    def retained_bytes(self) -> int:
        """Bytes of output this execution holds in memory."""
        return self._retained_bytes

    # -- events ------------------------------------------------------------------------------

    def emit(self, event_type: EventType, size: int | None = None, **fields: object) -> OutputEvent:
        """Append an event; `size`: about how many bytes it holds (default: its data's)."""
        self.info.last_seq += 1
        event = OutputEvent(
            seq=self.info.last_seq,
            type=event_type,
            ts=time.time(),
            **fields,  # type: ignore[arg-type]
        )
        cost = size if size is not None else len(event.data) if event.data else 0
        self.events.append(event)
        self._sizes.append(cost)
        self._retained_bytes += cost
        while len(self.events) > MAX_EVENTS_IN_MEMORY:
            old = self.events.popleft()
            self.first_seq = old.seq + 1
            self._retained_bytes -= self._sizes.popleft()
        for listener in self.listeners:
            listener(self, [event])
        self._notify()
        return event

    def _notify(self) -> None:
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    def events_after(
        self, after: int, limit: int, max_bytes: int
    ) -> tuple[list[OutputEvent], bool]:
        """Events with seq > after: at most `limit` of them and `max_bytes` of JSON (but >= 1)."""
        if after >= self.info.last_seq:
            return [], False
        start = max(0, after + 1 - self.first_seq)
        out: list[OutputEvent] = []
        size = 0
        for i in range(start, len(self.events)):
            event = self.events[i]
            size += event.wire_size()
            if out and (len(out) >= limit or size > max_bytes):
                return out, True
            out.append(event)
        return out, False

    async def wait_for_events(self, after: int, wait_seconds: float) -> None:
        """Return when there is an event after `after`, the execution finished, or time is up."""
        deadline = time.monotonic() + wait_seconds
        while self.info.last_seq <= after and not self.finished.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)

    # -- running -----------------------------------------------------------------------------

    def attach(self, process: SandboxProcess) -> Coroutine[Any, Any, None]:
        """The execution now owns `process`; returns the work that pumps its output until it
        ends (the manager runs it under its supervisor)."""
        self.process = process
        self.info.status = ExecutionStatus.RUNNING
        self.info.started_at = time.time()
        self.info.stdin_open = process.stdin is not None
        self.emit(EventType.READY)
        return self._run(process)

    def begin_call(self) -> None:
        """An interpreter call (its `runner` set when it was queued) starts running."""
        self.info.status = ExecutionStatus.RUNNING
        self.info.started_at = time.time()
        self.info.stdin_open = True
        self.emit(EventType.READY)

    def record_output(self, kind: EventType, text: str) -> None:
        """Output an interpreter call produced (counted and capped like a process's), in
        events of at most CHUNK_BYTES as a process's: a kernel sends what a cell printed
        in one message however large (200,000 lines were one event of 600 KB)."""
        for piece in chunks(text, CHUNK_BYTES):
            self._record_output(kind, piece, len(piece.encode("utf-8", "surrogatepass")))

    def record_event(self, kind: EventType, size: int, **fields: object) -> None:
        """An interpreter call's other event (a result, an exception, an input request) of
        about `size` bytes: counted against the output limit like output, and dropped (with
        its bytes counted) once the limit is reached."""
        self._other_bytes += size
        if not self._admit(size):
            return
        self.emit(kind, size, **fields)

    def record_dropped(self, size: int, why: str) -> None:
        """Output of an interpreter call that was dropped before it reached the call."""
        self._other_bytes += size
        self.info.dropped_bytes += size
        if not self._drops_noted:  # (once: the call's end sums up what was dropped in all)
            self._drops_noted = True
            self.emit(EventType.TRUNCATED, message=why, dropped_bytes=self.info.dropped_bytes)

    def _admit(self, size: int) -> bool:
        """Whether `size` more bytes (already counted) fit the output limit; the first time
        they do not, a truncated event says so."""
        if self._truncated:
            self.info.dropped_bytes += size
            return False
        if self._kept() <= self.output_limit:
            return True
        self.info.dropped_bytes += size
        self._limit_reached()
        return False

    def _kept(self) -> int:
        """Bytes of output counted and not dropped."""
        info = self.info
        return info.stdout_bytes + info.stderr_bytes + self._other_bytes - info.dropped_bytes

    def _limit_reached(self) -> None:
        self._truncated = True
        self.emit(
            EventType.TRUNCATED,
            message=f"output limit of {self.output_limit} bytes reached; "
            "further output is dropped (the process keeps running)",
            dropped_bytes=self.info.dropped_bytes,
        )

    def end_call(
        self,
        status: ExecutionStatus,
        exit_code: int | None,
        reason: str | None = None,
        error: str | None = None,
    ) -> None:
        """An interpreter call ended: record it as a process's end is recorded."""
        info = self.info
        info.finished_at = time.time()
        started = info.started_at or info.created_at
        info.duration_ms = int((info.finished_at - started) * 1000)
        info.status, info.exit_code, info.reason, info.error = status, exit_code, reason, error
        info.stdin_open = False
        if self._truncated or self._drops_noted:
            self.emit(
                EventType.TRUNCATED,
                message=f"{info.dropped_bytes} bytes of output were dropped in all",
                dropped_bytes=info.dropped_bytes,
            )
        if status is ExecutionStatus.TIMEOUT:
            self.emit(EventType.TIMEOUT, message=error or "timed out")
        elif status is ExecutionStatus.CANCELLED:
            self.emit(EventType.CANCELLED, message=error or "cancelled")
        elif error:
            self.emit(EventType.ERROR, message=error)
        self.emit(EventType.EXIT, code=exit_code, duration_ms=info.duration_ms)
        self.runner = None
        self.finished.set()
        self._notify()

    def fence(self, message: str) -> None:
        """The cluster took this execution from this replica (its session moved, or the store
        says it is lost) while the replica's heartbeat had lapsed: it ends `lost`, which is
        final, whatever it did since (the caller stopped it first)."""
        info = self.info
        if info.status is ExecutionStatus.LOST:
            return
        info.status = ExecutionStatus.LOST
        info.reason = "lost"
        info.error = message
        info.stdin_open = False
        info.finished_at = info.finished_at or time.time()
        self.emit(EventType.ERROR, message=message)
        self.finished.set()

    def fail_to_start(self, message: str) -> None:
        now = time.time()
        self.info.status = ExecutionStatus.FAILED
        self.info.error = message
        self.info.finished_at = now
        self.info.duration_ms = 0
        self.emit(EventType.ERROR, message=message)
        self.finished.set()

    async def _run(self, process: SandboxProcess) -> None:
        try:
            stderr_head: list[bytes] = []
            await asyncio.gather(
                self._pump(process.stdout, EventType.STDOUT, None),
                self._pump(process.stderr, EventType.STDERR, stderr_head),
            )
            outcome = await process.wait()
            self._finish(outcome, b"".join(stderr_head))
        except Exception as exc:  # root of the execution's task: record, never lose the end
            logger.exception("execution {} failed internally", self.execution_id)
            if not self.status.finished:
                self.info.status = ExecutionStatus.FAILED
                self.info.error = f"internal error: {exc}"
                self.emit(EventType.ERROR, message=self.info.error)
        finally:
            await process.aclose()
            self.info.stdin_open = False
            # A finished execution is kept for the retention period: let go of the process,
            # whose tasks, timers and contexts pin the starting request (its scope, headers,
            # auth, log context): ~30 KB per retained execution. (This pump's own task is the
            # supervisor's, and dropped by it once done.)
            self.process = None
            self.finished.set()
            self._notify()

    async def _pump(
        self, reader: asyncio.StreamReader, kind: EventType, head: list[bytes] | None
    ) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        reads = 0
        while True:
            chunk = await reader.read(CHUNK_BYTES)
            reads += 1
            if head is not None and sum(map(len, head)) < 4096:
                head.append(chunk[:4096])
            final = not chunk
            text = decoder.decode(chunk, final=final)
            if text:
                self._record_output(kind, text, len(chunk))
            if final:
                return
            if reads > GATHER_AFTER and len(chunk) < CHUNK_BYTES // 4:
                # A program that writes line by line (PYTHONUNBUFFERED) would make an event
                # per line, and the oldest of MAX_EVENTS_IN_MEMORY would be dropped: gather
                # what it writes for a moment into one event instead. (Not from the first
                # read: a short command's end would wait for it.)
                await asyncio.sleep(GATHER_SECONDS)

    def _record_output(self, kind: EventType, text: str, raw_bytes: int) -> None:
        if kind is EventType.STDOUT:
            self.info.stdout_bytes += raw_bytes
        else:
            self.info.stderr_bytes += raw_bytes
        if self._truncated:
            self.info.dropped_bytes += raw_bytes
            return
        kept = self._kept()
        if kept > self.output_limit:
            over = kept - self.output_limit
            keep_chars = max(0, len(text) - over)
            if keep_chars:
                self.emit(kind, data=text[:keep_chars])
            self.info.dropped_bytes += over
            self._limit_reached()
            return
        self.emit(kind, data=text)

    def _finish(self, outcome: SandboxOutcome, stderr_head: bytes) -> None:
        info = self.info
        info.finished_at = time.time()
        info.duration_ms = int(outcome.duration_s * 1000)
        info.exit_code = outcome.exit_code
        info.signal = outcome.signal_name
        info.reason = outcome.reason
        if self._truncated:
            self.emit(
                EventType.TRUNCATED,
                message=f"{info.dropped_bytes} bytes of output were dropped in all",
                dropped_bytes=info.dropped_bytes,
            )
        # bwrap reports the child's pid before it finishes setting the sandbox up; a setup
        # failure after that looks like exit 1 with bwrap's own message on stderr.
        setup_failed = outcome.exit_code == 1 and stderr_head.startswith(b"bwrap: ")
        # A sandbox we stopped (cancel, shutdown, timeout) before it reported its start did not
        # fail to start: the branches below say what ended it.
        stopped = outcome.reason in ("timeout", "cancelled", "shutdown")
        if (not outcome.started and not stopped) or setup_failed:
            info.status = ExecutionStatus.FAILED
            detail = stderr_head.decode("utf-8", "replace").strip() or "no detail"
            info.error = f"the sandbox failed to start: {detail}"
            self.emit(EventType.ERROR, message=info.error)
        elif outcome.reason == "timeout":
            info.status = ExecutionStatus.TIMEOUT
            self.emit(
                EventType.TIMEOUT, message=f"timed out after {info.timeout_seconds:g} seconds"
            )
        elif outcome.reason in ("cancelled", "shutdown"):
            info.status = ExecutionStatus.CANCELLED
            message = "cancelled" if outcome.reason == "cancelled" else "server shutting down"
            self.emit(EventType.CANCELLED, message=message)
        elif outcome.reason in LIMIT_MESSAGES:
            info.status = ExecutionStatus.FAILED
            info.error = LIMIT_MESSAGES[outcome.reason]
            self.emit(EventType.RESOURCE_LIMIT, reason=outcome.reason, message=info.error)
        else:
            info.status = ExecutionStatus.COMPLETED
            if "pids" in outcome.limits_reached:
                self.emit(EventType.RESOURCE_LIMIT, reason="pids", message=LIMIT_MESSAGES["pids"])
        self.emit(
            EventType.EXIT,
            code=outcome.exit_code,
            signal=outcome.signal_name,
            duration_ms=info.duration_ms,
        )

    # -- control -----------------------------------------------------------------------------

    async def write_stdin(self, data: str, close: bool) -> int:
        """Write to the process's stdin. Raises ExecutionFinishedError, InvalidRequestError."""
        if self.runner is not None and not self.status.finished:
            return await self.runner.write_stdin(data, close)
        if self.status.finished or self.process is None or not self.process.running:
            raise ExecutionFinishedError(f"execution {self.execution_id} has already finished")
        stdin = self.process.stdin
        if stdin is None:
            raise InvalidRequestError(
                f"execution {self.execution_id} was not started with interactive=true; "
                "it has no stdin"
            )
        if not self.info.stdin_open:
            raise InvalidRequestError(f"stdin of execution {self.execution_id} is closed")
        payload = data.encode("utf-8", "surrogatepass")
        if len(payload) > MAX_STDIN_BYTES:
            raise InvalidRequestError(
                f"input_data is {len(payload)} bytes; at most {MAX_STDIN_BYTES} per call"
            )
        pending = stdin.transport.get_write_buffer_size()
        if pending + len(payload) > MAX_STDIN_BYTES:
            raise InvalidRequestError(
                f"{pending} bytes sent earlier are still waiting for the process to read them; "
                f"at most {MAX_STDIN_BYTES} may wait at once"
            )
        try:
            if payload:
                stdin.write(payload)
                await asyncio.wait_for(stdin.drain(), timeout=10)
            if close:
                stdin.close()
                self.info.stdin_open = False
        except (BrokenPipeError, ConnectionResetError):
            self.info.stdin_open = False
            raise ExecutionFinishedError(
                f"execution {self.execution_id} closed its stdin (the process is exiting)"
            ) from None
        except TimeoutError:
            raise InvalidRequestError(
                "the process is not reading its stdin; the write timed out after 10 s"
            ) from None
        return len(payload)

    async def cancel(self, force: bool, grace: float) -> None:
        """Stop the process tree (gracefully unless `force`) and wait until it is gone."""
        if self.runner is not None and not self.status.finished:
            await self.runner.cancel(force, grace)
            await self.finished.wait()
            return
        process = self.process
        if process is None or self.status.finished:
            return
        if force:
            process.kill("cancelled")
        else:
            await process.terminate(grace=grace, reason="cancelled")
        await self.finished.wait()


def chunks(text: str, max_bytes: int) -> list[str]:
    """`text` in pieces of at most `max_bytes` UTF-8 bytes each (whole characters)."""
    if len(text) <= max_bytes // 4 or len(text.encode("utf-8", "surrogatepass")) <= max_bytes:
        return [text]
    out: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + max_bytes)
        while len(text[start:end].encode("utf-8", "surrogatepass")) > max_bytes:
            end = start + max(1, (end - start) * 3 // 4)
        out.append(text[start:end])
        start = end
    return out
