"""OpenAI Agents SDK: MCPServerStreamableHttp, with the tools an Agent gets when its mcp_config
says convert_schemas_to_strict=True (the path Runner takes before calling the model).

For each tool: whether its strict conversion succeeded (the SDK falls back to the original,
non-strict schema and only logs at INFO when it fails; the error is recomputed here with the
SDK's own ensure_strict_json_schema, called as the SDK calls it), and whether `environment` and
`sandbox_config` are still usable after it. Then execute_code is invoked through the function
tool (FunctionTool.on_invoke_tool, as the runner does) with arguments as a strict-mode model
writes them: every property present, `environment` as a list of {name, value}.

On mcp 1.x this speaks 2025-11-25; on mcp 2.x the SDK connects with mode="auto" (2026-07-28
when the server offers it).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
from _driver import (
    Json,
    arguments,
    error_text,
    main,
    step,
    strict_arguments,
    summary,
    usable,
    versions,
)
from agents import Agent, RunContextWrapper
from agents.mcp import MCPServerStreamableHttp
from agents.strict_schema import ensure_strict_json_schema
from agents.tool import FunctionTool
from agents.tool_context import ToolContext

MARKER = "strict-ok-7d3f"


def input_schema(tool: Any) -> Json:
    schema = getattr(tool, "inputSchema", None)
    if schema is None:
        schema = tool.input_schema  # mcp 2.x
    return dict(schema)


def strict_error(schema: Json) -> str | None:
    """The error of the SDK's strict conversion of `schema` (as MCPUtil.to_function_tool calls
    it), or None when it converts."""
    schema = copy.deepcopy(schema)
    empty = schema == {}
    schema.setdefault("properties", {})
    try:
        ensure_strict_json_schema(schema, _reject_open_objects=not empty)
    except Exception as exc:
        return error_text(exc)
    return None


def protocol_version(server: MCPServerStreamableHttp) -> str | None:
    session = server.session
    negotiated = getattr(session, "protocol_version", None)  # mcp 2.x Client
    if isinstance(negotiated, str):
        return negotiated
    init = server.server_initialize_result
    return getattr(init, "protocolVersion", None) if init is not None else None


def tool_output_texts(output: Any) -> list[str]:
    """The text parts of what on_invoke_tool returned (a text dict, a list of them, or the
    failure function's string)."""
    items = output if isinstance(output, list) else [output]
    texts = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict) and item.get("type") == "text":
            texts.append(str(item.get("text", "")))
        elif hasattr(item, "text"):
            texts.append(str(item.text))
    return texts


async def run() -> Json:
    args = arguments(__doc__ or "").parse_args()
    report: Json = {"framework": "openai-agents", "versions": versions("openai-agents")}
    server = MCPServerStreamableHttp(
        {
            "url": args.url,
            "headers": {"Authorization": f"Bearer {args.token}"},
            "timeout": 30,
            "sse_read_timeout": 120,
        },
        name="srt",
        cache_tools_list=True,
        client_session_timeout_seconds=60,
    )
    async with server:
        report["protocol_version"] = protocol_version(server)
        mcp_tools = await server.list_tools()
        agent = Agent(
            name="srt-driver",
            mcp_servers=[server],
            mcp_config={"convert_schemas_to_strict": True},
        )
        converted = await agent.get_mcp_tools(RunContextWrapper(context=None))
        by_name = {t.name: t for t in converted if isinstance(t, FunctionTool)}
        tools: dict[str, Json] = {}
        for mcp_tool in mcp_tools:
            original = input_schema(mcp_tool)
            function_tool = by_name.get(mcp_tool.name)
            params = function_tool.params_json_schema if function_tool else {}
            props = params.get("properties", {})
            tools[mcp_tool.name] = {
                "strict": bool(function_tool and function_tool.strict_json_schema),
                "strict_error": strict_error(original),
                "usable": {
                    name: usable(props[name])
                    for name in ("environment", "sandbox_config")
                    if name in props
                },
                "environment_schema": props.get("environment"),
                "sandbox_config_schema": props.get("sandbox_config"),
            }
        report["tools"] = tools

        tool = by_name.get("execute_code")
        if tool is None:
            report["invoke"] = {"exception": "no execute_code tool"}
            return report
        given = {
            "command": f"echo oa-$SRT_FW_VAR-{MARKER}",
            "environment": [{"name": "SRT_FW_VAR", "value": "from-env"}],
        }
        call_args = strict_arguments(tool.params_json_schema, given)
        report["invoke_arguments"] = call_args
        report["invoke_arguments_valid"] = [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft202012Validator(tool.params_json_schema).iter_errors(call_args)
        ]

        async def invoke() -> Json:
            raw = json.dumps(call_args)
            context = ToolContext(
                context=None, tool_name=tool.name, tool_call_id="call-1", tool_arguments=raw
            )
            output = await tool.on_invoke_tool(context, raw)
            texts = tool_output_texts(output)
            result = summary(None, texts, None)
            result["expected_stdout"] = f"oa-from-env-{MARKER}\n"
            return result

        await step(report, "invoke", invoke)
    return report


if __name__ == "__main__":
    main(run)
