"""Session-bound operations, as they run on the session's home replica.

Each takes the parts it works with (the manager, the interpreters, the file URL signer), the
owner, JSON arguments (they may have crossed from another replica) and an optional progress
sink, and returns a JSON-ready dict. The router runs them here or forwards them to the home,
which runs them through the same table.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sandbox_runtime.domain.models import ExecutionInfo
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.execution.requests import ExecuteRequest
from sandbox_runtime.files import operations as files
from sandbox_runtime.files.operations import changed_files, coarse_now
from sandbox_runtime.files.urls import FileUrlSigner
from sandbox_runtime.interpreters.manager import InterpreterManager
from sandbox_runtime.servers.host import ServerHost
from sandbox_runtime.sessions import snapshot_ops, workspace_ops
from sandbox_runtime.sessions.output_log import budget_of, keep_output, screen_extras
from sandbox_runtime.sessions.written import WITHIN_SECONDS
from sandbox_runtime.snapshots.service import Snapshots
from sandbox_runtime.supervisor import scoped

PROGRESS_INTERVAL = 0.2  # at most five output notifications a second per call
PROGRESS_MAX_CHARS = 4096
WAIT_SLACK_SECONDS = 10  # past the execution's own timeout, in case its end is slow to show

Progress = Callable[[int, str], Awaitable[None]]


@dataclass(frozen=True)
class Parts:
    """What session-bound operations work with, handed to the Router by the composition root."""

    manager: ExecutionManager
    interpreters: InterpreterManager
    signer: FileUrlSigner
    servers: ServerHost
    snapshots: Snapshots


Operation = Callable[[Parts, Owner, dict[str, Any], Progress | None], Awaitable[dict]]

REQUEST_FIELDS = frozenset(
    (
        "command",
        "timeout_seconds",
        "interactive",
        "working_directory",
        "environment",
        "sandbox_config",
        "servers",
        "image",
    )
)


def result_fields(
    info: ExecutionInfo, events: list[dict[str, Any]], cursor: int, more: bool
) -> dict:
    """The fields of an execution result (tools.ExecutionResult), JSON-ready."""
    return {
        "execution_id": info.execution_id,
        "status": info.status.value,
        "exit_code": info.exit_code,
        "signal": info.signal,
        "reason": info.reason,
        "error": info.error,
        "duration_ms": info.duration_ms,
        "output": events,
        "next_cursor": str(cursor),
        "has_more": more,
    }


def _request(args: dict[str, Any]) -> ExecuteRequest:
    fields = args.get("request")
    if not isinstance(fields, dict) or not set(fields) <= REQUEST_FIELDS or "command" not in fields:
        raise InvalidRequestError("malformed execute request")
    return ExecuteRequest(**fields)


async def execute(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """Start a command in the owner's workspace; with `wait`, wait for its end (streaming its
    output to `progress`) and return its output's first page."""
    manager = parts.manager
    since = coarse_now()
    execution = await manager.start_execution(owner, _request(args))
    if not args.get("wait"):  # (in the store first: the next call may read it elsewhere)
        await manager.cluster.written(execution, WITHIN_SECONDS)
        return result_fields(execution.info, [], 0, execution.info.last_seq > 0)
    await wait_for_end(execution, progress)
    page = await manager.read_output(owner, execution.execution_id, 0)
    await manager.cluster.written(execution, WITHIN_SECONDS)  # (read elsewhere as it ended)
    events = [e.public() for e in page.events]
    result = result_fields(page.info, events, page.next_cursor, page.has_more)
    result["files"] = await changed_files(manager, owner, since)
    if not args.get("screen", True):  # (JSON text: shown whole, no cut, no log file)
        return result
    screen = await screen_extras(manager, owner, execution, page.next_cursor, budget_of(args))
    return {**result, **screen}


async def wait_for_end(execution: Execution, progress: Progress | None) -> None:
    """Wait (bounded by the execution's timeout) for `execution` to end, streaming its output
    to `progress` meanwhile."""
    forwarder = None
    if progress is not None:
        forwarder = scoped(stream_output(execution, progress))
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(execution.info.timeout_seconds + WAIT_SLACK_SECONDS):
                await execution.finished.wait()
    finally:
        if forwarder is not None:
            forwarder.cancel()


async def stream_output(execution: Execution, progress: Progress) -> None:
    """Send output to `progress` while a call waits (bounded in rate and size)."""
    after = 0
    last_sent = 0.0
    while not execution.finished.is_set():
        await execution.wait_for_events(after, 5.0)
        await asyncio.sleep(max(0.0, last_sent + PROGRESS_INTERVAL - time.monotonic()))
        events, _ = execution.events_after(after, 10_000, PROGRESS_MAX_CHARS * 4)
        if not events:
            continue
        after = events[-1].seq
        text = "".join(e.data or "" for e in events if e.type in ("stdout", "stderr"))
        if not text:
            continue
        if len(text) > PROGRESS_MAX_CHARS:
            text = text[:PROGRESS_MAX_CHARS] + f"… [{len(text) - PROGRESS_MAX_CHARS} more chars]"
        last_sent = time.monotonic()
        with contextlib.suppress(Exception):  # a caller that went away must not stop the wait
            await progress(after, text)


