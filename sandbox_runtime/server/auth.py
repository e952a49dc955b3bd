"""Bearer tokens: static ones (each maps to a principal; compared in constant time, never
logged) and, with OAuth configured, the authorization servers' access tokens; either way the
policy file's groups and scopes are attached (an Identity in the token's claims)."""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json

from fastmcp.server.auth import AccessToken, TokenVerifier
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_runtime.domain.identity import IDENTITY_CLAIM, Identity, Kind, token_id
from sandbox_runtime.oauth.metadata import ResourceMetadata
from sandbox_runtime.oauth.policy import Policy
from sandbox_runtime.oauth.scopes import known_scope
from sandbox_runtime.oauth.verifier import OAuthVerifier, TokenRefusedError, Verified


class PrincipalTokenVerifier(TokenVerifier):
    """Accepts the configured bearer tokens; the principal becomes the token's client_id."""

    def __init__(self, tokens: dict[str, str]) -> None:
        super().__init__()
        # Compare digests so the time taken says nothing about a token's length or prefix.
        self._digests = [(_digest(token), principal) for token, principal in tokens.items()]

    async def verify_token(self, token: str) -> AccessToken | None:
        offered = _digest(token)
        match: str | None = None
        for digest, principal in self._digests:
            if hmac.compare_digest(digest, offered):
                match = principal
        if match is None:
            return None
        return AccessToken(token=token, client_id=match, scopes=[], subject=match)


# Why this request's token was refused, for its 401 (a list per request, set by
# PlainAuthErrors: the verifier runs further in, and appends to the same list).
_refusals: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "srt_refusals", default=None
)


class CallerVerifier(TokenVerifier):
    """Static tokens, then (if configured) OAuth access tokens. The AccessToken's client_id is
    the principal; its claims hold the Identity with the policy's groups and scopes."""

    def __init__(
        self,
        tokens: dict[str, str],
        oauth: OAuthVerifier | None = None,
        policy: Policy | None = None,
    ) -> None:
        super().__init__()
        self.static = PrincipalTokenVerifier(tokens)
        self.static_principals = frozenset(tokens.values())
        self.oauth = oauth
        self.policy = policy

    async def aclose(self) -> None:
        if self.oauth is not None:
            await self.oauth.aclose()

    async def verify_token(self, token: str) -> AccessToken | None:
        found = await self.static.verify_token(token)
        if found is not None:
            groups = self.policy.groups_of(found.client_id) if self.policy else ()
            identity = Identity(found.client_id, token_id(token), "static", None, groups)
            return self._token(token, identity, None, ())
        if self.oauth is None:
            return None
        try:
            verified = await self.oauth.verify(token)
        except TokenRefusedError as exc:
            _note(str(exc))
            return None
        if verified.principal in self.static_principals:
            # (a signed-in user must never reach a static token's sessions by its name)
            _note(f"the token's principal {verified.principal!r} is a static token's principal")
            return None
        return self._token(
            token, self._identity(verified), verified.expires_at, verified.token_scopes
        )

    def _identity(self, verified: Verified) -> Identity:
        groups = verified.groups
        if self.policy is not None:
            groups = self.policy.groups_of(verified.principal, groups)
        kind: Kind = "jwt" if verified.kind == "jwt" else "introspected"
        return Identity(verified.principal, verified.token_id, kind, verified.client_id, groups)

    def _token(
        self, token: str, identity: Identity, expires_at: int | None, token_scopes: tuple[str, ...]
    ) -> AccessToken:
        scopes = self.policy.scopes_of(identity.principal, identity.groups) if self.policy else None
        asked = [s for s in token_scopes if known_scope(s)]
        if asked:  # (a token issued for some of our scopes is held to them: the client asked)
            scopes = frozenset(
                s for s in asked if Identity("-", "-", "static", scopes=scopes).allows(s)
            )
        identity = Identity(
            identity.principal,
            identity.token_id,
            identity.kind,
            identity.client_id,
            identity.groups,
            scopes,
        )
        return AccessToken(
            token=token,
            client_id=identity.principal,
            scopes=sorted(scopes) if scopes is not None else [],
            # (the transport drops a token past this: the verifier's leeway counts)
            expires_at=expires_at + 60 if expires_at is not None else None,
            subject=identity.principal,
            claims={IDENTITY_CLAIM: identity},
        )


def _note(reason: str) -> None:
    refusals = _refusals.get()
    if refusals is not None:
        refusals.append(reason)


def challenge_text(text: str) -> str:
    """`text` as an RFC 6750 quoted-string's content (no quote, backslash or control)."""
    return "".join(c if c.isprintable() and c not in '"\\' else " " for c in text)[:500]


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
    to fix it, in the 401's body (see refusal_body) and WWW-Authenticate. Without OAuth, no
    OAuth hints (the library's text tells clients to re-register, which sends mcp-remote and
    the SDKs into a client-registration attempt that hides the real problem). With OAuth
    (`metadata`), the MCP authorization spec's challenge: `resource_metadata` naming where to
    sign in, the scopes to ask for, and the verifier's reason as error_description. The token
    sent is never echoed."""

    def __init__(self, app: ASGIApp, metadata: ResourceMetadata | None = None) -> None:
        self.app = app
        self.metadata = metadata

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = False
        refusals: list[str] = []
        held = _refusals.set(refusals)

        async def answer(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 401:
                refused = True
                offered = any(
                    k.lower() == b"authorization" and v[:7].lower() == b"bearer "
                    for k, v in scope.get("headers", [])
                )
                text, challenge = self._challenge(scope["path"], offered, refusals)
                body = refusal_body(text)
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

        try:
            await self.app(scope, receive, answer)
        finally:
            _refusals.reset(held)

    def _challenge(self, path: str, offered: bool, refusals: list[str]) -> tuple[str, str]:
        """(the body's text, the WWW-Authenticate value) of a 401 for `path`."""
        if self.metadata is None:
            text = INVALID if offered else MISSING
            challenge = 'Bearer realm="sandbox_runtime"'
            if offered:  # RFC 6750 3.1: no error code when no credentials came
                challenge += f', error="invalid_token", error_description="{text}"'
            return text, challenge
        endpoint = self.metadata.endpoint_path(path)
        url = self.metadata.metadata_url(endpoint)
        challenge = f'Bearer resource_metadata="{url}"'
        if scopes := " ".join(self.metadata.scopes_for(path)):
            challenge += f', scope="{challenge_text(scopes)}"'
        if not offered:
            text = (
                f"missing token: sign in with the authorization server named at {url} (MCP "
                "clients do this by themselves), or send a static token as Authorization: "
                "Bearer <token>"
            )
            return text, challenge
        reason = refusals[0] if refusals else "the token is not one this server accepts"
        text = f"invalid token: {reason}; sign in again (see {url}) or send a valid token"
        challenge += f', error="invalid_token", error_description="{challenge_text(reason)}"'
        return text, challenge


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
