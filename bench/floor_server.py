"""The library's floor: a minimal FastMCP server with one no-op tool, served the way
srt-mcp-server serves its own (uvicorn defaults, stateful Streamable HTTP, SSE replies, the
same bearer-token check).

    python bench/floor_server.py PORT TOKEN
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


def main() -> None:
    port, token = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(app(token), host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