# What a run_code reply carries of rich outputs (the rest stays readable by polling).
RICH_REPLY_BYTES = 320 * 1024


async def run_code(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """Run code in the owner's interpreter of a language; with `wait`, wait for the end
    (streaming its output to `progress`) and return its output, rich results and error."""
    since = coarse_now()
    execution, reset = await parts.interpreters.run(
        owner,
        str(args.get("language") or "python"),
        args.get("code"),  # type: ignore[arg-type]
        args.get("timeout_seconds"),
        args.get("environment"),
        args.get("sandbox_config"),
        args.get("servers"),
        args.get("image"),
    )
    extra: dict[str, Any] = {"language": execution.info.language}
    if reset is not None:
        extra["state_reset"] = {"reason": reset}
    if not args.get("wait"):
        return {**result_fields(execution.info, [], 0, False), **extra}
    await wait_for_end(execution, progress)
    extra["files"] = await changed_files(parts.manager, owner, since)
    result = call_result(execution)
    shown_upto = int(result["next_cursor"])
    if args.get("screen", True):  # (JSON text: shown whole, no cut, no log file)
        budget = budget_of(args)
        extra.update(await screen_extras(parts.manager, owner, execution, shown_upto, budget))
    return {**result, **extra}


def call_result(execution: Execution) -> dict[str, Any]:
    """A finished interpreter call as a run_code result: events (rich outputs referenced by
    index), `results` (MIME bundles, bounded), `error`, `execution_count`."""
    events: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    error = None
    budget = RICH_REPLY_BYTES
    size = 0
    more = False
    for event in execution.events:
        wire = event.public()
        if event.type == "result":
            bundle = wire.pop("bundle", {}) or {}
            cost = sum(len(v) if isinstance(v, str) else 256 for v in bundle.values())
            if cost > budget:
                bundle = {
                    "text/plain": f"[a result of {cost} bytes is not in this reply: read event "
                    f"{event.seq} with get_execution_output]"
                }
            else:
                budget -= cost
            wire["index"] = len(results)
            results.append(bundle)
        elif event.type == "exception" and error is None:
            error = {k: wire.get(k) for k in ("name", "value", "traceback")}
        size += event.wire_size()
        if size > 256 * 1024:
            more = True
            break
        events.append(wire)
    info = execution.info
    next_cursor = int(events[-1]["event_id"]) if events else 0
    return {
        **result_fields(info, events, next_cursor, more),
        "results": results,
        "error": error if error is not None else info.error,
        "execution_count": info.execution_count,
    }


async def list_languages(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    return {"languages": parts.interpreters.languages(owner)}


async def restart_interpreter(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    return await parts.interpreters.restart(
        owner, str(args.get("language") or "python"), args.get("sandbox_config")
    )


async def stop_interpreter(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """Stop the owner's interpreter of a language (the E2B edge's removed code contexts)."""
    language = str(args.get("language") or "python")
    return {"language": language, "stopped": parts.interpreters.stop(owner, language)}


async def server_request(
    parts: Parts, owner: Owner, args: dict[str, Any], progress: Progress | None
) -> dict[str, Any]:
    """One MCP request to a hosted server's instance of this owner (see servers.host)."""
    name, method, params = args.get("server"), args.get("method"), args.get("params")
    if not isinstance(name, str) or not isinstance(method, str) or not isinstance(params, dict):
        raise InvalidRequestError("malformed hosted server request")
    return await parts.servers.request(owner, name, method, params, progress)


OPERATIONS: dict[str, Operation] = {
    "snapshot": snapshot_ops.snapshot,
    "restore": snapshot_ops.restore,
    "end_session": workspace_ops.end_session,
    "stat_file": workspace_ops.stat_file,
    "make_dir": workspace_ops.make_dir,
    "move_file": workspace_ops.move_file,
    "server_request": server_request,
    "execute": execute,
    "run_code": run_code,
    "list_languages": list_languages,
    "restart_interpreter": restart_interpreter,
    "stop_interpreter": stop_interpreter,
    "write_file": lambda parts, owner, args, _: files.write_file(parts.manager, owner, args),
    "read_file": lambda parts, owner, args, _: files.read_file(parts.manager, owner, args),
    "list_files": lambda parts, owner, args, _: files.list_files(parts.manager, owner, args),
    "delete_file": lambda parts, owner, args, _: files.delete_file(parts.manager, owner, args),
    "keep_output": lambda parts, owner, args, _: keep_output(parts.manager, owner, args),
    "create_file_url": lambda parts, owner, args, _: files.create_file_url(
        parts.manager, parts.signer, owner, args
    ),
}


def wait_bound(args: dict[str, Any], max_timeout: float) -> float:
    """How long an operation with `args` may run: its request's timeout, within the server's
    maximum (a forwarded call waits that long for its answer)."""
    request = args.get("request") or {}
    timeout = request.get("timeout_seconds") if isinstance(request, dict) else None
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
        return min(float(timeout), max_timeout)
    return max_timeout
