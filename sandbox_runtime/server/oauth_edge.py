"""OAuth at the HTTP edge: the protected resource metadata routes (RFC 9728), the challenge
a refused token gets (RFC 6750 with `resource_metadata`), and the 403 insufficient_scope of
a tools/call the caller's scopes do not cover (the MCP spec's step-up)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.identity import Identity, identity_of
from sandbox_runtime.oauth.issuers import Issuers
from sandbox_runtime.oauth.metadata import WELL_KNOWN, ResourceMetadata
from sandbox_runtime.oauth.policy import Policy, load_policy, refusal_text
from sandbox_runtime.oauth.scopes import METHOD_SCOPES, NONE, tool_scope
from sandbox_runtime.oauth.verifier import OAuthVerifier
from sandbox_runtime.server.auth import REFUSED_CODE, CallerVerifier, challenge_text
from sandbox_runtime.server.session_path import public_path


def resource_metadata(settings: Settings) -> ResourceMetadata | None:
    """The metadata of this server as a protected resource; None when OAuth is off."""
    issuers = settings.oauth_issuers()
    if not issuers or not settings.oauth_resource:
        return None
    return ResourceMetadata(
        settings.oauth_resource,
        issuers,
        settings.oauth_audiences()[1:],
        settings.oauth_advertised_scopes(),
    )


def metadata_routes(metadata: ResourceMetadata | None) -> list[Route]:
    """`/.well-known/oauth-protected-resource` and its path-suffixed forms (`.../mcp`,
    `.../servers/<name>/mcp`); none when OAuth is off."""
    if metadata is None:
        return []

    async def document(request: Request) -> Response:
        suffix = request.url.path[len(WELL_KNOWN) :]
        body = metadata.document(suffix)
        if body is None:
            return JSONResponse(
                {"error": "not_found", "error_description": f"no protected resource at {suffix}"},
                status_code=404,
            )
        # (a public document: browser-based clients of another origin may read it)
        headers = {"Cache-Control": "public, max-age=300", "Access-Control-Allow-Origin": "*"}
        return JSONResponse(body, headers=headers)

    return [
        Route(WELL_KNOWN, document, methods=["GET"]),
        Route(WELL_KNOWN + "/{rest:path}", document, methods=["GET"]),
    ]


def make_verifier(settings: Settings) -> CallerVerifier | None:
    """The bearer token verifier of /mcp and /servers/<name>/mcp: static tokens and (with
    SANDBOX_OAUTH_ISSUER) OAuth access tokens, each with the policy file's scopes. None: no
    token configured (an open server, as before). Raises PolicyError for a bad policy file."""
    tokens = settings.tokens()
    metadata = resource_metadata(settings)
    policy = load_policy(settings.policy_file) if settings.policy_file is not None else None
    if not tokens and metadata is None:
        return None
    oauth = None
    if metadata is not None:
        secret = settings.oauth_introspection_client_secret
        introspection = None
        if settings.oauth_introspection_client_id:
            value = secret.get_secret_value() if secret is not None else ""
            introspection = (settings.oauth_introspection_client_id, value)
        oauth = OAuthVerifier(
            Issuers(metadata.issuers, settings.oauth_jwks_cache_seconds),
            metadata,
            principal_claim=settings.oauth_principal_claim,
            groups_claim=settings.oauth_groups_claim,
            introspection=introspection,
        )
    return CallerVerifier(tokens, oauth, policy)


# A tools/call body read to find the tool's name; a larger one (a big write_file) goes on
# unread and the tool layer checks the scope instead (calls.py: a tool error naming it).
MAX_PEEK = 256 * 1024


class ScopeGuard:
    """Answers a tools/call (or resources/read) that the caller's scopes do not cover with
    the MCP spec's 403: `WWW-Authenticate: Bearer error="insufficient_scope", scope=...`,
    and a JSON-RPC error saying which scope and how to get it. Sits behind the auth (the
    request's user is the verified token); other requests pass untouched."""

    def __init__(self, app: ASGIApp, metadata: ResourceMetadata | None, policy: Policy | None):
        self.app = app
        self.metadata = metadata
        self.policy = policy
        self.on_refused: list[Callable[[Scope, Identity, bytes], None]] = []  # (the audit log)

    def __getattr__(self, name: str) -> Any:  # (the session manager, looked up through here)
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        identity = _identity(scope)
        if scope["type"] != "http" or scope["method"] != "POST" or identity.scopes is None:
            await self.app(scope, receive, send)
            return
        body, whole = await _peek(receive)
        replay = _replay(body, whole, receive)
        readable = whole and len(body) <= MAX_PEEK
        needed, request_id = _needed(body) if readable else (None, None)
        if needed is None or identity.allows(needed):
            await self.app(scope, replay, send)
            return
        text = refusal_text(needed, identity.principal, self.policy)
        for refused in self.on_refused:
            refused(scope, identity, body)
        path = public_path(scope)
        await insufficient_scope(send, needed, text, self.metadata, path, request_id)


async def insufficient_scope(
    send: Send,
    needed: str,
    text: str,
    metadata: ResourceMetadata | None,
    path: str,
    request_id: Any = None,
) -> None:
    """403 insufficient_scope (RFC 6750 3.1; the MCP spec's step-up) naming the scope, with a
    JSON-RPC error body that says it in words."""
    challenge = f'Bearer error="insufficient_scope", scope="{challenge_text(needed)}"'
    if metadata is not None:
        challenge += f', resource_metadata="{metadata.metadata_url(metadata.endpoint_path(path))}"'
    challenge += f', error_description="{challenge_text(text)}"'
    error = {"code": REFUSED_CODE, "message": text, "data": {"scope": needed}}
    payload = json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 403,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"www-authenticate", challenge.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def _identity(scope: Scope) -> Identity:
    user = scope.get("user")
    token = getattr(user, "access_token", None)
    if token is None:
        return identity_of(None, None)
    return identity_of(token.claims, token.client_id)


async def _peek(receive: Receive) -> tuple[bytes, bool]:
    """The request's body up to MAX_PEEK bytes, and whether that is all of it."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), True
        if size > MAX_PEEK:
            return b"".join(chunks), False


def _replay(body: bytes, whole: bool, receive: Receive) -> Receive:
    """A receive that gives `body` first (then, if it was not whole, the rest as it comes)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": not whole}
        return await receive()

    return again


def _needed(body: bytes) -> tuple[str | None, Any]:
    """(the scope a JSON-RPC request needs, its id); (None, None) when it needs none."""
    try:
        message = json.loads(body)
    except ValueError:
        return None, None
    if not isinstance(message, dict) or not isinstance(message.get("params"), dict):
        return None, None
    method = message.get("method")
    if method == "tools/call":
        name = message["params"].get("name")
        needed = tool_scope(name) if isinstance(name, str) else NONE
    else:
        needed = METHOD_SCOPES.get(str(method), NONE)
    return (needed or None), message.get("id")


def guard_scopes(
    routes: list[Any],
    metadata: ResourceMetadata | None,
    verifier: CallerVerifier | None,
    on_refused: Callable[[Scope, Identity, bytes], None] | None = None,
) -> None:
    """Put the ScopeGuard behind the auth of the MCP app's endpoint (these are its routes)."""
    if verifier is None:
        return
    for route in routes:
        endpoint = getattr(route, "endpoint", None)
        if getattr(route, "path", None) == "/mcp" and hasattr(endpoint, "required_scopes"):
            guard = ScopeGuard(endpoint.app, metadata, verifier.policy)  # type: ignore[union-attr]
            guard.on_refused.extend([on_refused] if on_refused is not None else [])
            endpoint.app = guard  # type: ignore[union-attr]
            return
    raise RuntimeError("the MCP app has no authenticated /mcp route to guard")
