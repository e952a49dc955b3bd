"""The authorization servers this server trusts: each one's metadata (discovered at its
well-known URL) and signing keys (its JWKS), fetched on first need and cached; a token signed
by a key not yet known refreshes the keys at once, at most every REFRESH_EVERY seconds, so
that rotation is followed and a stream of made-up key ids cannot make us hammer the issuer.
Every replica fetches for itself: nothing is shared, nothing needs to be."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx2
import jwt
from loguru import logger

# The asymmetric algorithms accepted (never `none`, never HS*: a public key is no secret).
ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
REFRESH_EVERY = 10.0  # seconds between two refreshes forced by an unknown key id
MAX_KEYS = 64
MAX_DOCUMENT = 256 * 1024  # bytes of a metadata or JWKS document read


class IssuerUnavailableError(Exception):
    """The issuer's metadata or keys could not be fetched (the message says which URL)."""


@dataclass(frozen=True)
class Key:
    """A signing key as published: its public key, type, curve and (if named) algorithm."""

    public: Any
    kty: str
    crv: str | None
    alg: str | None


@dataclass
class Issuer:
    """One trusted authorization server: its metadata and its keys, as last fetched."""

    issuer: str
    metadata: dict[str, Any] | None = None
    keys: dict[str, Key] = field(default_factory=dict)  # kid (or "#n") -> key
    fetched_at: float = 0.0  # when the keys were fetched (monotonic)
    forced_at: float = -REFRESH_EVERY  # when an unknown key id last forced a refresh
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def discovery_urls(issuer: str) -> list[str]:
    """Where an issuer's metadata is: OpenID Connect Discovery, then RFC 8414 (path-inserted
    for an issuer with a path)."""
    base = issuer.rstrip("/")
    parts = urlsplit(base)
    origin = f"{parts.scheme}://{parts.netloc}"
    urls = [f"{base}/.well-known/openid-configuration"]
    urls.append(f"{origin}/.well-known/oauth-authorization-server{parts.path}")
    return urls


