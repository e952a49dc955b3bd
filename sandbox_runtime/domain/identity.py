"""Who a call comes from: the principal a credential maps to, and what the audit log and the
scope checks need to know about it. Never the credential itself."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

# The key under which a verifier puts the Identity in its AccessToken's claims.
IDENTITY_CLAIM = "srt_identity"

# The token id of a call with no credential, or of one whose verifier named none.
UNNAMED = "-"

Kind = Literal["static", "jwt", "introspected", "anonymous"]


@dataclass(frozen=True)
class Identity:
    """A verified caller.

    `principal` owns sessions (the owner key's first half). `token_id` names the credential in
    logs without revealing it: `st-<12 hex>` for a static token (a digest prefix), the JWT's
    `jti` (else `jwt-<12 hex>`) for an access token. `client_id` is the OAuth client the token
    was issued to (None for static tokens). `scopes` is what the principal may do here: None
    means every scope (no policy configured)."""

    principal: str
    token_id: str
    kind: Kind
    client_id: str | None = None
    groups: tuple[str, ...] = ()
    scopes: frozenset[str] | None = None

    def allows(self, scope: str) -> bool:
        """Whether the caller may use what `scope` guards (`servers:*` covers every server)."""
        if self.scopes is None or not scope or scope in self.scopes:
            return True
        return scope.startswith("servers:") and "servers:*" in self.scopes


ANONYMOUS = Identity(principal="anonymous", token_id=UNNAMED, kind="anonymous")


def token_id(token: str, prefix: str = "st") -> str:
    """A credential's name for logs: a digest prefix, never the credential."""
    digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{prefix}-{digest[:12]}"


def identity_of(claims: dict[str, Any] | None, principal: str | None) -> Identity:
    """The Identity a verifier attached to an access token (its `claims`), else a static
    token's plain principal, else anonymous."""
    found = (claims or {}).get(IDENTITY_CLAIM)
    if isinstance(found, Identity):
        return found
    if principal is None:
        return ANONYMOUS
    return Identity(principal=principal, token_id=UNNAMED, kind="static")
