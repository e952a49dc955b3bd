"""Pydantic AI's MCP toolset (MCPToolset; the 1.x MCPServerStreamableHTTP is gone from 2.x) in an
Agent whose model is a FunctionModel: a scripted "model" that asks for execute_code and run_code
in one turn and then stops, so the calls go through the agent's own tool path (argument
validation, the toolset's call_tool, result mapping) with no model behind it.

Also records, per tool, whether Pydantic AI's OpenAI schema transformer finds the schema strict
compatible (with strict=None Pydantic AI sends strict only then).

On mcp 1.x (FastMCP 3 client) this speaks 2025-11-25; on mcp 2.x the FastMCP 4 client defaults
to mode="auto" (2026-07-28 when the server offers it).
"""

from __future__ import annotations

import json
from typing import Any

from _driver import Json, arguments, error_text, main, step, summary, usable, versions
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.profiles.openai import OpenAIJsonSchemaTransformer

CALLS = {
    "exec": ("execute_code", {"command": "echo pyd-exec-ok"}),
    "run": ("run_code", {"code": "print(6 * 7)"}),
}


def strict_compatible(schema: Json) -> Json:
    """Pydantic AI's OpenAI transformer on `schema`: with strict=None (the default) whether it
    finds it strict compatible (any default or optional property says no); with strict=True (a
    tool the user marks strict) whether it transforms without an error, and for both whether
    `environment` and `sandbox_config` stay usable (strict=True closes every object)."""
    out: Json = {}
    for strict in (None, True):
        try:
            transformer = OpenAIJsonSchemaTransformer(json.loads(json.dumps(schema)), strict=strict)
            walked = transformer.walk()
        except Exception as exc:
            out[f"strict_{strict}"] = {"exception": error_text(exc)}
            continue
        props = walked.get("properties", {})
        out[f"strict_{strict}"] = {
            "compatible": transformer.is_strict_compatible,
            "usable": {
                n: usable(props[n]) for n in ("environment", "sandbox_config") if n in props
            },
        }
    return out


def protocol_version(toolset: MCPToolset[Any]) -> str | None:
    client = toolset.client
    negotiated = getattr(client, "protocol_version", None)  # FastMCP 4
    if isinstance(negotiated, str):
        return negotiated
    init = client.initialize_result
    return getattr(init, "protocolVersion", None) if init is not None else None


def result_of(part: Any) -> Json:
    if isinstance(part, ToolReturnPart):
        content = part.content
        if isinstance(content, dict):
            return summary(content, [], False)
        return summary(None, [content if isinstance(content, str) else json.dumps(content)], None)
    if isinstance(part, RetryPromptPart):  # the server said isError: the model is asked to retry
        return summary(None, [str(part.content)], True)
    return {"unexpected_part": repr(part)}


async def run() -> Json:
    args = arguments(__doc__ or "").parse_args()
    report: Json = {
        "framework": "pydantic-ai",
        "versions": versions("pydantic-ai-slim", "fastmcp-slim"),
    }
    toolset = MCPToolset(args.url, headers={"Authorization": f"Bearer {args.token}"})

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            report["tools"] = {
                t.name: strict_compatible(t.parameters_json_schema) for t in info.function_tools
            }
            report["protocol_version"] = protocol_version(toolset)
            return ModelResponse(
                parts=[
                    ToolCallPart(name, call_args, tool_call_id=call_id)
                    for call_id, (name, call_args) in CALLS.items()
                ]
            )
        last = messages[-1]
        parts = last.parts if isinstance(last, ModelRequest) else []
        report["results"] = {
            getattr(p, "tool_call_id", "?"): result_of(p)
            for p in parts
            if isinstance(p, ToolReturnPart | RetryPromptPart)
        }
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(model), toolsets=[toolset])

    async def go() -> str:
        async with agent:
            result = await agent.run("run the two tools")
        return str(result.output)

    await step(report, "run", go)
    return report


if __name__ == "__main__":
    main(run)
