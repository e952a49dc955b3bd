"""Hostile tokens and a hostile (or sloppy) issuer, against the verifier and an issuer served
over real HTTP: what an adversarial review of the OAuth work found."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from issuer_harness import Issuer, new_key, serve_issuer

from sandbox_runtime.oauth.issuers import Issuers
from sandbox_runtime.oauth.metadata import ResourceMetadata
from sandbox_runtime.oauth.verifier import OAuthVerifier, TokenRefusedError

# (unit but the two trickle tests, which wait out the verifier's timeouts: integration)

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


@pytest.mark.unit
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


@pytest.mark.unit
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


@contextlib.contextmanager
def trickling_issuer(jwks: bool = True) -> Iterator[str]:
    """An issuer whose metadata is fine and whose introspection answers (and JWKS, with
    `jwks`) come a byte every 0.2 s, without end."""
    stop = threading.Event()
    served: dict[str, str] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/.well-known/openid-configuration":
                url = served["url"]
                body = json.dumps(
                    {"issuer": url, "jwks_uri": url + "/jwks", "introspection_endpoint": url}
                )
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())
                return
            if not jwks:
                self.send_response(200)
                self.send_header("content-length", "12")
                self.end_headers()
                self.wfile.write(b'{"keys": []}')
                return
            self.trickle()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.trickle()

        def trickle(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"keys": [')
            with contextlib.suppress(OSError):
                while not stop.wait(0.2):
                    self.wfile.write(b" ")
                    self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    served["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served["url"]
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.integration
async def test_a_jwks_that_trickles_is_given_up_within_the_timeout() -> None:
    """An issuer (or what sits before it) that sends its JWKS a few bytes at a time: each read
    comes within the read timeout, the whole never. The fetch holds the issuer's lock, which
    every request waits for once the keys are stale: it must end within the timeout."""
    with trickling_issuer() as url:
        metadata = ResourceMetadata(RESOURCE, [url], [])
        verifier = OAuthVerifier(Issuers([url], cache_seconds=300, timeout=1.0), metadata)
        issuer = Issuer(url=url, keys=[new_key()])
        try:
            started = time.monotonic()
            reason = await refused(verifier, issuer.token(audience=RESOURCE))
            took = time.monotonic() - started
            assert "cannot be fetched" in reason and took < 5, (took, reason)
        finally:
            await verifier.aclose()


@pytest.mark.integration
async def test_an_introspection_answer_that_trickles_is_given_up() -> None:
    with trickling_issuer(jwks=False) as url:
        metadata = ResourceMetadata(RESOURCE, [url], [])
        verifier = OAuthVerifier(
            Issuers([url], cache_seconds=300, timeout=1.0),
            metadata,
            introspection=("rs", "secret"),
        )
        try:
            started = time.monotonic()
            reason = await refused(verifier, "opaque-token")
            took = time.monotonic() - started
            assert "did not answer" in reason and took < 15, (took, reason)
        finally:
            await verifier.aclose()


@pytest.mark.unit
async def test_an_introspection_answer_without_an_audience_is_refused(issuer: Issuer) -> None:
    """The token must be for this server (MCP: no token passthrough): an answer that names no
    audience could be for any API of the provider, as a JWT without `aud` is refused."""
    verifier = make_verifier(issuer, introspection=True)
    try:
        assert "audience" in await refused(verifier, issuer.opaque_token(sub="bob"))
        other = issuer.opaque_token(sub="bob", aud=["https://other.example.com", RESOURCE])
        assert (await verifier.verify(other)).principal == "bob"
    finally:
        await verifier.aclose()
