"""Bearer tokens: each maps to a principal; compared in constant time, never logged."""

from __future__ import annotations

import hashlib
import hmac

from fastmcp.server.auth import AccessToken, TokenVerifier


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


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
