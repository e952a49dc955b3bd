"""The interpreter tools: run_code (state kept between calls), languages, restarts."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastmcp import Context, FastMCP
from fastmcp.tools.base import ToolResult
from mcp.types import ImageContent, TextContent
from pydantic import BaseModel, Field

from sandbox_runtime.app.services import Root, Services
from sandbox_runtime.server.replies import reply
from sandbox_runtime.server.schemas import EnvironmentArg, ImageArg, SandboxConfigArg
from sandbox_runtime.server.screens import run_code_screen, screen_args
from sandbox_runtime.server.tools import (
    ExecutionResult,
    FormatArg,
    MaxCharsArg,
    ServersArg,
    SessionArg,
    TimeoutArg,
    WaitArg,
    call,
    execution_result,
    owner_of,
    progress_of,
    session_name,
)

TEXT_PREVIEW_CHARS = 8000
IMAGE_TYPES = ("image/png", "image/jpeg")

CodeArg = Annotated[str, Field(description="Code to run in the session's interpreter.")]
LanguageArg = Annotated[
    str,
    Field(description="python, javascript, typescript, bash (list_languages has them all)."),
]


class StateReset(BaseModel):
    reason: str = Field(
        description="Why this call did not find the interpreter it expected: first_call, "
        "idle (stopped after SANDBOX_INTERPRETER_IDLE_SECONDS), crashed, killed (did not stop "
        "when interrupted), flooded (stopped for sending more than 64 MiB outside its calls within "
        "10 s), restarted, rehomed (the session moved to another replica), evicted (stopped, "
        "idle, to make room for another session's interpreter at the token's limit), restored "
        "(restore_session replaced the workspace: a snapshot keeps files, not memory), "
        "workspace_failed (its workspace's filesystem failed and was checked)."
    )


class CodeError(BaseModel):
    name: str | None = None
    value: str | None = None
    traceback: list[str] | None = None


class RunCodeResult(ExecutionResult):
    language: str | None = None
    results: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Rich outputs as MIME bundles (text/plain, text/html, image/png, ...).",
    )
    error: Any = None  # the execution's error message (str), or the exception raised
    execution_count: int | None = None
    state_reset: StateReset | None = None


class Language(BaseModel):
    language: str
    version: str | None = None
    kernel: str
    running: bool = Field(description="An interpreter is running for this session.")
    packages: dict[str, str] = Field(default_factory=dict)


class LanguageList(BaseModel):
    languages: list[Language]
    session: str = Field("default", description="The session asked about.")


class RestartResult(BaseModel):
    session: str = Field("default", description="The session the call ran in.")
    language: str
    restarted: bool = Field(description="False: there was no interpreter to restart.")
    running: bool


def _content(result: dict[str, Any]) -> list[Any]:
    """MCP content for a run_code result: the text output and error, text results, images, and
    for a call that has not ended, its execution_id and what to do next."""
    text = "".join(
        e.get("data", "") for e in result.get("output", []) if e["type"] in ("stdout", "stderr")
    )
    blocks: list[Any] = []
    images: list[Any] = []
    parts = [text] if text else []
    for bundle in result.get("results", []):
        image = next((m for m in IMAGE_TYPES if isinstance(bundle.get(m), str)), None)
        if image is not None:
            # (Some kernels wrap their base64: a data: URL made of it must have none of that.)
            data = "".join(bundle[image].split())
            images.append(ImageContent(type="image", data=data, mime_type=image))
            continue
        for mime in ("text/markdown", "text/plain", "text/html", "application/json"):
            if mime in bundle:
                value = bundle[mime]
                parts.append(value if isinstance(value, str) else str(value))
                break
    error = result.get("error")
    if isinstance(error, dict):
        parts.append("\n".join(error.get("traceback") or [f"{error['name']}: {error['value']}"]))
    elif error:
        parts.append(str(error))
    if result.get("state_reset"):
        parts.insert(0, f"[state reset: {result['state_reset']['reason']}]")
    summary = "\n".join(p for p in parts if p) or f"[{result.get('status')}]"
    if len(summary) > TEXT_PREVIEW_CHARS:
        summary = summary[:TEXT_PREVIEW_CHARS] + f"… [{len(summary) - TEXT_PREVIEW_CHARS} more]"
    if result.get("message"):
        summary = f"{summary}\n[{result['message']}]" if parts else f"[{result['message']}]"
    blocks.append(TextContent(type="text", text=summary))
    return blocks + images


async def _run_code(
    s: Services, ctx: Context, session: str | None, args: dict[str, Any], tool: str
) -> ToolResult:
    """run_code(_async): the session-bound `run_code` operation, on the session's home."""
    owner = owner_of(ctx, session)
    args = {**args, **screen_args()}
    async with progress_of(ctx, args["wait"], s.settings.progress_interval) as progress:
        sink = progress.report if progress is not None else None
        result = await call(s, lambda: s.router.run(owner, "run_code", args, sink), tool)
    structured = execution_result(owner, result, RunCodeResult)
    blocks = _content(structured)
    # The images go once as image content: the JSON text does not carry them a third time.
    shown = {**structured, "results": [_without_images(b) for b in structured["results"]]}
    shaped = {**structured, "screen": result.get("screen")}
    screen = partial(run_code_screen, shaped)  # (made for the budget: replies.fitted)
    return reply(structured, blocks[1:], text=blocks[0].text, shown=shown, screen=screen)


