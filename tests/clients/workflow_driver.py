"""The agent workflow (tests/clients/_workflow.py) through langchain-mcp-adapters, as a LangChain
agent runs it: MultiServerMCPClient with the sandbox's /mcp and a hosted server's endpoint, each
call a ToolCall in and a ToolMessage out. The model would be shown the ToolMessage's content as
convert_to_openai_messages sends it: its text parts, and images as image_url parts.

mcp 1.x only (the adapters require mcp<2): the 2025-11-25 era.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
from typing import Any

from _driver import Json, arguments, main, versions
from _workflow import workflow
from langchain_core.messages import convert_to_openai_messages
from langchain_mcp_adapters.client import MultiServerMCPClient

ids = itertools.count()


def image(part: Json) -> Json:
    url = str(part["image_url"]["url"])
    head, _, data = url.partition(",")
    png = False
    if head == "data:image/png;base64":
        with contextlib.suppress(ValueError):
            png = base64.b64decode(data, validate=True).startswith(b"\x89PNG\r\n\x1a\n")
    return {"url": url[:40], "png": png}


def caller(tools: dict[str, Any]) -> Any:
    async def call(name: str, args: Json) -> Json:
        message = await tools[name].ainvoke(
            {"type": "tool_call", "id": f"call-{next(ids)}", "name": name, "args": args}
        )
        (converted,) = convert_to_openai_messages([message])
        content = converted["content"]
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        return {
            "text": "\n".join(p["text"] for p in parts if p.get("type") == "text"),
            "is_error": getattr(message, "status", "") == "error",
            "images": [image(p) for p in parts if p.get("type") == "image_url"],
            "other_parts": [
                p.get("type") for p in parts if p.get("type") not in ("text", "image_url")
            ],
        }

    return call


async def run() -> Json:
    parser = arguments(__doc__ or "")
    parser.add_argument("--hosted-url", required=True)
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.token}"}
    client = MultiServerMCPClient(
        {
            "srt": {"transport": "streamable_http", "url": args.url, "headers": headers},
            "time": {"transport": "streamable_http", "url": args.hosted_url, "headers": headers},
        }
    )
    tools = {t.name: t for t in await client.get_tools()}
    call = caller(tools)
    report: Json = {"versions": versions("langchain-mcp-adapters", "langchain-core")}
    report.update(await workflow(call, call))
    return report


if __name__ == "__main__":
    main(run)
