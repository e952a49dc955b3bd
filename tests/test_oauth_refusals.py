"""Access tokens the server must refuse, each with the MCP authorization spec's answer (401,
`WWW-Authenticate: Bearer error="invalid_token"` with the resource metadata's URL), and the
ones it must take: a real OpenID provider (tests/oidc_harness.py) signs them, or a key it never
published, or none at all. A caller whose groups do not give the scope a tool needs gets 403
insufficient_scope naming it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import ServerProcess, Servers, open_client
from oidc_harness import (
    INTROSPECTOR_ID,
    INTROSPECTOR_SECRET,
    MACHINE,
    OPAQUE,
    Provider,
    running_provider,
)

pytestmark = pytest.mark.e2e

POLICY = """
[groups.engineers]
scopes = ["sandbox:execute", "sandbox:files", "snapshots"]

[groups.viewers]
scopes = ["sandbox:files"]
"""
CALL = {
    "jsonrpc": "2.0",
    "id": 7,
    "method": "tools/call",
    "params": {"name": "execute_code", "arguments": {"command": "echo ran"}},
}


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    with running_provider(tmp_path_factory.mktemp("oidc")) as running:
        yield running


def oauth_server(serve: Servers, workdir: Path, provider: Provider) -> ServerProcess:
    """A server whose resource is its own /mcp URL, trusting `provider` (JWTs and, through
    introspection, opaque tokens), with POLICY."""
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.toml"
    policy.write_text(POLICY)
    server = ServerProcess(workdir)
    server.settings.update(
        SANDBOX_OAUTH_ISSUER=provider.issuer,
        SANDBOX_OAUTH_RESOURCE=server.url,
        SANDBOX_OAUTH_INTROSPECTION_CLIENT_ID=INTROSPECTOR_ID,
        SANDBOX_OAUTH_INTROSPECTION_CLIENT_SECRET=INTROSPECTOR_SECRET,
        SANDBOX_POLICY_FILE=str(policy),
    )
    return serve.add(server)


@pytest.fixture(scope="module")
def server(
    serve: Servers, provider: Provider, tmp_path_factory: pytest.TempPathFactory
) -> ServerProcess:
    return oauth_server(serve, tmp_path_factory.mktemp("oauth-refusals"), provider)


def post(server: ServerProcess, token: str, body: dict[str, Any] | None = None) -> httpx2.Response:
    """One tools/call with `token`, over plain HTTP (the 2026-07-28 era: no initialize)."""
    headers = {
        "authorization": f"Bearer {token}",
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": "2026-07-28",
    }
    return httpx2.post(server.url, json=body or CALL, headers=headers, timeout=30)


def refused(server: ServerProcess, token: str, why: str) -> str:
    """Assert `token` gets the spec's 401 invalid_token; the error_description."""
    resp = post(server, token)
    assert resp.status_code == 401, f"{why}: {resp.status_code} {resp.text[:500]}"
    challenge = resp.headers.get("www-authenticate", "")
    assert challenge.startswith("Bearer ") and 'error="invalid_token"' in challenge, challenge
    metadata = f"{server.base_url}/.well-known/oauth-protected-resource/mcp"
    assert f'resource_metadata="{metadata}"' in challenge, challenge
    assert token not in challenge and token not in resp.text, "the token is never echoed"
    return challenge


async def accepted(server: ServerProcess, token: str) -> None:
    """`token` works with the official client: a command runs."""
    async with open_client(server.url, token, "auto") as conn:
        result = await conn.ok("execute_code", command="echo ran")
        assert "ran" in str(result["output"]), result


async def test_a_token_from_the_provider_is_accepted(
    server: ServerProcess, provider: Provider
) -> None:
    await accepted(server, provider.mint(aud=server.url))
    await accepted(server, provider.client_credentials(MACHINE, server.url))


