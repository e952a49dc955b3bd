"""The audit log of callers signed in with an identity provider (a real OpenID provider,
tests/oidc_harness.py): their principal, the access token's id (its `jti`, never the token)
and the OAuth client; a call refused for want of a scope at the HTTP edge (403) has its line
too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from mcp_harness import ServerProcess, Servers, eventually, open_client
from oidc_harness import Provider, running_provider

pytestmark = pytest.mark.e2e

POLICY = """
[groups.engineers]
scopes = ["sandbox:execute", "sandbox:files"]

[groups.viewers]
scopes = ["sandbox:files"]
"""
MARKER = "AUDIT-OAUTH-MARKER-51d2"


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    with running_provider(tmp_path_factory.mktemp("oidc")) as running:
        yield running


def lines_of(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_signed_in_callers_are_audited_by_token_id_and_client(
    serve: Servers, provider: Provider, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("audit-oauth")
    (workdir / "policy.toml").write_text(POLICY)
    log = workdir / "audit.log"
    server = ServerProcess(workdir / "server")
    server.settings.update(
        SANDBOX_OAUTH_ISSUER=provider.issuer,
        SANDBOX_OAUTH_RESOURCE=server.url,
        SANDBOX_POLICY_FILE=str(workdir / "policy.toml"),
        SANDBOX_AUDIT_LOG=str(log),
    )
    serve.add(server)
    alice = provider.mint(aud=server.url, jti="alice-token-id-1")
    bob = provider.mint(aud=server.url, sub="bob", groups=["viewers"], jti="bob-token-id-2")
    async with open_client(server.url, alice, "auto") as conn:
        await conn.ok("execute_code", command=f"echo {MARKER}")
    call = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "execute_code", "arguments": {"command": f"echo {MARKER}"}},
    }
    headers = {
        "authorization": f"Bearer {bob}",
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": "2026-07-28",
    }
    refused = httpx2.post(server.url, json=call, headers=headers, timeout=30)
    assert refused.status_code == 403, refused.text

    await eventually(lambda: len(lines_of(log)) >= 2, 10, "two audit lines")
    lines = lines_of(log)
    assert [
        (line["principal"], line["token_id"], line["client_id"], line["tool"], line["outcome"])
        for line in lines
    ] == [
        ("alice", "alice-token-id-1", "srt-minted", "execute_code", "ok"),
        ("bob", "bob-token-id-2", "srt-minted", "execute_code", "scope"),
    ]
    assert lines[1]["argument_bytes"] == {"command": len(f"echo {MARKER}")}
    text = log.read_text()
    for secret in (alice, bob, MARKER, alice.split(".")[2], bob.split(".")[2]):
        assert secret not in text
