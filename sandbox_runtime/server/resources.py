"""Workspace files as MCP resources: their URIs.

Results name the files a call changed in `files`, not as resource links: LangChain's MCP
adapters turn every resource link into an image or a file URL (an image_url of workspace://,
which OpenAI-style APIs reject; a file URL, which its OpenAI conversion refuses outright)."""

from __future__ import annotations

from urllib.parse import quote

from sandbox_runtime.domain.owner import Owner

RESOURCE_TEMPLATE = "workspace://{session}/{path*}"
THIS_SESSION = "~"  # in a resource URI: the session of the request (transport or default)


def resource_uri(owner: Owner, path: str) -> str:
    """The workspace:// URI of a file of `owner`'s workspace, as resources/read takes it:
    named sessions by name, the others (a transport session, the default) as `~`."""
    session = owner.session_id
    name = session[2:] if session.startswith("s:") else THIS_SESSION
    return f"workspace://{quote(name, safe='')}/{quote(path, safe='/')}"