@pytest.mark.parametrize(
    ("case", "claims", "key", "says"),
    [
        ("wrong audience", {"aud": "http://127.0.0.1:1/mcp"}, "current", "audience"),
        ("no audience", {"aud": None}, "current", "audience"),
        ("expired", {"exp": -3600, "iat": -7200}, "current", "expired"),
        ("not yet valid", {"nbf": 3600}, "current", "not valid yet"),
        ("unknown key", {}, "unknown", "key"),
        ("alg none", {}, "none", "algorithm"),
        ("other issuer", {"iss": "http://127.0.0.1:1"}, "current", "issuer"),
    ],
)
def test_bad_tokens_are_refused_with_invalid_token(
    server: ServerProcess,
    provider: Provider,
    case: str,
    claims: dict[str, Any],
    key: str,
    says: str,
) -> None:
    now = int(time.time())
    claims = {"aud": server.url, **claims}
    for name in ("exp", "iat", "nbf"):  # (relative to now)
        if name in claims:
            claims[name] += now
    challenge = refused(server, provider.mint(key=key, **claims), case)
    assert says in challenge.split("error_description=", 1)[-1], (case, challenge)


def test_a_tampered_token_is_refused(server: ServerProcess, provider: Provider) -> None:
    head, payload, signature = provider.mint(aud=server.url).split(".")
    other = provider.mint(aud=server.url, sub="root").split(".")[1]
    refused(server, f"{head}.{other}.{signature}", "another payload under alice's signature")
    refused(server, f"{head}.{payload}.{signature[:-6]}AAAAAA", "a broken signature")


async def test_a_rotated_key_is_accepted_after_the_jwks_refresh(
    serve: Servers, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # (a provider and a server of their own: an unknown key id refreshes the keys at most
    # every 10 s, and the other tests' unknown key may just have; and the module's provider
    # keeps its one key for the other tests' tokens)
    with running_provider(tmp_path_factory.mktemp("oidc-rotation")) as provider:
        server = oauth_server(serve, tmp_path_factory.mktemp("oauth-rotation"), provider)
        before = provider.mint(aud=server.url)
        await accepted(server, before)  # (the server now holds the provider's keys)
        kid = provider.rotate()
        after = provider.client_credentials(MACHINE, server.url)
        assert f'"kid":"{kid}"' in _header(after), "the provider signs with the new key"
        await accepted(server, after)
        await accepted(server, before)  # (the old key is still published: still good)
        server.close()  # (before its provider goes)


def _header(token: str) -> str:
    import base64

    part = token.split(".")[0]
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode()


async def test_opaque_tokens_by_introspection_and_a_revoked_one_is_refused(
    server: ServerProcess, provider: Provider
) -> None:
    good = provider.client_credentials(OPAQUE, server.url)
    assert good.count(".") == 0, "an opaque token"
    await accepted(server, good)
    revoked = provider.client_credentials(OPAQUE, server.url)
    assert provider.introspect(revoked)["active"] is True
    provider.revoke(revoked, OPAQUE)
    assert provider.introspect(revoked) == {"active": False}
    challenge = refused(server, revoked, "a revoked token")
    assert "not active" in challenge, challenge
    refused(server, "not-a-token-the-provider-issued", "an unknown opaque token")


async def test_a_principal_without_the_scope_is_refused_with_the_scope_named(
    server: ServerProcess, provider: Provider
) -> None:
    bob = provider.mint(aud=server.url, sub="bob", groups=["viewers"])
    resp = post(server, bob)
    assert resp.status_code == 403, resp.text
    challenge = resp.headers["www-authenticate"]
    assert 'error="insufficient_scope"' in challenge, challenge
    assert 'scope="sandbox:execute"' in challenge, challenge
    metadata = f"{server.base_url}/.well-known/oauth-protected-resource/mcp"
    assert f'resource_metadata="{metadata}"' in challenge, challenge
    error = resp.json()["error"]
    assert "sandbox:execute" in error["message"] and "engineers" in error["message"], error
    # What the viewer may do still works: the files tools, with the same token.
    async with open_client(server.url, bob, "auto") as conn:
        written = await conn.ok("write_file", path="note.txt", content="hello")
        assert written, written
