"""A remote Streamable HTTP MCP server for the tests (FastMCP, on the host, not sandboxed).

    python remote_http.py PORT

Tools: whoami {} -> the Authorization and X-Team headers it received; count {steps} ->
reports progress for each step; fail {} -> a tool error.
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn
from fastmcp import Context, FastMCP
from fastmcp.server.dependencies import get_http_headers

mcp = FastMCP("remote-test")


@mcp.tool
def whoami() -> dict[str, str]:
    """The headers this server received."""
    headers = get_http_headers(include_all=True)
    return {k: headers.get(k, "") for k in ("authorization", "x-team")}


@mcp.tool
async def count(steps: int, ctx: Context) -> str:
    """Counts, reporting progress."""
    for i in range(1, steps + 1):
        await ctx.report_progress(i, steps)
        await asyncio.sleep(0.05)
    return f"counted {steps}"


@mcp.tool
def fail() -> str:
    """Always fails."""
    raise ValueError("remote failure on purpose")


if __name__ == "__main__":
    uvicorn.run(
        mcp.http_app(path="/mcp"), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning"
    )
