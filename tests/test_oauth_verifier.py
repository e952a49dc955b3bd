"""The resource server's token checks, against an issuer served over real HTTP with keys made
here: each kind of bad token is refused with its reason, good ones name their caller, keys
rotate, and unknown key ids cannot make us hammer the issuer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from issuer_harness import Issuer, new_key, serve_issuer, unsigned

from sandbox_runtime.domain.identity import IDENTITY_CLAIM, Identity
from sandbox_runtime.oauth import issuers as issuers_module
from sandbox_runtime.oauth.issuers import Issuers
from sandbox_runtime.oauth.metadata import ResourceMetadata
from sandbox_runtime.oauth.policy import parse_policy
from sandbox_runtime.oauth.verifier import OAuthVerifier, TokenRefusedError, Verified
from sandbox_runtime.server.auth import CallerVerifier

pytestmark = pytest.mark.unit

RESOURCE = "https://sandbox.example.com/mcp"


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    with serve_issuer() as served:
        yield served


def make_verifier(issuer: Issuer, introspection: bool = False, **kw: str) -> OAuthVerifier:
    metadata = ResourceMetadata(RESOURCE, [issuer.url], ["api://sandbox"])
    return OAuthVerifier(
        Issuers([issuer.url], cache_seconds=300),
        metadata,
        introspection=issuer.client if introspection else None,
        **kw,
    )


@pytest.fixture
async def verifier(issuer: Issuer) -> AsyncIterator[OAuthVerifier]:
    made = make_verifier(issuer)
    try:
        yield made
    finally:
        await made.aclose()


async def refused(verifier: OAuthVerifier, token: str) -> str:
    with pytest.raises(TokenRefusedError) as caught:
        await verifier.verify(token)
    return str(caught.value)


async def test_a_good_token_names_its_caller(issuer: Issuer, verifier: OAuthVerifier) -> None:
    token = issuer.token(
        audience=RESOURCE, groups=["devs", "ops"], jti="t-1", client_id="inspector", scope="a b"
    )
    found = await verifier.verify(token)
    assert found == Verified(
        principal="alice",
        token_id="t-1",
        kind="jwt",
        issuer=issuer.url,
        client_id="inspector",
        groups=("devs", "ops"),
        token_scopes=("a", "b"),
        expires_at=found.expires_at,
    )


@pytest.mark.parametrize("alg", ["RS256", "PS256", "ES256", "EdDSA"])
async def test_each_asymmetric_algorithm_is_accepted(issuer: Issuer, alg: str) -> None:
    issuer.keys = [new_key(alg)]
    verifier = make_verifier(issuer)
    try:
        assert (await verifier.verify(issuer.token(audience=RESOURCE))).principal == "alice"
    finally:
        await verifier.aclose()


@pytest.mark.parametrize(
    "audience",
    [
        RESOURCE,
        [RESOURCE, "other"],
        "api://sandbox",
        RESOURCE + "/",
        "https://sandbox.example.com/servers/time/mcp",
        "https://sandbox.example.com/s/build-1/mcp",
    ],
)
async def test_audiences_naming_this_server_are_accepted(
    issuer: Issuer, verifier: OAuthVerifier, audience: object
) -> None:
    assert (await verifier.verify(issuer.token(audience=audience))).principal == "alice"


@pytest.mark.parametrize(
    "audience",
    [None, "https://other.example.com/mcp", "https://sandbox.example.com/admin", ["x", "y"]],
)
async def test_a_token_for_another_audience_is_refused(
    issuer: Issuer, verifier: OAuthVerifier, audience: object
) -> None:
    reason = await refused(verifier, issuer.token(audience=audience))
    assert "audience is not this server" in reason and RESOURCE in reason


async def test_an_expired_token_is_refused(issuer: Issuer, verifier: OAuthVerifier) -> None:
    assert await refused(verifier, issuer.token(audience=RESOURCE, lifetime=-120)) == (
        "the token has expired"
    )


async def test_a_token_expired_within_the_leeway_is_accepted(
    issuer: Issuer, verifier: OAuthVerifier
) -> None:
    assert await verifier.verify(issuer.token(audience=RESOURCE, lifetime=-5))


async def test_a_token_not_yet_valid_is_refused(issuer: Issuer, verifier: OAuthVerifier) -> None:
    token = issuer.token(audience=RESOURCE, nbf=int(time.time()) + 600)
    assert "not valid yet" in await refused(verifier, token)


async def test_a_token_without_expiry_is_refused(issuer: Issuer, verifier: OAuthVerifier) -> None:
    token = issuer.token(audience=RESOURCE, exp=None)
    assert "'exp'" in await refused(verifier, token)


async def test_another_issuer_is_refused(issuer: Issuer, verifier: OAuthVerifier) -> None:
    token = issuer.token(audience=RESOURCE, iss="https://evil.example.com")
    assert "not one this server trusts" in await refused(verifier, token)


async def test_a_key_the_issuer_does_not_publish_is_refused(
    issuer: Issuer, verifier: OAuthVerifier
) -> None:
    stranger = new_key("RS256", kid=issuer.keys[0].kid)  # (same kid, another key)
    assert "signature does not verify" in await refused(
        verifier, issuer.token(key=stranger, audience=RESOURCE)
    )
    unknown = new_key("RS256")
    assert "does not publish" in await refused(
        verifier, issuer.token(key=unknown, audience=RESOURCE)
    )


async def test_alg_none_is_refused(issuer: Issuer, verifier: OAuthVerifier) -> None:
    now = int(time.time())
    claims = {"iss": issuer.url, "sub": "alice", "aud": RESOURCE, "exp": now + 300}
    token = unsigned(claims, {"alg": "none", "kid": issuer.keys[0].kid, "typ": "JWT"})
    assert "'none' is not accepted" in await refused(verifier, token)


async def test_hs256_signed_with_the_public_key_is_refused(
    issuer: Issuer, verifier: OAuthVerifier
) -> None:
    """The classic confusion: the issuer's public key (which anyone has) used as an HMAC
    secret."""
    public = issuer.keys[0].private.public_key()
    pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    now = int(time.time())
    claims = {"iss": issuer.url, "sub": "alice", "aud": RESOURCE, "exp": now + 300}
    header = {"kid": issuer.keys[0].kid}
    # (PyJWT refuses to sign with a PEM as an HMAC secret; do what an attacker would)
    import base64
    import hashlib
    import hmac
    import json

    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    signing_input = f"{part({'alg': 'HS256', 'typ': 'JWT', **header})}.{part(claims)}"
    mac = hmac.new(pem, signing_input.encode(), hashlib.sha256).digest()
    token = signing_input + "." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    assert "'HS256' is not accepted" in await refused(verifier, token)


async def test_a_key_of_another_type_than_the_algorithm_is_refused(
    issuer: Issuer, verifier: OAuthVerifier
) -> None:
    """A token saying ES256 but naming the issuer's RSA key finds no key that fits."""
    ec_key = new_key("ES256", kid=issuer.keys[0].kid)
    assert "does not publish" in await refused(
        verifier, issuer.token(key=ec_key, audience=RESOURCE)
    )