def _without_images(bundle: dict[str, Any]) -> dict[str, Any]:
    """A MIME bundle as the JSON text shows it: an image sent as image content is named."""
    image = next((m for m in IMAGE_TYPES if isinstance(bundle.get(m), str)), None)
    if image is None:
        return bundle
    return {**bundle, image: f"[{len(bundle[image])} characters of base64: the image content]"}


def register_interpreter_tools(mcp: FastMCP, root: Root) -> None:
    """Add run_code, run_code_async, list_languages and restart_interpreter to `mcp`."""
    schema = RunCodeResult.model_json_schema()

    @mcp.tool(output_schema=schema)
    async def run_code(
        ctx: Context,
        code: CodeArg,
        language: LanguageArg = "python",
        timeout_seconds: TimeoutArg = None,
        wait_for_completion: WaitArg = True,
        environment: EnvironmentArg = None,
        sandbox_config: SandboxConfigArg = None,
        session: SessionArg = None,
        servers: ServersArg = None,
        image: ImageArg = None,
        response_format: FormatArg = "concise",
        max_chars: MaxCharsArg = None,
    ) -> ToolResult:
        """Run code in the session's persistent interpreter: variables and imports survive
        between calls, as in a notebook; the last expression's value and plots come back."""
        args = {
            "code": code,
            "language": language,
            "timeout_seconds": timeout_seconds,
            "environment": environment,
            "sandbox_config": sandbox_config,
            **({"servers": servers} if servers is not None else {}),
            **({"image": image} if image is not None else {}),
            "wait": wait_for_completion,
        }
        return await _run_code(root.services, ctx, session, args, "run_code")

    @mcp.tool(output_schema=schema)
    async def run_code_async(
        ctx: Context,
        code: CodeArg,
        language: LanguageArg = "python",
        timeout_seconds: TimeoutArg = None,
        environment: EnvironmentArg = None,
        sandbox_config: SandboxConfigArg = None,
        session: SessionArg = None,
        servers: ServersArg = None,
        image: ImageArg = None,
    ) -> ToolResult:
        """Start code in the session's interpreter and return at once with its execution_id
        (poll it with get_execution_output; answer input() with send_stdin)."""
        args = {
            "code": code,
            "language": language,
            "timeout_seconds": timeout_seconds,
            "environment": environment,
            "sandbox_config": sandbox_config,
            **({"servers": servers} if servers is not None else {}),
            **({"image": image} if image is not None else {}),
            "wait": False,
        }
        return await _run_code(root.services, ctx, session, args, "run_code_async")

    @mcp.tool
    async def list_languages(ctx: Context, session: SessionArg = None) -> LanguageList:
        """The languages run_code speaks: version, packages of note, and whether this session
        has an interpreter running."""
        s = root.services
        owner = owner_of(ctx, session)
        result = await call(
            s, lambda: s.router.run(owner, "list_languages", {}, None), "list_languages"
        )
        return LanguageList.model_validate({**result, "session": session_name(owner)})

    @mcp.tool
    async def restart_interpreter(
        ctx: Context,
        language: LanguageArg = "python",
        sandbox_config: SandboxConfigArg = None,
        session: SessionArg = None,
    ) -> RestartResult:
        """Stop this session's interpreter of a language (its state is lost) and start a fresh
        one, under tighter limits if sandbox_config asks."""
        owner = owner_of(ctx, session)
        args = {"language": language, "sandbox_config": sandbox_config}
        s = root.services
        result = await call(
            s,
            lambda: s.router.run(owner, "restart_interpreter", args, None),
            "restart_interpreter",
        )
        return RestartResult.model_validate({**result, "session": session_name(owner)})
