"""The MCP tools: thin: validate, call the ExecutionManager, shape a structured result.

The seven execution tools keep srt-mcp-server 0.2's wire contract (names, parameters, `output`
events with string `event_id` and `ts`, `success` / `was_running`, its status fields, JSON error
bodies); what this server adds are added fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from fastmcp import Context, FastMCP
from fastmcp.server.dependencies import get_access_token, get_context, get_http_request
from fastmcp.tools.base import ToolResult
from loguru import logger
from pydantic import BaseModel, BeforeValidator, Field

from sandbox_runtime.app.services import Root, Services
from sandbox_runtime.domain.models import ExecutionInfo, ExecutionStatus, shown_id
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.domain.owner import session_name as public_name
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.execution.manager import OutputPage
from sandbox_runtime.server.replies import ToolFailure, reply
from sandbox_runtime.server.resources import resource_links
from sandbox_runtime.server.schemas import EnvironmentArg, SandboxConfigArg
from sandbox_runtime.server.session_path import SCOPE_KEY
from sandbox_runtime.sessions.models import SessionReset
from sandbox_runtime.sessions.operations import result_fields

# Used with fullmatch: `$` would also accept a trailing newline ("evil\n").
SESSION_RE = re.compile(r"(?!\.+\Z)[A-Za-z0-9._:@-]{1,128}")  # not "." or "..": path-like
DEFAULT_SESSION = "default"
ANONYMOUS = "anonymous"
# Replies stay far below the official MCP client's 1 MiB limit per SSE event (a reply carries
# its JSON twice; see MAX_BYTES_PER_READ): commands are shown as previews, lists are capped.
COMMAND_PREVIEW_CHARS = 2000
LIST_MAX_BYTES = 256 * 1024

T = TypeVar("T")

SessionArg = Annotated[
    str | None,
    Field(
        description="Session to run in (its workspace, interpreters, executions); omitted: "
        "'default'. Name one to keep work apart from other agents of the same token."
    ),
]
CommandArg = Annotated[
    str | list[str], Field(description="Shell command (run by /bin/sh -c) or an argv list.")
]
TimeoutArg = Annotated[
    float | None,
    Field(description="Wall-clock limit in seconds; the server sets the default and maximum."),
]
InteractiveArg = Annotated[bool, Field(description="Keep stdin open for send_stdin.")]
WorkdirArg = Annotated[
    str | None, Field(description="Directory inside the sandbox, under /workspace or /tmp.")
]
WaitArg = Annotated[
    bool, Field(description="Wait for the end (up to the timeout) and return the output.")
]
ExecutionIdArg = Annotated[
    str, Field(description="The execution_id that execute_code or run_code returned.")
]


class ChangedFile(BaseModel):
    path: str = Field(description="Relative to /workspace.")
    size: int


class ExecutionResult(BaseModel):
    execution_id: str
    status: ExecutionStatus
    exit_code: int | None = None
    output: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Events in order: each has event_id, type, ts and its type's fields "
        "(stdout/stderr: data; exit: code, duration_ms; error: message; ...).",
    )
    next_cursor: str = Field(
        "0", description="The event_id to pass as last_event_id to read what follows."
    )
    has_more: bool = Field(False, description="More events exist past this reply's.")
    session: str = Field("default", description="The session the call ran in.")
    signal: str | None = None
    reason: str | None = None
    error: str | None = None
    duration_ms: int | None = None
    message: str | None = Field(
        None, description="What to do next, when the call returned before the end."
    )
    session_reset: SessionReset | None = Field(
        None,
        description="Set when this call found the session's state gone (its home replica "
        "died or stopped) and started it afresh on another replica: a fresh workspace.",
    )
    files: list[ChangedFile] | None = Field(
        None,
        description="Files in /workspace the call created or changed (at most 50), also "
        "given as resource links (workspace://...).",
    )


class OutputResult(ExecutionResult):
    first_event_id: str = Field(
        "1", description="The oldest event still kept (older ones were dropped by retention)."
    )
    dropped_bytes: int = 0


class StdinResult(BaseModel):
    success: bool = True
    execution_id: str
    status: ExecutionStatus
    bytes_written: int
    stdin_open: bool


class CancelResult(BaseModel):
    success: bool = True
    was_running: bool = Field(description="False: it had already ended.")
    execution_id: str
    status: ExecutionStatus
    exit_code: int | None = None
    signal: str | None = None


class StatusResult(BaseModel):
    """An execution's metadata (0.2's fields first)."""

    id: str
    status: ExecutionStatus
    command: str | list[str]
    interactive: bool
    started_at: float = Field(description="When it was created (seconds since the epoch).")
    completed_at: float | None = None
    exit_code: int | None = None
    error_message: str | None = None
    session: str
    language: str | None = None
    working_directory: str
    timeout_seconds: float
    limits: dict[str, Any] = Field(default_factory=dict)
    signal: str | None = None
    reason: str | None = None
    duration_ms: int | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    dropped_bytes: int = 0
    last_event_id: str = Field("0", description="The newest event's id.")
    stdin_open: bool = False
    execution_count: int | None = None
    replica_id: str


class ExecutionList(BaseModel):
    result: list[StatusResult] = Field(description="The executions, newest first.")
    truncated: bool = Field(
        False, description="The list was cut short to keep the reply small: lower `limit`."
    )


def session_name(owner: Owner) -> str:
    """The session as callers name it."""
    return public_name(owner.session_id)


def _owner_of(ctx: Context, session: str | None) -> Owner:
    """The caller's owner key: the token's principal and the session it names, else `default`
    (in both protocol eras: a client that opens a transport session per call keeps its state)."""
    token = get_access_token()
    principal = token.client_id if token is not None else ANONYMOUS
    if session is not None:
        if not isinstance(session, str) or not SESSION_RE.fullmatch(session):
            raise ToolFailure(
                "session must be 1-128 characters of letters, digits and ._:@- (not only dots)"
            )
    with contextlib.suppress(RuntimeError):
        bound = get_http_request().scope.get(SCOPE_KEY)
        if bound is not None:  # /s/{session}/mcp
            if session is not None and session != bound:
                raise ToolFailure(
                    f"this endpoint is bound to session {bound!r}; the session argument "
                    f"{session!r} disagrees (drop it, or use /s/{session}/mcp)"
                )
            session = bound
    if session is None or session == DEFAULT_SESSION:
        return Owner(principal, DEFAULT_SESSION)
    return Owner(principal, f"s:{session}")


def owner_of(ctx: Context, session: str | None) -> Owner:
    """The caller's owner key (see _owner_of); remembered for this call's log context."""
    owner = _owner_of(ctx, session)
    _owner.set(owner)
    return owner


ERROR_KINDS = {
    "ExecutionNotFoundError": "not_found",
    "ExecutionFinishedError": "finished",
    "InvalidRequestError": "invalid",
    "PolicyViolationError": "policy",
    "LimitExceededError": "limit",
    "OwnerUnavailableError": "owner_unavailable",
    "SandboxUnavailableError": "sandbox_unavailable",
    "SandboxSpawnError": "spawn_failed",
    "FileAccessError": "file",
    "FileMissingError": "not_found",
    "WorkspaceFullError": "quota",
    "DiskFullError": "disk_full",
    "WorkspaceDamagedError": "workspace_damaged",
}
_owner: contextvars.ContextVar[Owner | None] = contextvars.ContextVar("srt_owner", default=None)


async def call(
    services: Services, op: Callable[[], Awaitable[T]], tool: str, count: bool = True
) -> T:
    """Run a manager operation, turning domain errors into tool errors with their message.

    Counts the call, and logs with the request id, session and tool as context.
    """
    metrics = services.manager.metrics
    if count:
        metrics.tool_calls.labels(tool).inc()
    owner = _owner.get()
    request_id = "-"
    with contextlib.suppress(Exception):  # outside a request (tests calling tools directly)
        request_id = str(get_context().request_id)
    with logger.contextualize(
        tool=tool, request_id=request_id, session=owner.session_id if owner else "-"
    ):
        try:
            return await op()
        except SandboxRuntimeError as exc:
            kind = ERROR_KINDS.get(type(exc).__name__, "error")
            metrics.tool_errors.labels(tool, kind).inc()
            logger.info("tool {} refused: {}: {}", tool, type(exc).__name__, exc)
            raise ToolFailure(str(exc), kind) from None


class CallProgress:
    """MCP progress notifications for one waiting call: its output as it comes, and a beat
    every `interval` seconds when there is none, so that a client that resets its request
    timeout on progress survives a program that prints nothing. The progress value counts the
    notifications (the protocol wants it to increase)."""

    def __init__(self, ctx: Context, interval: float) -> None:
        self.ctx = ctx
        self.interval = interval
        self.sent = 0
        self.last = time.monotonic()
        self.began = self.last

    async def report(self, _seq: int, text: str) -> None:
        await self._send(text)

    async def _send(self, text: str) -> None:
        self.sent += 1
        self.last = time.monotonic()
        with contextlib.suppress(Exception):  # a caller that went away must not stop the wait
            await self.ctx.report_progress(self.sent, None, text)

    async def beat(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.last + self.interval - time.monotonic()))
            if time.monotonic() - self.last >= self.interval:
                await self._send(f"waiting: {time.monotonic() - self.began:.0f} s")


@contextlib.asynccontextmanager
async def progress_of(
    ctx: Context, waits: bool, interval: float
) -> AsyncIterator[CallProgress | None]:
    """The progress sink of a call that `waits`, if the caller asked for progress (sent a
    progressToken); None otherwise (report_progress would send nothing: spare the work)."""
    rc = ctx.request_context
    meta = rc.meta if rc is not None else None
    if not waits or meta is None or meta.get("progressToken") is None:
        yield None
        return
    progress = CallProgress(ctx, interval)
    beat = asyncio.get_running_loop().create_task(progress.beat())
    try:
        yield progress
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat


def unfinished_message(result: dict[str, Any]) -> str | None:
    """What a caller does with a result that came back before its execution ended."""
    if ExecutionStatus(result["status"]).finished:
        return None
    return (
        f"Execution {result['execution_id']} is {result['status']}. Read its output with "
        f"get_execution_output(execution_id={result['execution_id']!r}, "
        f"last_event_id={result.get('next_cursor', '0')!r}, wait=true)."
    )


def execution_result(owner: Owner, result: dict[str, Any], model: type[ExecutionResult]) -> dict:
    """A session operation's result as the tool's structured result."""
    shaped = model.model_validate(
        {**result, "session": session_name(owner), "message": unfinished_message(result)}
    )
    return shaped.model_dump(mode="json")


async def execute(
    s: Services,
    ctx: Context,
    session: str | None,
    request: dict[str, Any],
    wait: bool,
    tool: str,
) -> ToolResult:
    """execute_code(_async): the session-bound `execute` operation, on the session's home."""
    owner = owner_of(ctx, session)
    args = {"request": request, "wait": wait}
    async with progress_of(ctx, wait, s.settings.progress_interval) as progress:
        sink = progress.report if progress is not None else None
        result = await call(s, lambda: s.router.run(owner, "execute", args, sink), tool)
    structured = execution_result(owner, result, ExecutionResult)
    return reply(structured, resource_links(owner, result.get("files")))


