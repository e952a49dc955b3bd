"""tools/call for our fixed tools without the library's per-call lookups.

For every call the library looks the tool up again (through its providers, a task per
provider, visibility and auth transforms), opens two telemetry spans, builds its middleware
chain twice and enters the call twice (once with the chain, once without): ~0.35 ms of CPU
per call, more than the tool's own argument check, run and result (~0.08 ms) together. Our
tools are fixed at startup and the same for every caller (tools/list is answered from one
result made then, app.py), so the lookup's answer is known in advance.

This handler takes the place of the library's for those tools and does what the library's
does around the tool, in the same order: the request's context bound, a `Context` entered
(so `get_context()`, `get_access_token()` and `get_http_request()` work in the tool as
before), our middleware's tools/call hooks in the server's order (AuditedCalls' line,
ErrorResults' text format, budget and errors as results, ScopeCheck's scopes), the
tool's own `_run` (its arguments checked by the library's own validator, its dependencies
injected, its result converted), the library's logging and masking of what the tool raises,
and the result's shape on the wire. Anything else (a tool it does not know, a version asked
in `_meta`, a server with middleware not ours or with extensions) goes to the library's
handler.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastmcp import FastMCP
from fastmcp.exceptions import (
    DisabledError,
    FastMCPError,
    NotFoundError,
    ToolError,
    ValidationError,
)
from fastmcp.server import server as fastmcp_server
from fastmcp.server.context import Context
from fastmcp.server.dependencies import (
    _dispatching_tool_call,
    _serving_client_tool_call,
    bind_request_context,
)
from fastmcp.server.middleware import Middleware, MiddlewareContext
from fastmcp.server.mixins.mcp_operations import _normalize_call_tool_result, _version_from_ctx
from fastmcp.server.transforms.visibility import is_enabled
from fastmcp.tools.base import Tool, ToolResult
from fastmcp.tools.function_tool import FunctionTool
from fastmcp.utilities.exceptions import get_http_status_code, is_timeout_error
from loguru import logger
from mcp import types as mt
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import MISSING_REQUIRED_CLIENT_CAPABILITY
from pydantic import ValidationError as PydanticValidationError

from sandbox_runtime.server.replies import ErrorResults

Handler = Callable[[Any, mt.CallToolRequestParams], Awaitable[Any]]

# The library's own logger and helpers, so its log lines about a failed call are the same.
_library_log = fastmcp_server.logger
_summary = fastmcp_server._validation_error_summary


def plain_tools(tools: list[Tool]) -> dict[str, Tool]:
    """The tools this path may run: plain function tools (no per-tool auth, timeout,
    task mode or version; enabled), by name."""
    return {
        t.name: t
        for t in tools
        if isinstance(t, FunctionTool)
        and t.auth is None
        and t.timeout is None
        and t.version is None
        and not t.task_config.supports_tasks()
        and is_enabled(t)
    }


async def dispatch_fixed_tools(mcp: FastMCP) -> list[str]:
    """Answer tools/call for `mcp`'s fixed tools on this path (module docstring). Returns
    the names it serves: none when the server has middleware that is not ours (its other
    hooks, on_message and on_request, run only on the library's path) or extensions."""
    chain = list(mcp.middleware)
    if not any(isinstance(m, ErrorResults) for m in chain) or mcp._extensions:
        logger.info("tools/call: the library's dispatch (no ErrorResults, or extensions)")
        return []
    if not all(getattr(m, "TOOL_CALL_HOOKS_ONLY", False) for m in chain):
        logger.info("tools/call: the library's dispatch (middleware not ours)")
        return []
    tools = plain_tools(list(await mcp.list_tools(run_middleware=False)))
    entry = mcp._mcp_server.get_request_handler("tools/call")
    if entry is None:
        return []
    library: Handler = entry.handler

    async def call_tool(ctx: Any, params: mt.CallToolRequestParams) -> Any:
        tool = tools.get(params.name)
        if tool is None or (params.meta is not None and _version_from_ctx(ctx) is not None):
            return await library(ctx, params)
        return await _call(mcp, chain, tool, ctx, params)

    mcp._mcp_server.add_request_handler("tools/call", mt.CallToolRequestParams, call_tool)
    logger.info("tools/call: {} fixed tools on the direct path", len(tools))
    return sorted(tools)


async def _call(
    mcp: FastMCP,
    chain: list[Middleware],
    tool: Tool,
    ctx: Any,
    params: mt.CallToolRequestParams,
) -> mt.CallToolResult:
    """What the library's tools/call does for a plain tool, in its order (module docstring)."""
    name = params.name
    arguments = params.arguments or {}
    with bind_request_context(ctx), _serving_client_tool_call():
        if _library_log.isEnabledFor(logging.DEBUG):
            _library_log.debug(
                f"[{mcp.name}] Handler called: call_tool %s with %s", name, arguments
            )
        async with Context(fastmcp=mcp) as outer:
            message = mt.CallToolRequestParams(
                name=name,
                arguments=arguments,
                input_responses=outer.input_responses,
                request_state=outer.request_state,
            )
            mw = MiddlewareContext[mt.CallToolRequestParams](
                message=message,
                source="client",
                type="request",
                method="tools/call",
                fastmcp_context=outer,
            )

            async def run(context: MiddlewareContext[mt.CallToolRequestParams]) -> ToolResult:
                async with Context(fastmcp=mcp):  # (the library enters it again here)
                    return await _run(mcp, tool, name, context.message.arguments or {})

            try:
                with _dispatching_tool_call():
                    call: Any = run
                    for hooks in reversed(chain):
                        call = functools.partial(hooks.on_call_tool, call_next=call)
                    result = await call(mw)
            except (DisabledError, NotFoundError):  # (as the library's handler answers)
                text = mt.TextContent(type="text", text=f"Unknown tool: {name!r}")
                return mt.CallToolResult(content=[text], is_error=True)
            except FastMCPError as e:
                text = mt.TextContent(type="text", text=str(e))
                return mt.CallToolResult(content=[text], is_error=True)
            result = await mcp._rebind_prefab_tool_names(result)
    return _normalize_call_tool_result(result.to_mcp_result())


async def _run(mcp: FastMCP, tool: Tool, name: str, arguments: dict[str, Any]) -> ToolResult:
    """The tool's run, with the library's logging and masking of what it raises."""
    try:
        return await tool._run(arguments)
    except ValidationError as e:
        cause = e.__cause__
        if isinstance(cause, PydanticValidationError):
            _library_log.warning("Invalid arguments for tool %r: %s", name, _summary(cause))
        else:
            _library_log.warning("Invalid arguments for tool %r", name)
        raise
    except FastMCPError as e:
        _library_log.log(e.log_level, f"Error calling tool {name!r}", exc_info=False)
        raise
    except PydanticValidationError as e:
        _library_log.warning("Invalid arguments for tool %r: %s", name, _summary(e))
        raise
    except Exception as e:
        if isinstance(e, MCPError) and e.error.code == MISSING_REQUIRED_CLIENT_CAPABILITY:
            raise
        status_code = get_http_status_code(e)
        _library_log.error(f"Error calling tool {name!r}", exc_info=status_code is None)
        if status_code == 429:
            raise ToolError("Rate limited by upstream API, please retry later") from e
        if is_timeout_error(e):
            raise ToolError("Upstream request timed out, please retry") from e
        if mcp._mask_error_details:
            raise ToolError(f"Error calling tool {name!r}") from e
        raise ToolError(f"Error calling tool {name!r}: {e}") from e
