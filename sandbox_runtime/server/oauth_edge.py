"""OAuth at the HTTP edge: the protected resource metadata routes (RFC 9728), the challenge
a refused token gets (RFC 6750 with `resource_metadata`), and the 403 insufficient_scope of
a tools/call the caller's scopes do not cover (the MCP spec's step-up)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sandbox_runtime.config import Settings
from sandbox_runtime.oauth.metadata import WELL_KNOWN, ResourceMetadata


def resource_metadata(settings: Settings) -> ResourceMetadata | None:
    """The metadata of this server as a protected resource; None when OAuth is off."""
    issuers = settings.oauth_issuers()
    if not issuers or not settings.oauth_resource:
        return None
    return ResourceMetadata(settings.oauth_resource, issuers, settings.oauth_audiences()[1:])


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
        return JSONResponse(body, headers={"Cache-Control": "public, max-age=300"})

    return [
        Route(WELL_KNOWN, document, methods=["GET"]),
        Route(WELL_KNOWN + "/{rest:path}", document, methods=["GET"]),
    ]
