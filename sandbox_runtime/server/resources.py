"""Workspace files as MCP resources: their URIs, and links to the files a call changed."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from mcp.types import ResourceLink

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.files.operations import mime_type_of

RESOURCE_TEMPLATE = "workspace://{session}/{path*}"
THIS_SESSION = "~"  # in a resource URI: the session of the request (transport or default)


def resource_uri(owner: Owner, path: str) -> str:
    """The workspace:// URI of a file of `owner`'s workspace, as resources/read takes it:
    named sessions by name, the others (a transport session, the default) as `~`."""
    session = owner.session_id
    name = session[2:] if session.startswith("s:") else THIS_SESSION
    return f"workspace://{quote(name, safe='')}/{quote(path, safe='/')}"


def resource_links(owner: Owner, files: list[dict[str, Any]] | None) -> list[ResourceLink]:
    """Resource links for the files a call created or changed."""
    return [
        ResourceLink(
            type="resource_link",
            uri=resource_uri(owner, f["path"]),
            name=f["path"],
            mime_type=mime_type_of(f["path"]),
            size=f["size"],
        )
        for f in files or []
    ]
