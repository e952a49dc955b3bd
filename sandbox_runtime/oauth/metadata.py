"""Protected resource metadata (RFC 9728): what a client reads to find where to sign in, and
the URLs of this server's MCP endpoints as resources (the audiences a token may name)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from sandbox_runtime.oauth.scopes import server_scope, supported

WELL_KNOWN = "/.well-known/oauth-protected-resource"
# The endpoints below the resource's base that are MCP endpoints of this same server.
_SUB_RESOURCE = re.compile(
    r"(?:/s/[A-Za-z0-9._:@-]{1,128})?(?:/servers/(?P<server>[A-Za-z0-9_.-]{1,64}))?/mcp"
)


class ResourceMetadata:
    """The resource (SANDBOX_OAUTH_RESOURCE) and the authorization servers; answers which
    document a well-known path asks for and which audiences name this server."""

    def __init__(
        self,
        resource: str,
        issuers: list[str],
        audiences: list[str],
        scopes: list[str] | None = None,
    ) -> None:
        self.resource = resource.rstrip("/")
        parts = urlsplit(self.resource)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        path = parts.path.rstrip("/")
        # The resource's base: where /mcp, /s/<session>/mcp and /servers/<name>/mcp live.
        self.base_path = path[: -len("/mcp")] if path.endswith("/mcp") else path
        self.path = path
        self.issuers = issuers
        self.audiences = [a.rstrip("/") for a in audiences if a]
        # The scopes clients are told to ask for (None: this server's own, as the table names)
        self.advertised = scopes

    def metadata_url(self, path: str | None = None) -> str:
        """The metadata URL for the endpoint at `path` (None: the resource itself), per RFC
        9728 §3.1: the well-known prefix between the origin and the path."""
        return f"{self.origin}{WELL_KNOWN}{self.path if path is None else path}"

    def endpoint_path(self, request_path: str) -> str | None:
        """The public path of a served MCP endpoint (`/mcp`, `/s/x/mcp`, `/servers/x/mcp`),
        as the resource URL spells it; None for anything else."""
        if request_path.rstrip("/") == "/mcp":
            return self.path
        if _SUB_RESOURCE.fullmatch(request_path):
            return self.base_path + request_path
        return None

    def scopes_for(self, path: str) -> list[str]:
        """The scopes a client of the endpoint at request `path` is told to ask for."""
        if self.advertised is not None:
            return self.advertised
        match = _SUB_RESOURCE.fullmatch(path)
        if match is not None and match["server"]:
            return [server_scope(match["server"])]
        return supported()

    def document(self, suffix: str) -> dict[str, Any] | None:
        """The metadata for the well-known path `WELL_KNOWN + suffix` (None: no such resource)."""
        suffix = suffix.rstrip("/")
        if suffix in ("", self.path):
            resource, scopes = self.resource, self.scopes_for("/mcp")
        elif suffix.startswith(self.base_path) and _SUB_RESOURCE.fullmatch(
            sub := suffix[len(self.base_path) :]
        ):
            resource, scopes = self.origin + suffix, self.scopes_for(sub)
        else:
            return None
        document: dict[str, Any] = {
            "resource": resource,
            "authorization_servers": self.issuers,
            "scopes_supported": scopes,
            "bearer_methods_supported": ["header"],
            "resource_name": "sandbox_runtime",
        }
        if not scopes:
            del document["scopes_supported"]
        return document

    def names_this_server(self, audience: str) -> bool:
        """Whether a token's audience is this server: the resource, a configured audience, or
        one of this server's MCP endpoints (a client of /servers/x/mcp asks for that URL)."""
        audience = audience.rstrip("/")
        if audience == self.resource or audience in self.audiences:
            return True
        prefix = self.origin + self.base_path
        return audience.startswith(prefix) and bool(
            _SUB_RESOURCE.fullmatch(audience[len(prefix) :])
        )
