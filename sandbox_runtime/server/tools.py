"""The MCP tools: thin: validate, call the ExecutionManager, shape a structured result."""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastmcp import Context, FastMCP
from fastmcp.exceptions import ToolError
from fastmcp.server.dependencies import get_access_token, get_context, get_http_request
from fastmcp.tools.base import ToolResult
from loguru import logger
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import BaseModel, Field

from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.execution.execution import Owner
from sandbox_runtime.execution.manager import get_manager
from sandbox_runtime.execution.models import ExecutionInfo, ExecutionStatus
from sandbox_runtime.server.resources import json_text, resource_links
from sandbox_runtime.server.session_path import SCOPE_KEY
from sandbox_runtime.sessions.models import SessionReset
from sandbox_runtime.sessions.operations import Progress, result_fields
from sandbox_runtime.sessions.router import get_router

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
        description="Explicit session name. Executions belong to (token, session); name one to "
        "keep executions across reconnects. Default: the MCP transport session, else 'default'."
    ),
]


CommandArg = Annotated[
    str | list[str], Field(description="Shell command (run by /bin/sh -c) or an argv list.")
]
TimeoutArg = Annotated[
    float | None,
    Field(description="Wall-clock limit, s; the server sets the default and maximum."),
]
InteractiveArg = Annotated[bool, Field(description="Keep stdin open for send_stdin.")]
WorkdirArg = Annotated[
    str | None, Field(description="Directory inside the sandbox, under /workspace or /tmp.")
]
EnvironmentArg = Annotated[dict[str, str] | None, Field(description="Extra environment variables.")]
SandboxConfigArg = Annotated[
    dict[str, Any] | None,
    Field(
        description="Tighter limits: memory_mb, pids, cpu_cores, cpu_time_seconds, "
        "file_size_mb, tmp_size_mb, open_files, output_bytes; pseudo_terminals: false. "
        "Never looser."
    ),
]


class ChangedFile(BaseModel):
    path: str = Field(description="Relative to /workspace.")
    size: int


class ExecutionResult(BaseModel):
    execution_id: str
    status: ExecutionStatus
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None
    error: str | None = None
    duration_ms: int | None = None
    events: list[dict[str, Any]] = Field(default_factory=list)
    next_cursor: int = 0
    has_more: bool = False
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
    next_event_id: str = "0"
    first_available_seq: int = 1
    dropped_bytes: int = 0


class StdinResult(BaseModel):
    execution_id: str
    status: ExecutionStatus
    bytes_written: int
    stdin_open: bool


class CancelResult(BaseModel):
    execution_id: str
    status: ExecutionStatus
    exit_code: int | None = None
    signal: str | None = None
    already_finished: bool = False


class ExecutionList(BaseModel):
    executions: list[ExecutionInfo]
    count: int
    truncated: bool = Field(
        False, description="The list was cut short to keep the reply small: lower `limit`."
    )


def _owner_of(ctx: Context, session: str | None) -> Owner:
    """The caller's owner key: the token's principal and the session it names or is in."""
    token = get_access_token()
    principal = token.client_id if token is not None else ANONYMOUS
    if session is not None:
        if not isinstance(session, str) or not SESSION_RE.fullmatch(session):
            raise ToolError(
                "session must be 1-128 characters of letters, digits and ._:@- (not only dots)"
            )
    transport_session: str | None = None
    with contextlib.suppress(RuntimeError):
        request = get_http_request()
        bound = request.scope.get(SCOPE_KEY)
        if bound is not None:  # /s/{session}/mcp
            if session is not None and session != bound:
                raise ToolError(
                    f"this endpoint is bound to session {bound!r}; the session argument "
                    f"{session!r} disagrees (drop it, or use /s/{session}/mcp)"
                )
            return Owner(principal, f"s:{bound}")
        if session is not None:
            return Owner(principal, f"s:{session}")
        headers = request.headers
        # Only the legacy era has transport sessions. Decide the era as the SDK routes requests,
        # so that a 2026-07-28 request cannot borrow a legacy session's id.
        version = headers.get("mcp-protocol-version")
        if version is None or version in HANDSHAKE_PROTOCOL_VERSIONS:
            transport_session = headers.get("mcp-session-id")
    if session is not None:
        return Owner(principal, f"s:{session}")
    if transport_session:
        return Owner(principal, f"t:{transport_session}")
    return Owner(principal, DEFAULT_SESSION)


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


async def call(op: Callable[[], Awaitable[T]], tool: str, count: bool = True) -> T:
    """Run a manager operation, turning domain errors into tool errors with their message.

    Counts the call, and logs with the request id, session and tool as context.
    """
    metrics = get_manager().metrics
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
            raise ToolError(str(exc)) from None


def _progress_sink(ctx: Context) -> Progress | None:
    """Where a waiting call's output goes: MCP progress notifications, if the caller asked
    for them (sent a progressToken). Without one, report_progress would send nothing: None
    spares the streaming altogether."""
    rc = ctx.request_context
    meta = rc.meta if rc is not None else None
    if meta is None or meta.get("progressToken") is None:
        return None

    async def report(seq: int, text: str) -> None:
        await ctx.report_progress(seq, None, text)

    return report


async def execute(
    ctx: Context, session: str | None, request: dict[str, Any], wait: bool, tool: str
) -> ToolResult:
    """execute_code(_async): the session-bound `execute` operation, on the session's home."""
    owner = owner_of(ctx, session)
    progress = _progress_sink(ctx) if wait else None
    args = {"request": request, "wait": wait}
    result = await call(lambda: get_router().run(owner, "execute", args, progress), tool)
    structured = ExecutionResult.model_validate(result).model_dump(mode="json")
    content = [json_text(structured), *resource_links(owner, result.get("files"))]
    return ToolResult(content=content, structured_content=structured)


