"""A small authorization server for the resource server's tests: its metadata, its JWKS and
an introspection endpoint, served over real HTTP from a thread; it signs tokens with keys the
test makes (and rotates). The real OpenID provider's tests use `oidc-provider` instead."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm


@dataclass
class SigningKey:
    kid: str
    alg: str
    private: Any

    def public_jwk(self) -> dict[str, Any]:
        public = self.private.public_key()
        if self.alg.startswith(("RS", "PS")):
            jwk = RSAAlgorithm.to_jwk(public, as_dict=True)
        elif self.alg.startswith("ES"):
            jwk = ECAlgorithm.to_jwk(public, as_dict=True)
        else:
            jwk = OKPAlgorithm.to_jwk(public, as_dict=True)
        return {**jwk, "kid": self.kid, "use": "sig", "alg": self.alg}


def new_key(alg: str = "RS256", kid: str | None = None) -> SigningKey:
    if alg.startswith(("RS", "PS")):
        private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    elif alg == "ES256":
        private = ec.generate_private_key(ec.SECP256R1())
    else:
        private = ed25519.Ed25519PrivateKey.generate()
    return SigningKey(kid or f"k-{uuid.uuid4().hex[:8]}", alg, private)


@dataclass
class Issuer:
    """The issuer's state; change `keys` to rotate, `revoked` to revoke opaque tokens."""

    url: str = ""
    keys: list[SigningKey] = field(default_factory=list)
    opaque: dict[str, dict[str, Any]] = field(default_factory=dict)  # token -> introspection
    revoked: set[str] = field(default_factory=set)
    jwks_fetches: int = 0
    introspections: int = 0
    client: tuple[str, str] = ("rs-client", "rs-secret")

    def token(
        self,
        key: SigningKey | None = None,
        audience: Any = "",
        lifetime: float = 300,
        headers: dict[str, Any] | None = None,
        **claims: Any,
    ) -> str:
        key = key or self.keys[0]
        now = int(time.time())
        body = {"iss": self.url, "sub": "alice", "iat": now, "exp": now + int(lifetime)}
        if audience:
            body["aud"] = audience
        body.update(claims)
        body = {k: v for k, v in body.items() if v is not None}
        return jwt.encode(
            body, key.private, algorithm=key.alg, headers={"kid": key.kid, **(headers or {})}
        )

    def opaque_token(self, **answer: Any) -> str:
        token = "opaque-" + uuid.uuid4().hex
        self.opaque[token] = {"active": True, "iss": self.url, **answer}
        return token


def unsigned(claims: dict[str, Any], header: dict[str, Any]) -> str:
    """A JWT with the given header and no signature (`alg: none`)."""

    def part(value: dict[str, Any]) -> str:
        raw = json.dumps(value).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    return f"{part(header)}.{part(claims)}."


@contextmanager
def serve_issuer(issuer: Issuer | None = None) -> Iterator[Issuer]:
    """The issuer served on a free loopback port until the block ends."""
    issuer = issuer or Issuer(keys=[new_key()])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/.well-known/openid-configuration":
                self._json(
                    200,
                    {
                        "issuer": issuer.url,
                        "jwks_uri": issuer.url + "/jwks",
                        "introspection_endpoint": issuer.url + "/introspect",
                        "authorization_endpoint": issuer.url + "/auth",
                        "token_endpoint": issuer.url + "/token",
                    },
                )
            elif self.path == "/jwks":
                issuer.jwks_fetches += 1
                self._json(200, {"keys": [k.public_jwk() for k in issuer.keys]})
            else:
                self._json(404, {"error": "not_found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            if self.path != "/introspect":
                self._json(404, {"error": "not_found"})
                return
            basic = base64.b64encode(":".join(issuer.client).encode()).decode()
            if self.headers.get("authorization") != f"Basic {basic}":
                self._json(401, {"error": "invalid_client"})
                return
            issuer.introspections += 1
            token = form.get("token", [""])[0]
            answer = issuer.opaque.get(token)
            if answer is None or token in issuer.revoked:
                self._json(200, {"active": False})
            else:
                self._json(200, answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    issuer.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield issuer
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
