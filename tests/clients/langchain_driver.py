"""langchain-mcp-adapters as an agent uses it by default: MultiServerMCPClient(...).get_tools()
and no client.session(), so every tool call opens (and closes) an MCP transport session of its
own. Calls run_code `--calls` times without naming a session: `x = 1` first, `print(x)` last.

mcp 1.x only (the adapters require mcp<2): the 2025-11-25 era.
"""

from __future__ import annotations

import time

from _driver import Json, arguments, main, step, summary, versions
from langchain_mcp_adapters.client import MultiServerMCPClient


async def run() -> Json:
    parser = arguments(__doc__ or "")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    report: Json = {
        "framework": "langchain-mcp-adapters",
        "versions": versions("langchain-mcp-adapters", "langchain-core"),
    }
    client = MultiServerMCPClient(
        {
            "srt": {
                "transport": "streamable_http",
                "url": args.url,
                "headers": {"Authorization": f"Bearer {args.token}"},
            }
        }
    )

    async def list_tools() -> list[str]:
        return sorted(tool.name for tool in await client.get_tools())

    names = await step(report, "tools", list_tools)
    if not names or "run_code" not in names:
        return report
    tool = next(t for t in await client.get_tools() if t.name == "run_code")

    calls: list[Json] = []
    for i in range(args.calls):
        code = "x = 1" if i == 0 else "print(x)" if i == args.calls - 1 else f"print('call', {i})"
        started = time.monotonic()

        async def call(code: str = code, i: int = i) -> Json:
            # A ToolCall in, a ToolMessage out: its artifact holds the structured content.
            message = await tool.ainvoke(
                {"type": "tool_call", "id": f"call-{i}", "name": "run_code", "args": {"code": code}}
            )
            texts = [
                block["text"]
                for block in (message.content if isinstance(message.content, list) else [])
                if isinstance(block, dict) and block.get("type") == "text"
            ]
            if isinstance(message.content, str):
                texts = [message.content]
            artifact = message.artifact or {}
            out = summary(
                artifact.get("structured_content"), texts, getattr(message, "status", "") == "error"
            )
            return out

        entry: Json = {"code": code}
        await step(entry, "result", call)
        entry["seconds"] = round(time.monotonic() - started, 3)
        calls.append(entry)
    report["calls"] = calls
    return report


if __name__ == "__main__":
    main(run)