class Issuers:
    """The trusted issuers' metadata and keys (see the module's docstring)."""

    def __init__(self, issuers: list[str], cache_seconds: float, timeout: float = 5.0) -> None:
        self._issuers = {i: Issuer(i) for i in issuers}
        # (an issuer named with a trailing slash matches tokens whose iss has none, and back)
        self._aliases = {i.rstrip("/"): i for i in issuers}
        self.cache_seconds = cache_seconds
        self.timeout = timeout
        self._client: httpx2.AsyncClient | None = None

    def find(self, iss: Any) -> Issuer | None:
        """The trusted issuer a token's `iss` names, if any (exact, a trailing slash aside)."""
        if not isinstance(iss, str):
            return None
        if iss in self._issuers:
            return self._issuers[iss]
        name = self._aliases.get(iss.rstrip("/"))
        return self._issuers[name] if name is not None else None

    @property
    def names(self) -> list[str]:
        return list(self._issuers)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def metadata(self, issuer: Issuer) -> dict[str, Any]:
        """The issuer's metadata (fetched once, again after cache_seconds). Raises
        IssuerUnavailableError."""
        if not self._stale(issuer):
            assert issuer.metadata is not None
            return issuer.metadata
        async with issuer.lock:
            if self._stale(issuer):
                try:
                    await self._refresh(issuer)
                except IssuerUnavailableError as exc:
                    if issuer.metadata is None:
                        raise
                    # An issuer that is down for a while does not sign anyone out: the keys
                    # known are kept, and asked for again in REFRESH_EVERY seconds.
                    logger.warning("issuer {}: keeping its known keys: {}", issuer.issuer, exc)
                    issuer.fetched_at = time.monotonic() - self.cache_seconds + REFRESH_EVERY
        assert issuer.metadata is not None
        return issuer.metadata

    def _stale(self, issuer: Issuer) -> bool:
        return issuer.metadata is None or time.monotonic() - issuer.fetched_at >= self.cache_seconds

    async def key(self, issuer: Issuer, kid: str | None, alg: str) -> Key | None:
        """The issuer's key named `kid` for `alg` (None: the issuer publishes no such key, even
        after a refresh). Raises IssuerUnavailableError."""
        await self.metadata(issuer)
        found = _pick(issuer.keys, kid, alg)
        if found is not None:
            return found
        async with issuer.lock:
            found = _pick(issuer.keys, kid, alg)  # (another call may have refreshed meanwhile)
            if found is None and time.monotonic() - issuer.forced_at >= REFRESH_EVERY:
                issuer.forced_at = time.monotonic()
                await self._refresh(issuer)
                found = _pick(issuer.keys, kid, alg)
        return found

    async def _refresh(self, issuer: Issuer) -> None:
        metadata = None
        problems = []
        for url in discovery_urls(issuer.issuer):
            try:
                metadata = await self._get_json(url)
                break
            except IssuerUnavailableError as exc:
                problems.append(str(exc))
        if metadata is None:
            raise IssuerUnavailableError("; ".join(problems))
        if str(metadata.get("issuer", "")).rstrip("/") != issuer.issuer.rstrip("/"):
            raise IssuerUnavailableError(
                f"the metadata of {issuer.issuer} names issuer {metadata.get('issuer')!r}: "
                "SANDBOX_OAUTH_ISSUER must be the issuer exactly as the provider names it"
            )
        keys: dict[str, Key] = {}
        jwks_uri = metadata.get("jwks_uri")
        if isinstance(jwks_uri, str):
            document = await self._get_json(jwks_uri)
            listed = document.get("keys")
            if not isinstance(listed, list):
                raise IssuerUnavailableError(f"{jwks_uri} has no `keys` list")
            for n, item in enumerate(listed[:MAX_KEYS]):
                if not isinstance(item, dict) or item.get("use", "sig") != "sig":
                    continue
                try:
                    parsed = jwt.PyJWK(item)
                except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError):
                    continue  # (a key type we cannot use signs nothing we accept)
                if parsed.key_type == "oct":
                    continue  # (a shared secret is never a way to verify a token here)
                alg = item.get("alg") if isinstance(item.get("alg"), str) else None
                crv = item.get("crv") if isinstance(item.get("crv"), str) else None
                keys[str(item.get("kid") or f"#{n}")] = Key(
                    parsed.key, str(parsed.key_type), crv, alg
                )
        issuer.metadata, issuer.keys, issuer.fetched_at = metadata, keys, time.monotonic()

    async def _get_json(self, url: str) -> dict[str, Any]:
        if self._client is None:
            self._client = httpx2.AsyncClient(timeout=self.timeout, follow_redirects=False)
        try:
            # (the client's timeout is per read: an answer that trickles in would hold the
            # issuer's lock, which every request waits for once the keys are stale, for ever)
            async with asyncio.timeout(self.timeout * 2):
                body = await self._read(url)
        except TimeoutError:
            raise IssuerUnavailableError(
                f"{url}: no whole answer within {self.timeout * 2:g} s"
            ) from None
        except httpx2.HTTPError as exc:
            raise IssuerUnavailableError(f"{url}: {type(exc).__name__}: {exc}") from None
        try:
            document = json.loads(body)
        except ValueError:
            raise IssuerUnavailableError(f"{url} did not answer JSON") from None
        if not isinstance(document, dict):
            raise IssuerUnavailableError(f"{url} did not answer a JSON object")
        return document

    async def _read(self, url: str) -> bytes:
        assert self._client is not None
        async with self._client.stream("GET", url, headers={"accept": "application/json"}) as r:
            if r.status_code != 200:
                raise IssuerUnavailableError(f"{url} answered {r.status_code}")
            body = b""
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_DOCUMENT:
                    raise IssuerUnavailableError(f"{url}: more than {MAX_DOCUMENT} bytes")
        return body


def _pick(keys: dict[str, Key], kid: str | None, alg: str) -> Key | None:
    """The key a token names: by `kid`; without one, the only key that fits `alg`."""
    if kid is not None:
        key = keys.get(kid)
        return key if key is not None and _fits(key, alg) else None
    fitting = [k for k in keys.values() if _fits(k, alg)]
    return fitting[0] if len(fitting) == 1 else None


_CURVES = {"ES256": "P-256", "ES384": "P-384", "ES512": "P-521"}


def _fits(key: Key, alg: str) -> bool:
    """Whether `key` may verify `alg`: the key's type (and curve) is the algorithm's, and a key
    that names its algorithm names this one."""
    if key.alg is not None and key.alg != alg:
        return False
    if alg == "EdDSA":
        return key.kty == "OKP"
    if alg in _CURVES:
        return key.kty == "EC" and key.crv == _CURVES[alg]
    return key.kty == "RSA" and alg[:2] in ("RS", "PS")
