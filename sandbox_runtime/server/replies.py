"""How tool results look on the wire, in both protocol eras, successes and errors alike.

Every result carries its structured content (the contract programs read, srt-mcp-server 0.2's
fields) and one text block a model reads: a screen (screens.py), in both eras, concise unless
the call asks `response_format="detailed"`. With `response_format="json"` or the setting
SANDBOX_RESULT_TEXT=json the text is what it was before: in the legacy era the result's JSON
(0.2's clients read the JSON of every text block), in the 2026 era run_code's summary or the
JSON. A failure is a result with `isError`, a JSON body whose `error` is one line as its
structured content, and as text that line (or, as json, the body): never an exception's dump.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from fastmcp.exceptions import NotFoundError, ToolError, ValidationError
from fastmcp.server.dependencies import get_http_request
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import ToolResult
from loguru import logger
from mcp import types as mt
from mcp.types import TextContent
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import ValidationError as PydanticValidationError

from sandbox_runtime.server.screens import (
    FORMATS,
    MAX_BUDGET,
    MIN_BUDGET,
    compact,
    error_screen,
    first,
    result_budget,
    result_format,
)


class ToolFailure(ToolError):
    """A refused call: `message` is one line for the caller; `kind` its error_type."""

    def __init__(self, message: str, kind: str = "invalid", **fields: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.fields = fields


# What 0.2's answers to a failed call carried besides `error` (its clients read them).
ERROR_FIELDS: dict[str, dict[str, Any]] = {
    "execute_code": {"status": "failed"},
    "execute_code_async": {"status": "failed"},
    "get_execution_output": {"output": []},
    "send_stdin": {"success": False},
    "cancel_execution": {"success": False},
}


def legacy_era() -> bool:
    """Whether this request speaks the 2025 (session) era: no protocol header (before
    2025-06-18) or a version negotiated by `initialize`. Outside a request: False."""
    with contextlib.suppress(RuntimeError):
        version = get_http_request().headers.get("mcp-protocol-version")
        return version is None or version in HANDSHAKE_PROTOCOL_VERSIONS
    return False


def as_json(value: Any) -> TextContent:
    return TextContent(type="text", text=json.dumps(value, ensure_ascii=False))


def reply(
    structured: dict[str, Any],
    extra: list[Any] | None = None,
    text: str | None = None,
    items: list[Any] | None = None,
    shown: dict[str, Any] | None = None,
    screen: str | Callable[[int], str] | None = None,
) -> ToolResult:
    """A successful result: `structured`, one text block, then `extra` blocks that are not
    text (images, resource links).

    The text: `screen` (a screen made for a budget: `fitted`; else `structured` as
    `key: value` lines), within the call's budget.
    As json (module docstring): in the legacy era the JSON of the result (`shown`, when what
    the text shows of it leaves out what `extra` carries, such as images; of each of `items`,
    when the result is a list, as 0.2 sent lists); in the 2026 era `text`, else the JSON.
    """
    blocks = [b for b in extra or [] if not isinstance(b, TextContent)]
    if result_format.get() != "json":
        if callable(screen):
            body = fitted(screen)
        else:
            body = screen if screen is not None else compact(structured)
        head = [TextContent(type="text", text=within_budget(body))]
    elif legacy_era():
        whole = shown if shown is not None else structured
        head = [as_json(i) for i in items] if items is not None else [_legacy_json(whole)]
    elif text is not None:
        head = [TextContent(type="text", text=text)]
    else:
        head = [as_json(items if items is not None else structured)]
    return ToolResult(content=[*head, *blocks], structured_content=structured)


# A budget counts characters, but JSON sends a control character as 6 bytes (\u0001), and the
# 2026 era's replies any character past ASCII escaped (an emoji: 12 bytes): a text of 400,000
# of them was 2.4-4.8 MB, past the official client's 1 MiB per SSE event. A text is also
# bounded in bytes on the wire, leaving the rest of the event to the structured content (a
# page of events is at most 256 KiB of JSON counted the same way, a read_file 512 KiB).
TEXT_WIRE_MAX = 384 * 1024


def wire_size(text: str) -> int:
    """The bytes `text` takes in a JSON reply, at most (escaped as the 2026 era sends it)."""
    return len(json.dumps(text))


def fitted(screen: Callable[[int], str]) -> str:
    """The screen made for the call's budget, made again for a smaller one while its text
    takes more than TEXT_WIRE_MAX bytes on the wire (its cuts and hints are then the smaller
    budget's: they still work as written)."""
    budget = result_budget.get()
    text = screen(budget)
    while (size := wire_size(text)) > TEXT_WIRE_MAX and budget > MIN_BUDGET:
        budget = max(MIN_BUDGET, budget * TEXT_WIRE_MAX // size * 9 // 10)
        text = screen(budget)
    return text


def within_budget(text: str) -> str:
    """A text cut to the call's budget (screens cut output themselves, saying how to read the
    rest; this bounds everything else: the structured content has it all)."""

    def cut(budget: int) -> str:
        if len(text) <= budget:
            return text
        head = first(text, budget - 200)
        more = len(text) - len(head)
        return f"{head}\n[… {more:,} more characters: the structured content has them]"

    return fitted(cut)


# The official client refuses an SSE event over 1 MiB, and a legacy reply carries its result
# twice (structured, and as JSON text, whose quotes are escaped once more): past this, the
# text leaves out the large fields, which the structured content still has.
LEGACY_TEXT_MAX = 448 * 1024
LARGE_FIELD = 4096


def _legacy_json(whole: dict[str, Any]) -> TextContent:
    text = json.dumps(whole, ensure_ascii=False)
    if len(text.encode()) <= LEGACY_TEXT_MAX:
        return TextContent(type="text", text=text)
    slim = {
        k: v
        for k, v in whole.items()
        if len(json.dumps(v, ensure_ascii=False).encode()) <= LARGE_FIELD
    }
    left_out = sorted(set(whole) - set(slim))
    slim["text_left_out"] = (
        f"{', '.join(left_out)}: too large to send twice; the structured content has them "
        "(and get_execution_output, or read_file with offset/length, reads them in parts)"
    )
    return as_json(slim)


def error_reply(tool: str, message: str, kind: str, **fields: Any) -> ToolResult:
    """A failed call as a result: `isError`, JSON `{"error": message, "error_type": kind, ...}`."""
    body = {"error": message, "error_type": kind, **ERROR_FIELDS.get(tool, {}), **fields}
    text = as_json(body) if result_format.get() == "json" else as_text(error_screen(body))
    return ToolResult(content=[text], structured_content=body, is_error=True)


def as_text(text: str) -> TextContent:
    return TextContent(type="text", text=text)


class ErrorResults(Middleware):
    """Every refused tool call becomes an error result with a JSON body (see error_reply).
    Also sets the call's text format and budget: its `response_format` and `max_chars`
    arguments, else the server's settings (SANDBOX_RESULT_TEXT, SANDBOX_RESULT_MAX_CHARS)."""

    # Its hooks are per-method ones only (no on_message/on_request): the direct tools/call
    # path (dispatch.py) runs its on_call_tool as the library would.
    TOOL_CALL_HOOKS_ONLY = True

    def __init__(self, text: str = "concise", max_chars: int = 100_000) -> None:
        self.text = text
        self.max_chars = max_chars

    async def on_call_tool(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        args = context.message.arguments or {}
        asked = args.get("response_format")
        budget = args.get("max_chars")
        if not isinstance(budget, int) or isinstance(budget, bool):
            budget = self.max_chars
        tokens = (
            result_format.set(asked if asked in FORMATS else self.text),
            result_budget.set(min(max(budget, MIN_BUDGET), MAX_BUDGET)),
        )
        try:
            return await self._call(context, call_next)
        finally:
            result_budget.reset(tokens[1])
            result_format.reset(tokens[0])

    async def _call(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        tool = context.message.name
        try:
            return _concise(await call_next(context))
        except NotFoundError:  # (the tool itself: the library looks it up inside the chain)
            names = ""
            with contextlib.suppress(Exception):  # the names are a courtesy
                server = context.fastmcp_context.fastmcp  # type: ignore[union-attr]
                names = ", ".join(sorted(t.name for t in await server.list_tools()))
            return error_reply(
                tool, f"unknown tool {_clip(tool)!r} (this server's: {names})", "not_found"
            )
        except ValidationError as exc:
            cause = exc.__cause__
            if not isinstance(cause, PydanticValidationError):
                return error_reply(tool, _line(str(exc)), "invalid_arguments")
            known: list[str] = []
            with contextlib.suppress(Exception):  # the names are a courtesy
                server = context.fastmcp_context.fastmcp  # type: ignore[union-attr]
                found = await server.get_tool(tool)
                known = list(found.parameters.get("properties", {})) if found else []
            return error_reply(tool, argument_problems(cause, tool, known), "invalid_arguments")
        except ToolFailure as exc:
            return error_reply(tool, _line(str(exc)), exc.kind, **exc.fields)
        except ToolError as exc:
            return error_reply(tool, _line(str(exc)), "error")


def _concise(result: ToolResult) -> ToolResult:
    """A tool that returns its model (the library makes the text its JSON) gets the concise
    text: `key: value` lines (screens.compact) within the budget. Results made by `reply`
    have their text already; json keeps the library's."""
    structured = result.structured_content
    if result_format.get() == "json" or structured is None or len(result.content) != 1:
        return result
    block = result.content[0]
    if not isinstance(block, TextContent) or block.text[:1] not in "{[":
        return result
    try:
        shown = json.loads(block.text)
    except ValueError:
        return result
    if shown != structured and [shown] != list(structured.values()):
        return result
    text = within_budget(compact(structured))
    return ToolResult(content=[as_text(text)], structured_content=structured, meta=result.meta)


def _line(text: str) -> str:
    return " ".join(text.split())


# What a type error says a value must be, by pydantic's error type (the rest: its own words).
_MUST_BE = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "dict_type": "an object",
    "list_type": "a list",
    "model_type": "an object",
}
MAX_SHOWN = 60


def argument_problems(error: PydanticValidationError, tool: str, known: list[str]) -> str:
    """One line per bad argument, naming it and what it must be (no library dump, no URLs)."""
    # pydantic reports a union's every member (loc: name, "str"; name, "list[str]"): gather
    # what each argument must be, named by its path without those member tags.
    wants: dict[str, list[str]] = {}
    given: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for item in error.errors(include_url=False):
        parts = list(item.get("loc", ()))
        # The first part is the argument's name as the caller sent it: never a member tag.
        loc = [str(p) for p in parts[:1]] + [str(p) for p in parts[1:] if not _member_tag(p)]
        name = _clip(".".join(loc)) or "arguments"
        kind = item.get("type", "")
        if kind in ("extra_forbidden", "unexpected_keyword_argument"):
            takes = f" ({tool} takes {', '.join(known)})" if known else ""
            problems[name] = f"unknown argument {name!r}{takes}"
        elif kind in ("missing", "missing_argument"):
            problems[name] = f"{name} is required"
        elif kind in _MUST_BE:
            want = _MUST_BE[kind]
            if want not in wants.setdefault(name, []):
                wants[name].append(want)
            given[name] = item.get("input")
        elif name not in problems:
            msg = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
            problems[name] = f"{name}: {msg}"
    for name, choices in wants.items():
        if name not in problems:
            problems[name] = f"{name} must be {' or '.join(choices)}, got {_shown(given[name])}"
    if not problems:
        logger.debug("validation error without details: {}", error)
        return "invalid arguments"
    return "; ".join(problems.values())


def _member_tag(part: object) -> bool:
    """Whether a location part names a union member or a validator, not an argument."""
    if not isinstance(part, str):
        return isinstance(part, int) and part < 0
    return part in {"str", "int", "float", "bool", "dict", "list", "none"} or any(
        c in part for c in "[-"
    )


def _clip(text: str) -> str:
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}… ({len(text)} characters)"


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}… ({len(text)} characters)"
