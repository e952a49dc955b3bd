"""`/s/{session}/mcp`: an MCP endpoint bound to one session, served by the `/mcp` app; and
`/s/{session}/servers/{name}/mcp`, a hosted server's endpoint in that session (its instance,
for a server of scope "session")."""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

SCOPE_KEY = "srt.session"  # the session named by the path, for the tools (server/tools.py)
PATH = re.compile(
    r"/s/(?P<session>(?!\.+/)[A-Za-z0-9._:@-]{1,128})(?P<rest>/servers/[a-z0-9_-]{1,48})?/mcp/?"
)  # fullmatch


class SessionPathMiddleware:
    """Rewrites `/s/{session}/mcp` to `/mcp` (and `/s/{session}/servers/{name}/mcp` to
    `/servers/{name}/mcp`) and records the session in the request scope.

    The path lets a proxy route by session (nginx hashes on it, so most calls reach the
    session's home directly); a malformed session segment is a 404 like any unknown path.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.pop(SCOPE_KEY, None)  # only this middleware may set it
            path: str = scope["path"]
            if path.startswith("/s/"):
                match = PATH.fullmatch(path)
                if match is None:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 404,
                            "headers": [(b"content-type", b"text/plain")],
                        }
                    )
                    await send(
                        {"type": "http.response.body", "body": b"no such session endpoint\n"}
                    )
                    return
                path = f"{match['rest'] or ''}/mcp"
                scope = dict(scope, path=path, raw_path=path.encode())
                scope[SCOPE_KEY] = match["session"]
        await self.app(scope, receive, send)


def public_path(scope: Scope) -> str:
    """The path the client used for a request this middleware rewrote (`/s/{session}/mcp`
    again), else the request's path: what a challenge's resource_metadata must name, or the
    client finds another resource there and gives up its step-up (RFC 9728 §3.3)."""
    session = scope.get(SCOPE_KEY)
    path: str = scope["path"]
    return f"/s/{session}{path}" if session else path