async def test_a_rotated_key_is_accepted_after_one_refresh(issuer: Issuer) -> None:
    verifier = make_verifier(issuer)
    try:
        await verifier.verify(issuer.token(audience=RESOURCE))
        assert issuer.jwks_fetches == 1
        rotated = new_key("RS256")
        issuer.keys = [rotated, *issuer.keys]  # the provider publishes its next key
        assert (await verifier.verify(issuer.token(key=rotated, audience=RESOURCE))).principal
        assert issuer.jwks_fetches == 2
        issuer.keys = [rotated]  # ... and drops the old one
        await verifier.verify(issuer.token(key=rotated, audience=RESOURCE))
        assert issuer.jwks_fetches == 2  # (known keys need no fetch)
    finally:
        await verifier.aclose()


async def test_unknown_key_ids_refresh_at_most_once_per_interval(
    issuer: Issuer, monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier = make_verifier(issuer)
    try:
        await verifier.verify(issuer.token(audience=RESOURCE))
        for _ in range(20):
            await refused(verifier, issuer.token(key=new_key("RS256"), audience=RESOURCE))
        assert issuer.jwks_fetches == 2  # one refresh for twenty made-up key ids
        # A key rotated in right after that refresh waits for the interval, then is found.
        rotated = new_key("RS256")
        issuer.keys.append(rotated)
        assert "does not publish" in await refused(
            verifier, issuer.token(key=rotated, audience=RESOURCE)
        )
        monkeypatch.setattr(issuers_module, "REFRESH_EVERY", 0.0)
        assert await verifier.verify(issuer.token(key=rotated, audience=RESOURCE))
        assert issuer.jwks_fetches == 3
    finally:
        await verifier.aclose()


async def test_a_missing_principal_claim_is_refused(issuer: Issuer) -> None:
    verifier = make_verifier(issuer, principal_claim="email")
    try:
        assert "'email'" in await refused(verifier, issuer.token(audience=RESOURCE))
        token = issuer.token(audience=RESOURCE, email="alice@example.com")
        assert (await verifier.verify(token)).principal == "alice@example.com"
    finally:
        await verifier.aclose()


async def test_opaque_tokens_are_introspected_and_a_revoked_one_is_refused(
    issuer: Issuer,
) -> None:
    verifier = make_verifier(issuer, introspection=True)
    try:
        token = issuer.opaque_token(sub="bob", aud=RESOURCE, groups=["ops"], client_id="cli")
        found = await verifier.verify(token)
        assert (found.principal, found.kind, found.groups) == ("bob", "introspected", ("ops",))
        await verifier.verify(token)
        assert issuer.introspections == 1  # (an active answer is kept a few seconds)
        revoked = issuer.opaque_token(sub="carol", aud=RESOURCE)
        await verifier.verify(revoked)
        issuer.revoked.add(revoked)
        verifier._introspected.clear()  # (as after the few seconds)
        assert "not active" in await refused(verifier, revoked)
        wrong = issuer.opaque_token(sub="dave", aud="https://other.example.com/mcp")
        assert "audience" in await refused(verifier, wrong)
        assert "not active" in await refused(verifier, "opaque-unknown")
    finally:
        await verifier.aclose()


async def test_opaque_tokens_without_introspection_are_refused_saying_so(
    verifier: OAuthVerifier,
) -> None:
    assert "SANDBOX_OAUTH_INTROSPECTION_CLIENT_ID" in await refused(verifier, "opaque-xyz")


async def test_an_unreachable_issuer_is_a_refusal_not_a_crash() -> None:
    with serve_issuer() as issuer:
        url = issuer.url
        token = issuer.token(audience=RESOURCE)
    verifier = OAuthVerifier(
        Issuers([url], cache_seconds=300), ResourceMetadata(RESOURCE, [url], [])
    )
    try:
        assert "cannot be fetched" in await refused(verifier, token)
    finally:
        await verifier.aclose()


POLICY = """
[default]
scopes = ["sandbox:files"]

[groups.devs]
scopes = ["sandbox:execute", "servers:*"]

[principals.ci]
groups = ["devs"]
scopes = ["snapshots"]
"""


async def test_the_caller_gets_the_policy_scopes_and_a_static_principal_name_is_kept(
    issuer: Issuer, verifier: OAuthVerifier
) -> None:
    caller = CallerVerifier({"static-token-1": "ci"}, verifier, parse_policy(POLICY))
    static = await caller.verify_token("static-token-1")
    assert static is not None and static.client_id == "ci"
    identity = static.claims[IDENTITY_CLAIM]
    assert isinstance(identity, Identity) and identity.kind == "static"
    assert identity.scopes == {"sandbox:files", "sandbox:execute", "servers:*", "snapshots"}
    assert identity.allows("servers:time") and identity.token_id.startswith("st-")

    dev = await caller.verify_token(issuer.token(audience=RESOURCE, sub="ann", groups=["devs"]))
    assert dev is not None and dev.client_id == "ann"
    assert dev.claims[IDENTITY_CLAIM].scopes == {"sandbox:files", "sandbox:execute", "servers:*"}

    other = await caller.verify_token(issuer.token(audience=RESOURCE, sub="bo"))
    assert other is not None and other.claims[IDENTITY_CLAIM].scopes == {"sandbox:files"}

    # A token that names some of our scopes is held to them (the client asked for less).
    narrow = await caller.verify_token(
        issuer.token(audience=RESOURCE, sub="ann", groups=["devs"], scope="openid sandbox:execute")
    )
    assert narrow is not None and narrow.claims[IDENTITY_CLAIM].scopes == {"sandbox:execute"}

    # A signed-in user named like a static token's principal never becomes it.
    assert await caller.verify_token(issuer.token(audience=RESOURCE, sub="ci")) is None


async def test_without_a_policy_every_caller_has_every_scope(
    issuer: Issuer, verifier: OAuthVerifier
) -> None:
    caller = CallerVerifier({}, verifier, None)
    found = await caller.verify_token(issuer.token(audience=RESOURCE))
    assert found is not None and found.claims[IDENTITY_CLAIM].scopes is None
    assert jwt.get_unverified_header(issuer.token())["kid"] == issuer.keys[0].kid


async def test_known_keys_outlive_an_issuer_that_went_away(monkeypatch: pytest.MonkeyPatch) -> None:
    with serve_issuer() as issuer:
        verifier = OAuthVerifier(
            Issuers([issuer.url], cache_seconds=10), ResourceMetadata(RESOURCE, [issuer.url], [])
        )
        token = issuer.token(audience=RESOURCE)
        await verifier.verify(token)
    try:
        # (the cache ran out, as if ten seconds had passed)
        found = verifier.issuers.find(issuer.url)
        assert found is not None
        found.fetched_at -= 60
        fresh = issuer.token(audience=RESOURCE, sub="ann")  # (not one verified before)
        assert (await verifier.verify(fresh)).principal == "ann"
        found.forced_at -= 60  # (and the last forced refresh is long past)
        stranger = issuer.token(key=new_key("RS256"), audience=RESOURCE)
        assert "cannot be fetched" in await refused(verifier, stranger)
    finally:
        await verifier.aclose()
