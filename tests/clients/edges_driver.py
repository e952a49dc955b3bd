"""What each framework shows a user (and so a model) at the edges: a wrong token, a typo in a
hosted server's URL, and a plot, as an agent built on it meets them.

For every framework in this venv (the official client; langchain-mcp-adapters on mcp 1.x only;
openai-agents; pydantic-ai's MCPToolset), with `--token` altered (wrong_token) and with the
hosted-server URL `--typo-url` (url_typo): connect and list the tools, and record what the
exception says (its str as an agent's log or a traceback's last line shows it, and the leaves
of its exception groups). With `--plot`: run_code drawing a matplotlib figure, through the
official client (its content blocks) and, on mcp 1.x, through LangChain's tool and
convert_to_openai_messages (the OpenAI chat format a LangChain agent sends its model).

On mcp 1.x this speaks 2025-11-25; on mcp 2.x the clients connect with mode "auto" (2026-07-28).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from _driver import Json, arguments, error_text, main, mcp_major, versions

PLOT = (
    "import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
    "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.savefig('p.png')\n"
    "plt.show()\nprint('plotted')"
)


def shown(exc: BaseException) -> Json:
    """What a user sees of `exc`: `Type: message` of the exception itself, and of its leaves."""
    return {"shown": f"{type(exc).__name__}: {exc}", "leaves": error_text(exc)}


async def attempt(body: Callable[[], Awaitable[Any]]) -> Json:
    try:
        value = await body()
    except Exception as exc:
        return shown(exc)
    return {"shown": None, "value": value}


@contextlib.asynccontextmanager
async def official(url: str, token: str) -> AsyncIterator[Any]:
    """An initialized session of the official client (1.x ClientSession, 2.x Client)."""
    headers = {"Authorization": f"Bearer {token}"}
    if mcp_major() >= 2:
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        async with create_mcp_http_client(headers=headers) as http:
            async with Client(streamable_http_client(url, http_client=http), mode="auto") as c:
                yield c
    else:
        from mcp import ClientSession
        from mcp.client.streamable_http import streamablehttp_client

        async with (
            streamablehttp_client(url, headers=headers) as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


async def list_official(url: str, token: str) -> list[str]:
    async with official(url, token) as session:
        return sorted(t.name for t in (await session.list_tools()).tools)


async def list_langchain(url: str, token: str) -> list[str]:
    from langchain_mcp_adapters.client import MultiServerMCPClient

    client = MultiServerMCPClient(
        {
            "srt": {
                "transport": "streamable_http",
                "url": url,
                "headers": {"Authorization": f"Bearer {token}"},
            }
        }
    )
    return sorted(t.name for t in await client.get_tools())


async def list_openai_agents(url: str, token: str) -> list[str]:
    from agents.mcp import MCPServerStreamableHttp

    server = MCPServerStreamableHttp(
        {"url": url, "headers": {"Authorization": f"Bearer {token}"}}, name="srt"
    )
    async with server:
        return sorted(t.name for t in await server.list_tools())


async def list_pydantic_ai(url: str, token: str) -> list[str]:
    from pydantic_ai.mcp import MCPToolset

    toolset: Any = MCPToolset(url, headers={"Authorization": f"Bearer {token}"})
    async with toolset:
        return sorted(t.name for t in await toolset.list_tools())


FRAMEWORKS: dict[str, Callable[[str, str], Awaitable[list[str]]]] = {
    "official": list_official,
    "langchain": list_langchain,
    "openai-agents": list_openai_agents,
    "pydantic-ai": list_pydantic_ai,
}


def names_only(value: Any) -> Any:
    return {"tools": len(value)} if isinstance(value, list) else value


async def plot_official(url: str, token: str) -> Json:
    async with official(url, token) as session:
        result = await session.call_tool("run_code", {"code": PLOT, "session": "edges-plot"})
    blocks = []
    for block in result.content:
        entry: Json = {"type": block.type}
        if block.type == "image":
            entry.update(mime_type=getattr(block, "mimeType", None) or block.mime_type)
            entry["data_head"] = block.data[:16]
        elif block.type == "resource_link":
            entry["uri"] = str(block.uri)
        blocks.append(entry)
    return {"is_error": bool(getattr(result, "isError", None) or getattr(result, "is_error", 0)),
            "blocks": blocks}  # fmt: skip


async def plot_langchain(url: str, token: str) -> Json:
    from langchain_core.messages import convert_to_openai_messages
    from langchain_mcp_adapters.client import MultiServerMCPClient

    client = MultiServerMCPClient(
        {
            "srt": {
                "transport": "streamable_http",
                "url": url,
                "headers": {"Authorization": f"Bearer {token}"},
            }
        }
    )
    tool = next(t for t in await client.get_tools() if t.name == "run_code")
    message = await tool.ainvoke(
        {"type": "tool_call", "id": "c1", "name": "run_code",
         "args": {"code": PLOT, "session": "edges-plot-lc"}}
    )  # fmt: skip
    lc_blocks = [
        {k: (v[:40] if isinstance(v, str) else v) for k, v in b.items() if k != "id"}
        for b in (message.content if isinstance(message.content, list) else [])
        if isinstance(b, dict)
    ]
    out: Json = {"langchain_blocks": lc_blocks}
    try:
        converted = convert_to_openai_messages([message])
    except Exception as exc:
        out["openai"] = shown(exc)
        return out
    parts = converted[0]["content"] if isinstance(converted[0]["content"], list) else []
    out["openai"] = [image_url(p) if p.get("type") == "image_url" else {"type": p.get("type")}
                     for p in parts]  # fmt: skip
    return out


def image_url(part: Json) -> Json:
    """An OpenAI image_url part: its URL's head, and whether it is a data URL of a PNG."""
    url = str(part["image_url"]["url"])
    head, _, data = url.partition(",")
    png = False
    if head == "data:image/png;base64":
        with contextlib.suppress(ValueError):
            png = base64.b64decode(data, validate=True).startswith(b"\x89PNG\r\n\x1a\n")
    return {"type": "image_url", "url": url[:48], "png": png}


async def run() -> Json:
    parser = arguments(__doc__ or "")
    parser.add_argument("--typo-url", help="a hosted server's URL with a typo in its name")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    modern = mcp_major() >= 2
    report: Json = {
        "versions": versions("langchain-mcp-adapters", "openai-agents", "pydantic-ai-slim"),
    }
    frameworks = {k: v for k, v in FRAMEWORKS.items() if not (modern and k == "langchain")}
    for name, list_tools in frameworks.items():
        entry: Json = {}
        wrong = await attempt(lambda f=list_tools: f(args.url, args.token + "-wrong"))
        entry["wrong_token"] = names_only(wrong)
        if args.typo_url:
            typo = await attempt(lambda f=list_tools: f(args.typo_url, args.token))
            entry["url_typo"] = names_only(typo)
        report[name] = entry
    if args.plot:
        report["plot_official"] = await attempt(lambda: plot_official(args.url, args.token))
        if not modern:
            report["plot_langchain"] = await attempt(lambda: plot_langchain(args.url, args.token))
    return report


if __name__ == "__main__":
    main(run)
