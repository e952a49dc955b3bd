"""Hostile tokens and a hostile (or sloppy) issuer, against the verifier and an issuer served
over real HTTP: what an adversarial review of the OAuth work found."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from issuer_harness import Issuer, serve_issuer

from sandbox_runtime.oauth.issuers import Issuers
from sandbox_runtime.oauth.metadata import ResourceMetadata
from sandbox_runtime.oauth.verifier import OAuthVerifier, TokenRefusedError

pytestmark = pytest.mark.unit

RESOURCE = "https://sandbox.example.com/mcp"


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    with serve_issuer() as served:
        yield served


def make_verifier(issuer: Issuer, introspection: bool = False, **kw: str) -> OAuthVerifier:
    metadata = ResourceMetadata(RESOURCE, [issuer.url], [])
    return OAuthVerifier(
        Issuers([issuer.url], cache_seconds=300),
        metadata,
        introspection=issuer.client if introspection else None,
        **kw,
    )


async def refused(verifier: OAuthVerifier, token: str) -> str:
    with pytest.raises(TokenRefusedError) as caught:
        await verifier.verify(token)
    return str(caught.value)


async def test_an_introspection_answer_must_say_active_true(issuer: Issuer) -> None:
    """RFC 7662: `active` is a boolean. A string (`"false"` too) is not `true`."""
    verifier = make_verifier(issuer, introspection=True)
    try:
        for answer in ("false", "true", 1, "yes"):
            token = issuer.opaque_token(sub="bob", aud=RESOURCE, active=answer)
            assert "not active" in await refused(verifier, token)
        good = issuer.opaque_token(sub="bob", aud=RESOURCE)
        assert (await verifier.verify(good)).principal == "bob"
    finally:
        await verifier.aclose()


@pytest.mark.parametrize(
    "name",
    [
        "alice:s:x",  # (session keys are principal:session: "alice" + session "x:default")
        "alice,bob",
        "evil\nline",
        "tab\there",
        " alice",
        "x" * 300,
    ],
)
async def test_a_principal_name_the_owner_keys_cannot_hold_is_refused(
    issuer: Issuer, name: str
) -> None:
    """A principal names keys (`principal:session` in the cluster store) and log lines: one
    with `:`, `,`, control characters, edge spaces or past 256 characters would collide with
    another's keys or be refused later by the cluster's placement; refused here, saying which
    claim."""
    verifier = make_verifier(issuer, principal_claim="email")
    try:
        reason = await refused(verifier, issuer.token(audience=RESOURCE, email=name))
        assert "'email'" in reason and "SANDBOX_OAUTH_PRINCIPAL_CLAIM" in reason
        fine = issuer.token(audience=RESOURCE, email="alice@example.com")
        assert (await verifier.verify(fine)).principal == "alice@example.com"
    finally:
        await verifier.aclose()
