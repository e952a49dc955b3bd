"""One cell run on a kernel: the execute request, and its answers read until the cell is done.

A cell is done when its execute_reply is in AND its idle status (or IDLE_AFTER_REPLY seconds
after the reply, in case the status was dropped with output past the bounds). A kernel whose
output may trail its idle status (its spec's `linger`) is flushed too: a kernel_info request
after the cell, whose own idle status follows whatever the kernel queued on iopub before it.
The three channels are read at once, each by a task scoped to the call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sandbox_runtime.interpreters.kernel_inbox import SIZE
from sandbox_runtime.supervisor import scoped

if TYPE_CHECKING:
    from sandbox_runtime.interpreters.kernel import SandboxedKernel

FLUSH_SECONDS = 1.0  # longest a trailing-output kernel's flush may take
IDLE_AFTER_REPLY = 5.0  # longest a call waits for its idle status once its reply is in

OnMessage = Callable[[str, dict[str, Any]], None]  # (msg_type, content)


async def execute(
    kernel: SandboxedKernel, code: str, on_message: OnMessage, allow_stdin: bool = True
) -> dict[str, Any]:
    """Run `code`; every output message goes to `on_message` as it arrives (and
    ("dropped", {"bytes": N}) for messages of it dropped past QUEUED_MAX_BYTES or
    MESSAGE_MAX_BYTES). The kernel's execute_reply content (status ok, error or aborted).

    Raises KernelDiedError (the state is gone).
    """
    content = {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": allow_stdin, "stop_on_error": False,
    }  # fmt: skip
    inbox = kernel.inbox
    msg_id = kernel.send("shell", "execute_request", content)
    kernel.cell_sent(msg_id)
    inbox.want(msg_id)
    reported = inbox.dropped_bytes

    def report_drops() -> None:  # (messages of this call dropped since last said)
        nonlocal reported
        if inbox.dropped_bytes > reported:
            on_message("dropped", {"bytes": inbox.dropped_bytes - reported})
            reported = inbox.dropped_bytes

    reply: dict[str, Any] | None = None
    replied_at = 0.0
    idle = False
    iopub = scoped(kernel.next_message("iopub", None))
    shell = scoped(kernel.next_message("shell", None))
    stdin = scoped(kernel.next_message("stdin", None))
    pending = {iopub, shell, stdin}
    # A kernel whose output may trail the cell's idle status (spec.linger) is flushed: a
    # kernel_info request after the cell, whose own idle status comes after everything
    # the kernel queued on iopub before it, and at least `linger` seconds.
    barrier: str | None = None
    flushed = False
    linger_until = deadline = 0.0
    try:
        while True:
            report_drops()
            if reply is not None and not idle:
                # (the idle status may have been dropped with output past the bounds)
                if time.monotonic() - replied_at >= IDLE_AFTER_REPLY:
                    break
            if reply is not None and idle:
                if not kernel.spec.linger:
                    break
                now = time.monotonic()
                if barrier is None:
                    barrier = kernel.send("shell", "kernel_info_request", {})
                    inbox.want(barrier)
                    linger_until, deadline = now + kernel.spec.linger, now + FLUSH_SECONDS
                elif (flushed and now >= linger_until) or now >= deadline:
                    break
            wait = None
            if barrier is not None:
                until = linger_until if flushed else deadline
                wait = max(0.0, until - time.monotonic())
            elif reply is not None:
                wait = max(0.0, replied_at + IDLE_AFTER_REPLY - time.monotonic())
            done, _ = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.discard(task)
                msg = task.result()  # KernelDiedError propagates
                if task is iopub:
                    iopub = scoped(kernel.next_message("iopub", None))
                    pending.add(iopub)
                    parent = msg["parent_header"].get("msg_id")
                    if parent == barrier and msg["msg_type"] == "status":
                        flushed = flushed or msg["content"].get("execution_state") == "idle"
                    if parent != msg_id:
                        continue
                    if reply is not None:  # (its output goes on: wait on for its idle)
                        replied_at = time.monotonic()
                    kind = msg["msg_type"]
                    if kind == "status":
                        idle = idle or msg["content"].get("execution_state") == "idle"
                    elif kind != "execute_input":
                        on_message(kind, msg["content"])
                elif task is shell:
                    # (read on after the reply too: what follows it is dropped, not held)
                    shell = scoped(kernel.next_message("shell", None))
                    pending.add(shell)
                    if reply is None and msg["parent_header"].get("msg_id") == msg_id:
                        reply = dict(msg["content"])
                        replied_at = time.monotonic()
                    else:  # (a second "reply", or an answer to nothing of this call's)
                        inbox.unsolicited(msg[SIZE])
                elif task is stdin:
                    stdin = scoped(kernel.next_message("stdin", None))
                    pending.add(stdin)
                    if msg["msg_type"] == "input_request":
                        on_message("input_request", msg["content"])
    finally:
        inbox.release(msg_id, barrier)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    report_drops()
    assert reply is not None
    return reply
