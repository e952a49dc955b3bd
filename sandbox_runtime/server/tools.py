"""The MCP tools: thin: validate, call the ExecutionManager, shape a structured result.
(The plumbing every tool shares is calls.py's; the results' models and shaping results.py's.)

The seven execution tools keep srt-mcp-server 0.2's wire contract (names, parameters, `output`
events with string `event_id` and `ts`, `success` / `was_running`, its status fields, JSON error
bodies); what this server adds are added fields.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import Annotated, Any, Literal

from fastmcp import Context, FastMCP
from fastmcp.tools.base import ToolResult
from pydantic import BeforeValidator, Field

from sandbox_runtime.app.services import Root, Services
from sandbox_runtime.execution.manager import OutputPage
from sandbox_runtime.server.calls import SessionArg as SessionArg
from sandbox_runtime.server.calls import call as call
from sandbox_runtime.server.calls import owner_of as owner_of
from sandbox_runtime.server.calls import progress_of as progress_of
from sandbox_runtime.server.calls import session_name as session_name
from sandbox_runtime.server.replies import ToolFailure, reply
from sandbox_runtime.server.results import (
    CancelResult,
    ExecutionList,
    OutputResult,
    StdinResult,
    cursor_of,
    event_not_found,
    execution_result,
    id_text,
    status_of,
)
from sandbox_runtime.server.results import ExecutionResult as ExecutionResult
from sandbox_runtime.server.schemas import EnvironmentArg, ImageArg, SandboxConfigArg
from sandbox_runtime.server.screens import (
    cancel_screen,
    execution_screen,
    list_screen,
    result_budget,
    result_format,
    screen_args,
    status_screen,
    stdin_screen,
)
from sandbox_runtime.sessions.executions import page_cursor
from sandbox_runtime.sessions.operations import result_fields

# Replies stay far below the official MCP client's 1 MiB limit per SSE event: lists are capped.
LIST_MAX_BYTES = 256 * 1024
LIST_DEFAULT = 10  # a read costs the same however long the session's history

CommandArg = Annotated[
    str | list[str], Field(description="Shell command (run by /bin/sh -c) or an argv list.")
]
TimeoutArg = Annotated[
    float | None,
    Field(description="Wall-clock seconds (the server sets the default and maximum)."),
]
InteractiveArg = Annotated[bool, Field(description="Keep stdin open for send_stdin.")]
WorkdirArg = Annotated[
    str | None, Field(description="Directory inside the sandbox, under /workspace or /tmp.")
]
WaitArg = Annotated[
    bool, Field(description="Wait for the end (up to the timeout) and return the output.")
]
FormatArg = Annotated[
    Literal["concise", "detailed", "json"],
    Field(description="The result's text: concise, detailed (ids, times) or json."),
]
MaxCharsArg = Annotated[int | None, Field(description="Most characters of text (default 100000).")]
ExecutionIdArg = Annotated[str, Field(description="From execute_code or run_code.")]


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
    args = {"request": request, "wait": wait, **screen_args()}
    async with progress_of(ctx, wait, s.settings.progress_interval) as progress:
        sink = progress.report if progress is not None else None
        result = await call(s, lambda: s.router.run(owner, "execute", args, sink), tool)
    structured = execution_result(owner, result, ExecutionResult)
    shaped = {**structured, "screen": result.get("screen")}
    return reply(structured, screen=lambda budget: execution_screen(shaped, budget))


ServersArg = Annotated[
    list[str] | None,
    Field(
        description='Hosted MCP servers its code may call via `import mcp_servers` (["*"]: all '
        "you may use; see list_servers)."
    ),
]


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
        servers: ServersArg = None,
        image: ImageArg = None,
        response_format: FormatArg = "concise",
        max_chars: MaxCharsArg = None,
    ) -> ToolResult:
        """Run a shell command in the session's sandbox (/workspace kept) and return its output
        and exit status; for a program with state between calls use run_code."""
        request = {
            "command": command,
            "timeout_seconds": timeout_seconds,
            "interactive": interactive,
            "working_directory": working_directory,
            "environment": environment,
            "sandbox_config": sandbox_config,
            **({"servers": servers} if servers is not None else {}),
            **({"image": image} if image is not None else {}),
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
        servers: ServersArg = None,
        image: ImageArg = None,
    ) -> ToolResult:
        """Start a long or interactive command and return its execution_id at once (then
        get_execution_output, send_stdin, cancel_execution)."""
        request = {
            "command": command,
            "timeout_seconds": timeout_seconds,
            "interactive": interactive,
            "working_directory": working_directory,
            "environment": environment,
            "sandbox_config": sandbox_config,
            **({"servers": servers} if servers is not None else {}),
            **({"image": image} if image is not None else {}),
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
            BeforeValidator(id_text),
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
        response_format: FormatArg = "concise",
        max_chars: MaxCharsArg = None,
    ) -> ToolResult:
        """Read an execution's output after last_event_id (a previous next_cursor); wait=true
        waits for its end. Reading never consumes."""
        s = root.services
        manager = s.manager
        owner = owner_of(ctx, session)
        cursor = cursor_of(last_event_id)
        if cursor is None:  # names no event: but an unknown execution is the first problem
            await call(
                s, lambda: s.router.executions.status(owner, execution_id), "get_execution_output"
            )
            raise event_not_found(last_event_id)
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
                if page.events and page.events[-1].type == "input_request":
                    break  # (it cannot end before it is answered: say so now)
                seen = page.next_cursor
            return await executions.read_output(owner, execution_id, cursor, limit, 0)

        async with progress_of(ctx, wait_for_s > 0, s.settings.progress_interval):
            page = await call(s, read, "get_execution_output")
        # (A later id than this replica has seen, of an execution still running, may be one
        # the Redis copy has not caught up with: an empty page then, not "not found".)
        ahead = cursor > page.info.last_seq and page.info.status.finished
        if ahead or 0 < cursor < page.first_available - 1:
            raise event_not_found(last_event_id)
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
        budget = result_budget.get()
        screen: dict[str, Any] = {}
        shown = sum(len(e.get("data") or "") for e in events)
        cut = shown > budget and result_format.get() != "json"  # (JSON text: shown whole)
        if page.info.status.finished and cut:  # cut: the rest is in its log file
            args = {"execution_id": execution_id, "max_chars": budget, "after": cursor}
            with contextlib.suppress(ToolFailure):  # (no file: the cursor still reads on)
                log = await call(
                    s, lambda: s.router.run(owner, "keep_output", args, None), "keep_output", False
                )
                screen = {"log": log} if log else {}
        shaped = {**structured, "screen": screen}
        return reply(
            structured, screen=lambda fit: execution_screen(shaped, fit, after=str(cursor))
        )

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
        return reply(result.model_dump(mode="json"), screen=stdin_screen(result.model_dump()))

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
        dumped = result.model_dump(mode="json")
        return reply(dumped, screen=cancel_screen({**dumped, "duration_ms": info.duration_ms}))

    @mcp.tool
    async def get_execution_status(
        ctx: Context,
        execution_id: ExecutionIdArg,
        session: SessionArg = None,
        response_format: FormatArg = "concise",
    ) -> ToolResult:
        """An execution's metadata: status, exit code, limits, timestamps, output counters."""
        s = root.services
        owner = owner_of(ctx, session)
        info = await call(
            s, lambda: s.router.executions.status(owner, execution_id), "get_execution_status"
        )
        item = status_of(info).model_dump(mode="json")
        return reply(item, screen=status_screen(item))

    @mcp.tool(output_schema={**ExecutionList.model_json_schema(), "x-fastmcp-wrap-result": True})
    async def list_executions(
        ctx: Context,
        status: Annotated[
            str | None, Field(description="Only executions with this status.")
        ] = None,
        limit: Annotated[
            int, Field(description="Most executions to return (at most 1000).")
        ] = LIST_DEFAULT,
        cursor: Annotated[
            str | None,
            Field(description="A previous reply's next_cursor: the page of older executions."),
        ] = None,
        session: SessionArg = None,
        response_format: FormatArg = "concise",
    ) -> ToolResult:
        """The caller's executions in this session, newest first, a page at a time."""
        s = root.services
        owner = owner_of(ctx, session)
        infos, more = await call(
            s,
            lambda: s.router.executions.list(owner, status, limit, cursor),
            "list_executions",
        )
        shown: list[dict[str, Any]] = []
        size = 0
        for info in infos:
            item = status_of(info).model_dump(mode="json")
            size += len(json.dumps(item, ensure_ascii=False).encode())
            if shown and size > LIST_MAX_BYTES:
                break
            shown.append(item)
        truncated = len(shown) < len(infos)
        following = more or truncated
        structured = {
            "result": shown,
            "truncated": truncated,
            "next_cursor": page_cursor(infos[len(shown) - 1]) if following and shown else None,
        }
        screen = list_screen(structured, session_name(owner), status)
        return reply(structured, items=shown, screen=screen)
