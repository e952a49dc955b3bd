"""The library's floor: a minimal FastMCP server with one no-op tool, served the way
srt-mcp-server serves its own (uvicorn defaults, stateful Streamable HTTP, SSE replies, the
same bearer-token check). With `--lowlevel`, the same tool on the mcp SDK's low-level server
(what FastMCP builds on; no token check: its auth wants an OAuth issuer).

    python bench/floor_server.py PORT TOKEN [--lowlevel]
"""

from __future__ import annotations

import sys

import uvicorn
from fastmcp import FastMCP
from fastmcp.server.auth import StaticTokenVerifier


def app(token: str):  # type: ignore[no-untyped-def]
    mcp = FastMCP("floor", auth=StaticTokenVerifier({token: {"client_id": "bench", "scopes": []}}))

    @mcp.tool
    def noop(session: str | None = None) -> dict[str, int]:
        """Does nothing."""
        return {"exit_code": 0}

    return mcp.http_app(path="/mcp", stateless_http=False, json_response=False)


def lowlevel_app():  # type: ignore[no-untyped-def]
    from mcp import types
    from mcp.server.lowlevel import Server

    tool = types.Tool(
        name="noop",
        description="Does nothing.",
        input_schema={"type": "object", "properties": {"session": {"type": "string"}}},
        output_schema={"type": "object", "properties": {"exit_code": {"type": "integer"}}},
    )

    async def list_tools(ctx, params):  # type: ignore[no-untyped-def]
        return types.ListToolsResult(tools=[tool])

    async def call_tool(ctx, params):  # type: ignore[no-untyped-def]
        out = {"exit_code": 0}
        text = types.TextContent(type="text", text='{"exit_code": 0}')
        return types.CallToolResult(content=[text], structured_content=out)

    server = Server("floor-lowlevel", on_list_tools=list_tools, on_call_tool=call_tool)
    return server.streamable_http_app(streamable_http_path="/mcp")


def main() -> None:
    port, token = int(sys.argv[1]), sys.argv[2]
    served = lowlevel_app() if "--lowlevel" in sys.argv else app(token)
    uvicorn.run(served, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
