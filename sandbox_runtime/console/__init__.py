"""The web console: static files served by the server itself, at `/` and `/console/`.

The page is an MCP client of `/mcp` (static/mcp.js) with the user's token; serving it needs
no token (it holds nothing). Strict headers on every file: a Content-Security-Policy with no
inline script, no eval and nothing from another origin, no framing, no sniffing, no referrer.
The same Host/Origin guard as `/mcp` applies (DNS rebinding).

With OAuth configured the page also signs people in with the identity provider
(static/oauth.js: authorization code + PKCE in the browser, back at `/console/callback`):
`/console/config.json` says where, and the policy lets the page reach the provider's origin
(its discovery document and token endpoint) and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response

STATIC = Path(__file__).with_name("static")
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "mcp.js": "text/javascript; charset=utf-8",
    "oauth.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
# Where the identity provider sends people back (the redirect URI an operator registers for
# SANDBOX_OAUTH_CONSOLE_CLIENT_ID: this server's origin + CALLBACK).
CALLBACK = "/console/callback"
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


class Console:
    """The console's routes. `oauth`: what the page signs in with (issuer, client_id,
    resource, scope), or None for token sign-in only."""

    def __init__(self, oauth: dict[str, Any] | None = None) -> None:
        self.oauth = oauth
        self.headers = HEADERS
        if oauth is not None:  # (the provider's discovery and token endpoint, from the page)
            issuer = urlsplit(oauth["issuer"])
            provider = f"{issuer.scheme}://{issuer.netloc}"
            policy = CSP.replace("connect-src 'self'", f"connect-src 'self' {provider}")
            self.headers = HEADERS | {"Content-Security-Policy": policy}

    async def page(self, request: Request) -> Response:
        return self._serve("index.html")

    async def file(self, request: Request) -> Response:
        name = request.path_params.get("name", "")
        if name == CALLBACK.rsplit("/", 1)[1]:  # (the page, reading the provider's answer)
            return self._serve("index.html")
        if name == "config.json":
            return JSONResponse({"oauth": self.oauth, "callback": CALLBACK}, headers=self.headers)
        if name not in FILES:  # only the console's own files, by exact name
            return PlainTextResponse("not found\n", status_code=404, headers=self.headers)
        return self._serve(name)

    def _serve(self, name: str) -> Response:
        return FileResponse(STATIC / name, media_type=FILES[name], headers=self.headers)