def register_tools(mcp: FastMCP, root: Root) -> None:
    """Add the execution tools to `mcp` (names and parameters of the earlier srt-mcp-server);
    they reach the running parts through `root`."""

    execution_schema = ExecutionResult.model_json_schema()

    @mcp.tool(output_schema=execution_schema)
    async def execute_code(
        ctx: Context,
        command: CommandArg,
        timeout_seconds: TimeoutArg = None,
        interactive: InteractiveArg = False,
        working_directory: WorkdirArg = None,
        environment: EnvironmentArg = None,
        sandbox_config: SandboxConfigArg = None,
        wait_for_completion: WaitArg = True,
        session: SessionArg = None,
    ) -> ToolResult:
        """Run a command in a fresh sandbox; by default wait for it and return its output."""
        request = {
            "command": command,
            "timeout_seconds": timeout_seconds,
            "interactive": interactive,
            "working_directory": working_directory,
            "environment": environment,
            "sandbox_config": sandbox_config,
        }
        return await execute(
            root.services, ctx, session, request, wait_for_completion, "execute_code"
        )

    @mcp.tool(output_schema=execution_schema)
    async def execute_code_async(
        ctx: Context,
        command: CommandArg,
        timeout_seconds: TimeoutArg = None,
        interactive: InteractiveArg = False,
        working_directory: WorkdirArg = None,
        environment: EnvironmentArg = None,
        sandbox_config: SandboxConfigArg = None,
        session: SessionArg = None,
    ) -> ToolResult:
        """Start a command in a fresh sandbox and return at once with its execution_id."""
        request = {
            "command": command,
            "timeout_seconds": timeout_seconds,
            "interactive": interactive,
            "working_directory": working_directory,
            "environment": environment,
            "sandbox_config": sandbox_config,
        }
        return await execute(root.services, ctx, session, request, False, "execute_code_async")

    @mcp.tool(output_schema=OutputResult.model_json_schema())
    async def get_execution_output(
        ctx: Context,
        execution_id: ExecutionIdArg,
        wait: Annotated[
            bool,
            Field(description="Block until the execution ends (bounded by wait_seconds)."),
        ] = False,
        last_event_id: Annotated[
            str | None,
            BeforeValidator(_id_text),
            Field(description="Only events after this event_id (a previous next_cursor)."),
        ] = None,
        limit: Annotated[int, Field(description="Most events to return (at most 1000).")] = 1000,
        wait_seconds: Annotated[
            float | None,
            Field(description="How long `wait` may block (default and cap: the server's)."),
        ] = None,
        wait_for: Annotated[
            Literal["end", "output"],
            Field(description="With wait: 'end' (as 0.2), or 'output': return at new events."),
        ] = "end",
        session: SessionArg = None,
    ) -> ToolResult:
        """Output events after a cursor. Reading never consumes: any number of readers."""
        s = root.services
        manager = s.manager
        owner = owner_of(ctx, session)
        cursor = _cursor(last_event_id)
        if cursor is None:  # names no event: but an unknown execution is the first problem
            await call(
                s, lambda: s.router.executions.status(owner, execution_id), "get_execution_output"
            )
            raise _event_not_found(last_event_id)
        if isinstance(limit, bool) or limit < 1:
            raise ToolFailure("limit must be a positive integer")
        wait_for_s = 0.0
        if wait:
            wait_for_s = manager.settings.max_wait if wait_seconds is None else wait_seconds
            if not math.isfinite(wait_for_s) or wait_for_s < 0:
                raise ToolFailure("wait_seconds must be a number >= 0")
            wait_for_s = min(wait_for_s, manager.settings.max_wait)

        async def read() -> OutputPage:
            executions = s.router.executions
            if wait_for != "end" or wait_for_s <= 0:
                return await executions.read_output(owner, execution_id, cursor, limit, wait_for_s)
            # Until the end: follow the events as they come (each read returns at new ones),
            # then answer from the caller's cursor.
            deadline = time.monotonic() + wait_for_s
            seen = cursor
            while True:
                left = deadline - time.monotonic()
                page = await executions.read_output(owner, execution_id, seen, 1000, max(0, left))
                if page.info.status.finished or not left > 0 or seen > page.info.last_seq:
                    break
                seen = page.next_cursor
            return await executions.read_output(owner, execution_id, cursor, limit, 0)

        async with progress_of(ctx, wait_for_s > 0, s.settings.progress_interval):
            page = await call(s, read, "get_execution_output")
        # (A later id than this replica has seen, of an execution still running, may be one
        # the Redis copy has not caught up with: an empty page then, not "not found".)
        ahead = cursor > page.info.last_seq and page.info.status.finished
        if ahead or 0 < cursor < page.first_available - 1:
            raise _event_not_found(last_event_id)
        events = [e.public() for e in page.events]
        base = result_fields(page.info, events, page.next_cursor, page.has_more)
        structured = execution_result(
            owner,
            {
                **base,
                "first_event_id": str(page.first_available),
                "dropped_bytes": page.info.dropped_bytes,
            },
            OutputResult,
        )
        return reply(structured)

    @mcp.tool
    async def send_stdin(
        ctx: Context,
        execution_id: ExecutionIdArg,
        input_data: Annotated[
            str,
            Field(description="Text to write; a newline is added if it does not end in one."),
        ],
        close_stdin: Annotated[
            bool, Field(description="Close stdin after writing (the program sees EOF).")
        ] = False,
        append_newline: Annotated[
            bool, Field(description="false: write input_data exactly as given.")
        ] = True,
        session: SessionArg = None,
    ) -> ToolResult:
        """Write to the stdin of an interactive execution (or answer input() in run_code)."""
        s = root.services
        owner = owner_of(ctx, session)
        data = input_data
        if append_newline and isinstance(data, str) and data and not data.endswith("\n"):
            data += "\n"
        written, info = await call(
            s,
            lambda: s.router.executions.send_stdin(owner, execution_id, data, close_stdin),
            "send_stdin",
        )
        result = StdinResult(
            execution_id=execution_id,
            status=info.status,
            bytes_written=written,
            stdin_open=info.stdin_open,
        )
        return reply(result.model_dump(mode="json"))

    @mcp.tool
    async def cancel_execution(
        ctx: Context,
        execution_id: ExecutionIdArg,
        force: Annotated[
            bool, Field(description="SIGKILL at once, without SIGTERM first.")
        ] = False,
        session: SessionArg = None,
    ) -> ToolResult:
        """Stop an execution and its whole process tree. Idempotent."""
        s = root.services
        owner = owner_of(ctx, session)
        was_finished, info = await call(
            s, lambda: s.router.executions.cancel(owner, execution_id, force), "cancel_execution"
        )
        result = CancelResult(
            was_running=not was_finished,
            execution_id=execution_id,
            status=info.status,
            exit_code=info.exit_code,
            signal=info.signal,
        )
        return reply(result.model_dump(mode="json"))

    @mcp.tool
    async def get_execution_status(
        ctx: Context, execution_id: ExecutionIdArg, session: SessionArg = None
    ) -> ToolResult:
        """An execution's metadata: status, exit code, limits, timestamps, output counters."""
        s = root.services
        owner = owner_of(ctx, session)
        info = await call(
            s, lambda: s.router.executions.status(owner, execution_id), "get_execution_status"
        )
        return reply(status_of(info).model_dump(mode="json"))

    @mcp.tool(output_schema={**ExecutionList.model_json_schema(), "x-fastmcp-wrap-result": True})
    async def list_executions(
        ctx: Context,
        status: Annotated[
            str | None, Field(description="Only executions with this status.")
        ] = None,
        limit: Annotated[int, Field(description="Most executions to return (at most 1000).")] = 100,
        session: SessionArg = None,
    ) -> ToolResult:
        """The caller's executions in this session, newest first."""
        s = root.services
        owner = owner_of(ctx, session)
        infos = await call(
            s, lambda: s.router.executions.list(owner, status, limit), "list_executions"
        )
        shown: list[dict[str, Any]] = []
        size = 0
        for info in infos:
            item = status_of(info).model_dump(mode="json")
            size += len(json.dumps(item, ensure_ascii=False).encode())
            if shown and size > LIST_MAX_BYTES:
                break
            shown.append(item)
        structured = {"result": shown, "truncated": len(shown) < len(infos)}
        return reply(structured, items=shown)


