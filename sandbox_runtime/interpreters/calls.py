"""One run_code call on an interpreter: its turn in the queue, its run, and how it ends.

A call waits for its interpreter's lock, then runs there. A timeout or a cancel interrupts it
and keeps the interpreter; one that does not stop within the grace period is killed, and the
call says its state is lost. The InterpreterManager queues calls (`run`) and hears of a kernel
that died under one (`interpreter_died`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from loguru import logger

from sandbox_runtime.domain.models import ExecutionStatus
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.interpreters.interpreter import Interpreter
from sandbox_runtime.interpreters.kernel import KernelDiedError
from sandbox_runtime.interpreters.outputs import CallOutput
from sandbox_runtime.supervisor import scoped

if TYPE_CHECKING:
    from sandbox_runtime.interpreters.manager import InterpreterManager


class CallRun:
    """One run_code call's runner: stdin answers its input requests; cancel interrupts it."""

    def __init__(self, execution: Execution) -> None:
        self.execution = execution
        self.interpreter: Interpreter | None = None
        self.awaiting_input = False
        self.stop_reason: str | None = None  # "cancelled" / "timeout" once asked to stop
        self.task: asyncio.Task[None] | None = None
        self.call: asyncio.Future[Any] | None = None  # the kernel's execute, once it runs
        self.lost_state = False
        self.servers: list[str] | None = None  # code mode: what its code may call

    async def write_stdin(self, data: str, close: bool) -> int:
        if not isinstance(data, str):
            raise InvalidRequestError("input_data must be a string")
        if self.interpreter is None or not self.awaiting_input:
            raise InvalidRequestError(
                f"execution {self.execution.execution_id} is not waiting for input "
                "(an input_request event says when it is)"
            )
        self.awaiting_input = False
        try:
            self.interpreter.kernel.input_reply(data[:-1] if data.endswith("\n") else data)
        except KernelDiedError as exc:
            raise InvalidRequestError(
                f"execution {self.execution.execution_id}'s interpreter is gone: {exc}"
            ) from exc
        return len(data.encode("utf-8", "surrogatepass"))

    async def cancel(self, force: bool, grace: float) -> None:
        await stop_call(self, "cancelled", force, grace)

    def input_requested(self) -> None:
        self.awaiting_input = True


async def run_call(
    interpreters: InterpreterManager, interpreter: Interpreter, run: CallRun, code: str
) -> None:
    """A queued call, to its end: waits its turn, runs, records how it ended (whatever
    happens: the root of a call's task)."""
    execution = run.execution
    try:
        async with interpreter.lock:
            interpreter.waiting -= 1
            if run.stop_reason is not None or execution.status.finished:
                return  # cancelled while it waited
            interpreter.busy = True
            run.interpreter = interpreter
            interpreter.current = execution
            execution.begin_call()
            try:
                # Its bridge, for its run only: a call queued behind it has its own.
                kernel, makers = interpreter.kernel, interpreters.manager.bridges
                await kernel.use_bridge(makers, execution.owner, run.servers, execution)
                await _execute(interpreters, interpreter, run, code)
            finally:
                await interpreter.kernel.use_bridge([], execution.owner, None, execution)
                interpreter.current = None
                interpreter.busy = False
                interpreter.last_used = time.monotonic()
                interpreter.calls += 1
    except Exception as exc:  # the root of a call's task: record, never lose the end
        logger.exception("interpreter call {} failed", execution.execution_id)
        if not execution.status.finished:
            execution.end_call(ExecutionStatus.FAILED, None, "error", f"internal error: {exc}")


async def _execute(
    interpreters: InterpreterManager, interpreter: Interpreter, run: CallRun, code: str
) -> None:
    execution = run.execution
    output = CallOutput(execution, run.input_requested)
    call = scoped(interpreter.kernel.execute(code, output))
    run.call = call
    timeout = execution.info.timeout_seconds
    try:
        done, _ = await asyncio.wait({call}, timeout=timeout)
        if not done and run.stop_reason is None:
            await stop_call(run, "timeout", False, interpreters.settings.cancel_grace)
        reply = await call
    except KernelDiedError as exc:
        if interpreters.closed and run.stop_reason is None:  # stopped with the server (aclose)
            execution.end_call(ExecutionStatus.CANCELLED, None, "shutdown", "server shutting down")
            return
        interpreters.interpreter_died(interpreter, killed=run.lost_state)
        message = (
            "the interpreter did not stop within the grace period and was killed: its "
            "state (variables, imports) is lost"
            if run.lost_state
            else str(exc)
            if interpreter.kernel.end_reason
            else f"the interpreter died: {exc}; its state is lost"
        )
        status = {
            "timeout": ExecutionStatus.TIMEOUT,
            "cancelled": ExecutionStatus.CANCELLED,
        }.get(run.stop_reason or "", ExecutionStatus.FAILED)
        execution.end_call(status, None, run.stop_reason or "crashed", message)
        return
    except BaseException:  # (this call's task cancelled: its kernel's execute goes with it)
        call.cancel()
        raise
    count = reply.get("execution_count")
    if isinstance(count, int):
        execution.info.execution_count = count
    if run.stop_reason == "timeout":
        execution.end_call(
            ExecutionStatus.TIMEOUT,
            None,
            "timeout",
            f"timed out after {execution.info.timeout_seconds:g} seconds and was "
            "interrupted; the interpreter keeps its state",
        )
    elif run.stop_reason == "cancelled":
        execution.end_call(ExecutionStatus.CANCELLED, None, "cancelled", "interrupted")
    else:
        failed = reply.get("status") == "error" or output.failed
        execution.end_call(ExecutionStatus.COMPLETED, 1 if failed else 0)


async def stop_call(run: CallRun, reason: str, force: bool, grace: float) -> None:
    """Interrupt a call (or drop it from the queue); kill its interpreter if it does not
    stop within `grace` seconds, or at once with `force`."""
    if run.stop_reason is not None or run.execution.status.finished:
        return
    run.stop_reason = reason
    interpreter = run.interpreter
    if interpreter is None:  # still queued: it ends now, and is skipped when its turn comes
        run.execution.begin_call()
        status = ExecutionStatus.TIMEOUT if reason == "timeout" else ExecutionStatus.CANCELLED
        run.execution.end_call(status, None, reason, f"{reason} before it started")
        return
    call = run.call
    if not force and call is not None:
        interpreter.kernel.interrupt()
        await asyncio.wait({call}, timeout=grace)
    if call is None or not call.done():
        run.lost_state = True
        await interpreter.kernel.stop()
