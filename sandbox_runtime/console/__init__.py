"""The web console: static files served by the server itself, at `/` and `/console/`.

The page is an MCP client of `/mcp` (static/mcp.js) with the user's token; serving it needs
no token (it holds nothing). Strict headers on every file: a Content-Security-Policy with no
inline script, no eval and nothing from another origin, no framing, no sniffing, no referrer.
The same Host/Origin guard as `/mcp` applies (DNS rebinding).
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response

STATIC = Path(__file__).with_name("static")
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "mcp.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
# data: images are the plots the page shows; frames are srcdoc ones (sandboxed, no scripts);
# file URLs (/files/...) are same-origin.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-cache",
}


async def console_page(request: Request) -> Response:
    return _serve("index.html")


async def console_file(request: Request) -> Response:
    name = request.path_params.get("name", "")
    if name not in FILES:  # only the console's own files, by exact name
        return PlainTextResponse("not found\n", status_code=404, headers=HEADERS)
    return _serve(name)


def _serve(name: str) -> Response:
    return FileResponse(STATIC / name, media_type=FILES[name], headers=HEADERS)