def status_of(info: ExecutionInfo) -> StatusResult:
    """An execution's metadata as get_execution_status shows it (long commands shortened)."""
    return StatusResult(
        id=info.execution_id,
        status=info.status,
        command=_preview(info.command, COMMAND_PREVIEW_CHARS),
        interactive=info.interactive,
        started_at=info.started_at or info.created_at,
        completed_at=info.finished_at,
        exit_code=info.exit_code,
        error_message=info.error,
        session=public_name(info.session_id),
        language=info.language,
        working_directory=info.working_directory,
        timeout_seconds=info.timeout_seconds,
        limits=info.limits,
        signal=info.signal,
        reason=info.reason,
        duration_ms=info.duration_ms,
        stdout_bytes=info.stdout_bytes,
        stderr_bytes=info.stderr_bytes,
        dropped_bytes=info.dropped_bytes,
        last_event_id=str(info.last_seq),
        stdin_open=info.stdin_open,
        execution_count=info.execution_count,
        replica_id=info.replica_id,
    )


def _preview(command: str | list[str], budget: int) -> str | list[str]:
    """`command` itself if short, else its first `budget` characters and how much is left out."""
    if isinstance(command, str):
        return _clip(command, budget)
    if sum(map(len, command)) <= budget:
        return command
    out: list[str] = []
    for i, arg in enumerate(command):
        if budget <= 0:
            out.append(f"… [{len(command) - i} more arguments]")
            break
        out.append(_clip(arg, budget))
        budget -= len(arg)
    return out


def _clip(text: str, budget: int) -> str:
    if len(text) <= budget:
        return text
    return f"{text[:budget]}… [{len(text) - budget} more characters]"


def _cursor(last_event_id: str | None) -> int | None:
    """The seq after which to read: an event id is its seq's decimal form; None or "" is the
    start. None: the id names no event (0.2 answered "not found" for ids it did not have)."""
    if last_event_id is None or last_event_id == "":
        return 0
    text = last_event_id.strip() if isinstance(last_event_id, str) else ""
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def _id_text(value: Any) -> Any:
    """An event id sent as a number (as models do) is its decimal text."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _event_not_found(last_event_id: str | None) -> ToolFailure:
    return ToolFailure(
        f"Event ID {shown_id(last_event_id)} not found (may have been evicted)", "not_found"
    )