def register_tools(mcp: FastMCP) -> None:
    """Add the execution tools to `mcp` (names and parameters of the earlier srt-mcp-server)."""

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
        wait_for_completion: Annotated[
            bool, Field(description="Wait for the end (up to the timeout) and return the output.")
        ] = True,
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
        return await execute(ctx, session, request, wait_for_completion, "execute_code")

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
        return await execute(ctx, session, request, False, "execute_code_async")

    @mcp.tool
    async def get_execution_output(
        ctx: Context,
        execution_id: str,
        wait: Annotated[
            bool, Field(description="Long-poll: block until new output or the end (bounded).")
        ] = False,
        last_event_id: Annotated[
            str | int | None, Field(description="Return events after this event id (cursor).")
        ] = None,
        after: Annotated[int | None, Field(description="Same as last_event_id, as a seq.")] = None,
        limit: Annotated[int, Field(description="Most events to return (<= 1000).")] = 1000,
        wait_seconds: Annotated[
            float | None, Field(description="How long `wait` may block; capped by the server.")
        ] = None,
        session: SessionArg = None,
    ) -> OutputResult:
        """Output events after a cursor. Reading never consumes: any number of readers."""
        manager = get_manager()
        owner = owner_of(ctx, session)
        cursor = _cursor(last_event_id, after)
        wait_for = 0.0
        if wait:
            wait_for = manager.settings.max_wait if wait_seconds is None else wait_seconds
            if wait_for < 0:
                raise ToolError("wait_seconds must not be negative")
        page = await call(
            lambda: get_router().executions.read_output(
                owner, execution_id, cursor, limit, wait_for
            ),
            "get_execution_output",
        )
        events = [e.wire() for e in page.events]
        base = result_fields(page.info, events, page.next_cursor, page.has_more)
        return OutputResult(
            **base,
            next_event_id=str(page.next_cursor),
            first_available_seq=page.first_available,
            dropped_bytes=page.info.dropped_bytes,
        )

    @mcp.tool
    async def send_stdin(
        ctx: Context,
        execution_id: str,
        input_data: str,
        close_stdin: bool = False,
        session: SessionArg = None,
    ) -> StdinResult:
        """Write to the stdin of an interactive execution; optionally close it afterwards."""
        owner = owner_of(ctx, session)
        written, info = await call(
            lambda: get_router().executions.send_stdin(
                owner, execution_id, input_data, close_stdin
            ),
            "send_stdin",
        )
        return StdinResult(
            execution_id=execution_id,
            status=info.status,
            bytes_written=written,
            stdin_open=info.stdin_open,
        )

    @mcp.tool
    async def cancel_execution(
        ctx: Context,
        execution_id: str,
        force: Annotated[
            bool, Field(description="SIGKILL at once, without SIGTERM first.")
        ] = False,
        session: SessionArg = None,
    ) -> CancelResult:
        """Stop an execution and its whole process tree. Idempotent."""
        owner = owner_of(ctx, session)
        was_finished, info = await call(
            lambda: get_router().executions.cancel(owner, execution_id, force), "cancel_execution"
        )
        return CancelResult(
            execution_id=execution_id,
            status=info.status,
            exit_code=info.exit_code,
            signal=info.signal,
            already_finished=was_finished,
        )

    @mcp.tool
    async def get_execution_status(
        ctx: Context, execution_id: str, session: SessionArg = None
    ) -> ExecutionInfo:
        """An execution's metadata: status, exit code, limits, timestamps, output counters."""
        owner = owner_of(ctx, session)
        info = await call(
            lambda: get_router().executions.status(owner, execution_id), "get_execution_status"
        )
        return _brief(info)

    @mcp.tool
    async def list_executions(
        ctx: Context,
        status: Annotated[
            str | None, Field(description="Only executions with this status.")
        ] = None,
        limit: Annotated[int, Field(description="Most executions to return (<= 1000).")] = 100,
        session: SessionArg = None,
    ) -> ExecutionList:
        """The caller's executions in this session, newest first."""
        owner = owner_of(ctx, session)
        infos = await call(
            lambda: get_router().executions.list(owner, status, limit), "list_executions"
        )
        shown: list[ExecutionInfo] = []
        size = 0
        for info in map(_brief, infos):
            size += len(info.model_dump_json())
            if shown and size > LIST_MAX_BYTES:
                break
            shown.append(info)
        return ExecutionList(executions=shown, count=len(shown), truncated=len(shown) < len(infos))


def _brief(info: ExecutionInfo) -> ExecutionInfo:
    """`info` with a long command shortened to a preview."""
    command = _preview(info.command, COMMAND_PREVIEW_CHARS)
    return info if command is info.command else info.model_copy(update={"command": command})


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


def _cursor(last_event_id: str | int | None, after: int | None) -> int:
    values = []
    for name, value in (("last_event_id", last_event_id), ("after", after)):
        if value is None or value == "":
            continue
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ToolError(f"{name} must be an event id (an integer), got {value!r}") from None
        if number < 0:
            raise ToolError(f"{name} must be >= 0")
        values.append(number)
    if len(values) == 2 and values[0] != values[1]:
        raise ToolError("last_event_id and after disagree; send one of them")
    return values[0] if values else 0
