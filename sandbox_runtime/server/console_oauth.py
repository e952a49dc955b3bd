"""What the web console signs in with when OAuth is configured (served as its config.json)."""

from __future__ import annotations

from typing import Any

from sandbox_runtime.config import Settings
from sandbox_runtime.oauth.scopes import supported


def console_oauth(settings: Settings) -> dict[str, Any] | None:
    """The console's sign-in: the issuer (the first of SANDBOX_OAUTH_ISSUER), its client
    (SANDBOX_OAUTH_CONSOLE_CLIENT_ID: public, PKCE), the resource its tokens are for and the
    scopes it asks for; None (token sign-in only) unless all are configured."""
    issuers = settings.oauth_issuers()
    client_id = settings.oauth_console_client_id
    if not issuers or not settings.oauth_resource or not client_id:
        return None
    advertised = settings.oauth_advertised_scopes()  # (SANDBOX_OAUTH_SCOPES)
    asked = supported() if advertised is None else advertised
    scope = settings.oauth_console_scope or " ".join(["openid", *asked])
    return {
        "issuer": issuers[0],
        "client_id": client_id,
        "resource": settings.oauth_resource,
        "scope": scope,
    }
