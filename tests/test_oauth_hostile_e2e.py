"""The E2B API (SANDBOX_E2B=true) on a server whose people sign in with OAuth: its API keys
are the static tokens only, and a key's principal needs the policy's `sandbox:execute` there
as on /mcp (an E2B sandbox runs code). Found by an adversarial review of the OAuth work."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest
from issuer_harness import Issuer, serve_issuer
from mcp_harness import ServerProcess, Servers, free_port

pytestmark = pytest.mark.e2e

FULL = "e2b_" + "f1" * 20
LIMITED = "e2b_" + "c3" * 20
POLICY = """
[default]
scopes = ["snapshots"]

[principals.builder]
scopes = ["sandbox:execute"]
"""


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    with serve_issuer() as served:
        yield served


def oauth_server(serve: Servers, issuer: Issuer, name: str, **settings: str) -> ServerProcess:
    port = free_port()
    workdir = serve.workdirs(name)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "policy.toml").write_text(POLICY)
    base = {
        "SANDBOX_E2B": "true",
        "SANDBOX_OAUTH_ISSUER": issuer.url,
        "SANDBOX_OAUTH_RESOURCE": f"http://127.0.0.1:{port}/mcp",
        "SANDBOX_POLICY_FILE": str(workdir / "policy.toml"),
    }
    return serve.add(ServerProcess(workdir, {**base, **settings}, port=port))


def create(server: ServerProcess, key: str) -> httpx2.Response:
    return httpx2.post(
        f"{server.base_url}/e2b/v2/sandboxes",
        json={"templateID": "base"},
        headers={"X-API-KEY": key},
        timeout=60,
    )


def test_an_oauth_only_server_takes_no_made_up_e2b_key(serve: Servers, issuer: Issuer) -> None:
    """No static token configured, people sign in with OAuth: the E2B API must not be open
    (it was: any X-API-KEY was principal `default`, and ran code)."""
    server = oauth_server(serve, issuer, "oauth-only")
    made_up = create(server, "e2b_" + "00" * 20)
    assert made_up.status_code == 401, made_up.text
    assert "SANDBOX_AUTH_TOKENS" in made_up.text
    # (an OAuth access token is not an E2B key either)
    token = issuer.token(audience=f"{server.base_url}/mcp", groups=["devs"])
    assert create(server, token).status_code == 401


def test_an_e2b_key_needs_the_execute_scope(serve: Servers, issuer: Issuer) -> None:
    server = oauth_server(
        serve, issuer, "scoped", SANDBOX_AUTH_TOKENS=f"builder:{FULL},reader:{LIMITED}"
    )
    limited = create(server, LIMITED)
    assert limited.status_code == 403, limited.text
    assert "sandbox:execute" in limited.text and "'reader'" in limited.text
    full = create(server, FULL)
    assert full.status_code == 201, full.text
    killed = httpx2.delete(
        f"{server.base_url}/e2b/sandboxes/{full.json()['sandboxID']}",
        headers={"X-API-KEY": FULL},
        timeout=60,
    )
    assert killed.status_code == 204, killed.text
