"""The execution tools' structured results: their models, an execution's metadata as shown
(long commands previewed), a reply of an execution that has not ended, and event ids."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from sandbox_runtime.domain.models import ExecutionInfo, ExecutionStatus, shown_id
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.domain.owner import session_name as public_name
from sandbox_runtime.server.calls import session_name
from sandbox_runtime.server.replies import ToolFailure
from sandbox_runtime.server.screens import call as call_text
from sandbox_runtime.sessions.models import SessionReset

# Replies stay far below the official MCP client's 1 MiB limit per SSE event (a reply carries
# its JSON twice; see MAX_BYTES_PER_READ): commands are shown as previews.
COMMAND_PREVIEW_CHARS = 2000


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
        description="Files in /workspace the call created or changed (at most 50): read "
        "them with read_file, or as resources workspace://{session}/{path}.",
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
        False, description="The page was cut short to keep the reply small: lower `limit`."
    )
    next_cursor: str | None = Field(
        None, description="Pass as `cursor` for the older executions; null: none left."
    )


def unfinished_message(result: dict[str, Any], session: str | None = None) -> str | None:
    """What a caller does with a result that came back before its execution ended (a call that
    works as written: with the session, whose ids these are)."""
    if ExecutionStatus(result["status"]).finished:
        return None
    cursor = str(result.get("next_cursor", "0"))
    hint = call_text(
        "get_execution_output",
        session,
        execution_id=result["execution_id"],
        last_event_id=cursor,
        wait=True,
    )
    return f"Execution {result['execution_id']} is {result['status']}. Read its output with {hint}."


def execution_result(owner: Owner, result: dict[str, Any], model: type[ExecutionResult]) -> dict:
    """A session operation's result as the tool's structured result."""
    session = session_name(owner)
    shaped = model.model_validate(
        {**result, "session": session, "message": unfinished_message(result, session)}
    )
    return shaped.model_dump(mode="json")


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


def cursor_of(last_event_id: str | None) -> int | None:
    """The seq after which to read: an event id is its seq's decimal form; None or "" is the
    start. None: the id names no event (0.2 answered "not found" for ids it did not have)."""
    if last_event_id is None or last_event_id == "":
        return 0
    text = last_event_id.strip() if isinstance(last_event_id, str) else ""
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def id_text(value: Any) -> Any:
    """An event id sent as a number (as models do) is its decimal text."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def event_not_found(last_event_id: str | None) -> ToolFailure:
    return ToolFailure(
        f"Event ID {shown_id(last_event_id)} not found (may have been evicted)", "not_found"
    )
