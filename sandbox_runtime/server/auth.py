"""Bearer tokens: each maps to a principal; compared in constant time, never logged."""

from __future__ import annotations

import hashlib
import hmac
import json

from fastmcp.server.auth import AccessToken, TokenVerifier
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_runtime.domain.identity import IDENTITY_CLAIM, Identity, token_id


class PrincipalTokenVerifier(TokenVerifier):
    """Accepts the configured bearer tokens; the principal becomes the token's client_id."""

    def __init__(self, tokens: dict[str, str]) -> None:
        super().__init__()
        # Compare digests so the time taken says nothing about a token's length or prefix.
        self._digests = [
            (_digest(token), Identity(principal, token_id(token), "static"))
            for token, principal in tokens.items()
        ]

    async def verify_token(self, token: str) -> AccessToken | None:
        offered = _digest(token)
        match: Identity | None = None
        for digest, identity in self._digests:
            if hmac.compare_digest(digest, offered):
                match = identity
        if match is None:
            return None
        principal = match.principal  # (the Identity: its token id, for the audit log)
        claims = {IDENTITY_CLAIM: match}
        return AccessToken(
            token=token, client_id=principal, scopes=[], subject=principal, claims=claims
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


INVALID = (
    "invalid token: this server does not accept the bearer token sent; check the token in "
    "the Authorization header (Authorization: Bearer <token>)"
)
MISSING = "missing token: send the server's token as Authorization: Bearer <token>"


# The JSON-RPC error code of a refused token (the implementation-defined server-error range).
REFUSED_CODE = -32001


def refusal_body(text: str) -> bytes:
    """A 401's body: a JSON-RPC error, whose message the 2.x Python client and the frameworks
    on it show from any status (the 1.x TypeScript SDK shows the body's text; RFC 6750's
    error_description is in WWW-Authenticate)."""
    error = {"code": REFUSED_CODE, "message": text}
    return json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()


class PlainAuthErrors:
    """A refused token answered in plain words: `invalid token` (or `missing token`) and how
    to fix it, in the 401's body (see refusal_body) and WWW-Authenticate, and no OAuth hints
    (this server has no OAuth: the library's text tells clients to re-register, which sends
    mcp-remote and the SDKs into a client-registration attempt that hides the real problem).
    The token sent is never echoed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = False

        async def answer(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 401:
                refused = True
                offered = any(
                    k.lower() == b"authorization" and v[:7].lower() == b"bearer "
                    for k, v in scope.get("headers", [])
                )
                text = INVALID if offered else MISSING
                body = refusal_body(text)
                challenge = 'Bearer realm="sandbox_runtime"'
                if offered:  # RFC 6750 3.1: no error code when no credentials came
                    challenge += f', error="invalid_token", error_description="{text}"'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", challenge.encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
            if not refused:
                await send(message)

        await self.app(scope, receive, answer)


NO_OAUTH = (
    "invalid token: this server has no OAuth sign-in (no client registration); it takes the "
    "bearer token it was started with, and the one sent is invalid or missing: pass it as "
    "Authorization: Bearer <token>"
)


async def no_registration(request: Request) -> Response:
    """`/register`: where OAuth clients (mcp-remote, the SDKs' auth flows) go after a 401 to
    register themselves. There is no OAuth here; the answer says what the 401 meant, and those
    clients show it."""
    return JSONResponse({"error": "invalid token", "error_description": NO_OAUTH}, 404)
