"""Access tokens from the trusted authorization servers, checked here: a JWT locally (issuer,
audience = this server, expiry, not-before, signature against the issuer's keys), an opaque
token by introspection (RFC 7662). The result names the caller; a refusal says why in words
fit for RFC 6750's error_description (never the token)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx2
import jwt

from sandbox_runtime.domain.owner import DEFAULT_SESSION, Owner, valid_owner
from sandbox_runtime.oauth.issuers import ALGORITHMS, Issuers, IssuerUnavailableError
from sandbox_runtime.oauth.metadata import ResourceMetadata

LEEWAY = 30  # seconds of clock skew tolerated on exp, nbf and iat
INTROSPECTION_CACHE_SECONDS = 30.0
INTROSPECTION_SECONDS = 10.0  # for a whole introspection answer
MAX_ANSWER = 256 * 1024  # bytes of an introspection answer read
JWT_CACHE_SECONDS = 60.0
CACHE_SIZE = 4096  # entries of each cache
MAX_GROUPS = 256
MAX_TOKEN = 16 * 1024  # characters of a bearer token looked at


class TokenRefusedError(Exception):
    """The token is not accepted; str() is the reason (RFC 6750's error_description)."""


@dataclass(frozen=True)
class Verified:
    """What a verified access token says about its caller."""

    principal: str
    token_id: str
    kind: str  # "jwt" or "introspected"
    issuer: str
    client_id: str | None
    groups: tuple[str, ...]
    token_scopes: tuple[str, ...]  # its `scope` / `scp` claim
    expires_at: int | None


class OAuthVerifier:
    """Checks access tokens of the configured issuers (see the module's docstring)."""

    def __init__(
        self,
        issuers: Issuers,
        resource: ResourceMetadata,
        principal_claim: str = "sub",
        groups_claim: str = "groups",
        introspection: tuple[str, str] | None = None,
    ) -> None:
        self.issuers = issuers
        self.resource = resource
        self.principal_claim = principal_claim
        self.groups_claim = groups_claim
        self.introspection = introspection  # (client id, secret)
        self._introspected: OrderedDict[bytes, tuple[float, Verified]] = OrderedDict()
        # Verified JWTs by digest, for JWT_CACHE_SECONDS (never past their exp): a signature
        # check costs ~0.1-0.7 ms, a digest ~1 us; a JWT cannot be revoked here anyway.
        self._verified_jwts: OrderedDict[bytes, tuple[float, Verified]] = OrderedDict()
        self._client: httpx2.AsyncClient | None = None

    async def aclose(self) -> None:
        await self.issuers.aclose()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def verify(self, token: str) -> Verified:
        """The caller `token` names. Raises TokenRefusedError saying why not."""
        if len(token) > MAX_TOKEN:
            raise TokenRefusedError("the token is too long to be an access token of this server")
        if token.count(".") == 2:
            digest = hashlib.sha256(token.encode()).digest()
            known = self._verified_jwts.get(digest)
            if known is not None and known[0] > time.monotonic() and _unexpired(known[1]):
                return known[1]
            verified = await self._verify_jwt(token)
            _remember(self._verified_jwts, digest, verified, JWT_CACHE_SECONDS)
            return verified
        if self.introspection is not None:
            return await self._introspect(token)
        raise TokenRefusedError(
            "the token is neither a configured static token nor a JWT access token (opaque "
            "tokens need SANDBOX_OAUTH_INTROSPECTION_CLIENT_ID)"
        )

    async def _verify_jwt(self, token: str) -> Verified:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise TokenRefusedError("the token is not a well-formed JWT") from None
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise TokenRefusedError(
                f"the token's signing algorithm {alg!r} is not accepted (asymmetric only: "
                "RS256, PS256, ES256, EdDSA and their longer forms)"
            )
        issuer = self.issuers.find(unverified.get("iss"))
        if issuer is None:
            raise TokenRefusedError(
                f"the token's issuer {str(unverified.get('iss'))[:200]!r} is not one this "
                f"server trusts ({', '.join(self.issuers.names)})"
            )
        kid = header.get("kid")
        try:
            key = await self.issuers.key(issuer, kid if isinstance(kid, str) else None, alg)
        except IssuerUnavailableError as exc:
            raise TokenRefusedError(f"the issuer's signing keys cannot be fetched: {exc}") from None
        if key is None:
            raise TokenRefusedError(
                f"the token is signed by a key ({str(kid)[:100]!r}) that its issuer does not "
                "publish for this algorithm"
            )
        try:
            claims = jwt.decode(
                token,
                key=key.public,
                algorithms=[alg],
                issuer=unverified["iss"],  # (trusted: find() matched it, a trailing / aside)
                leeway=LEEWAY,
                options={"require": ["exp", "iss"], "verify_aud": False},
            )
        except jwt.ExpiredSignatureError:
            raise TokenRefusedError("the token has expired") from None
        except jwt.ImmatureSignatureError:
            raise TokenRefusedError(
                "the token is not valid yet (nbf or iat in the future)"
            ) from None
        except jwt.InvalidSignatureError:
            raise TokenRefusedError("the token's signature does not verify") from None
        except jwt.MissingRequiredClaimError as exc:
            raise TokenRefusedError(f"the token has no {exc.claim!r} claim") from None
        except jwt.InvalidIssuerError:
            raise TokenRefusedError("the token's issuer is not the one that signed it") from None
        except (jwt.PyJWTError, ValueError, TypeError) as exc:
            raise TokenRefusedError(f"the token is not valid: {type(exc).__name__}") from None
        self._check_audience(claims.get("aud"))
        return self._verified(claims, "jwt", issuer.issuer, token)

    def _check_audience(self, aud: Any) -> None:
        audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if not any(isinstance(a, str) and self.resource.names_this_server(a) for a in audiences):
            raise TokenRefusedError(
                f"the token's audience is not this server (it must name {self.resource.resource}"
                f"{' or ' + ', '.join(self.resource.audiences) if self.resource.audiences else ''})"
            )

    def _verified(self, claims: dict[str, Any], kind: str, issuer: str, token: str) -> Verified:
        principal = claims.get(self.principal_claim)
        if isinstance(principal, list) and principal and isinstance(principal[0], str):
            principal = principal[0]  # (a group claim as the principal: its first group)
        # (a principal names keys, principal:session in the cluster's store, and log lines:
        # the rule the placement queue checks, so that none collides with another's)
        if not isinstance(principal, str) or not valid_owner(Owner(principal, DEFAULT_SESSION)):
            raise TokenRefusedError(
                f"the token has no usable {self.principal_claim!r} claim to name its principal "
                "(1-256 printable characters, no ':' or ','; SANDBOX_OAUTH_PRINCIPAL_CLAIM names "
                "the claim, e.g. sub, email or preferred_username)"
            )
        jti = claims.get("jti")
        if isinstance(jti, str) and 0 < len(jti) <= 128 and jti.isprintable():
            token_id = jti
        else:
            token_id = "jwt-" + hashlib.sha256(token.encode()).hexdigest()[:12]
        client = claims.get("client_id") or claims.get("azp")
        exp = claims.get("exp")
        return Verified(
            principal=principal,
            token_id=token_id,
            kind=kind,
            issuer=issuer,
            client_id=client if isinstance(client, str) else None,
            groups=_strings(claims.get(self.groups_claim))[:MAX_GROUPS],
            token_scopes=_strings(claims.get("scope", claims.get("scp"))),
            expires_at=int(exp) if isinstance(exp, int | float) else None,
        )

    async def _introspect(self, token: str) -> Verified:
        """RFC 7662 at each issuer's introspection_endpoint; an active answer is kept for a few
        seconds (bounded), an inactive one never (a revoked token is refused at once)."""
        digest = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        known = self._introspected.get(digest)
        if known is not None and known[0] > now and _unexpired(known[1]):
            return known[1]
        assert self.introspection is not None
        client_id, secret = self.introspection
        basic = base64.b64encode(f"{client_id}:{secret}".encode()).decode()
        problems = []
        for name in self.issuers.names:
            issuer = self.issuers.find(name)
            assert issuer is not None
            try:
                endpoint = (await self.issuers.metadata(issuer)).get("introspection_endpoint")
            except IssuerUnavailableError as exc:
                problems.append(str(exc))
                continue
            if not isinstance(endpoint, str):
                continue
            answer = await self._post(endpoint, token, basic)
            if answer is None:
                problems.append(f"{endpoint} did not answer")
                continue
            if answer.get("active") is not True:  # (RFC 7662: a boolean; "false" is truthy)
                continue
            if answer.get("iss") is not None and self.issuers.find(answer["iss"]) is not issuer:
                continue
            exp = answer.get("exp")
            if isinstance(exp, int | float) and exp + LEEWAY < time.time():
                raise TokenRefusedError("the token has expired")
            self._check_audience(answer.get("aud"))  # (none named: not ours to take)
            verified = self._verified(answer, "introspected", issuer.issuer, token)
            _remember(self._introspected, digest, verified, INTROSPECTION_CACHE_SECONDS)
            return verified
        if problems:
            raise TokenRefusedError(f"the token cannot be introspected: {'; '.join(problems)}")
        raise TokenRefusedError("the token is not active (revoked, expired or unknown)")

    async def _post(self, endpoint: str, token: str, basic: str) -> dict[str, Any] | None:
        if self._client is None:
            self._client = httpx2.AsyncClient(timeout=5.0, follow_redirects=False)
        form = {"token": token, "token_type_hint": "access_token"}
        headers = {"authorization": f"Basic {basic}", "accept": "application/json"}
        body = b""
        try:
            # (bounded in bytes and in time as a whole: the client's timeout is per read)
            async with (
                asyncio.timeout(INTROSPECTION_SECONDS),
                self._client.stream("POST", endpoint, data=form, headers=headers) as response,
            ):
                if response.status_code != 200:
                    return None
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_ANSWER:
                        return None
        except (httpx2.HTTPError, TimeoutError):
            return None
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None


def _remember(
    cache: OrderedDict[bytes, tuple[float, Verified]], digest: bytes, found: Verified, ttl: float
) -> None:
    cache[digest] = (time.monotonic() + ttl, found)
    cache.move_to_end(digest)
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)


def _unexpired(verified: Verified) -> bool:
    return verified.expires_at is None or verified.expires_at + LEEWAY >= time.time()


def _strings(value: Any) -> tuple[str, ...]:
    """A claim that lists names: a JSON list of strings, or one space-separated string."""
    if isinstance(value, str):
        return tuple(value.split())
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, str) and v)
    return ()
