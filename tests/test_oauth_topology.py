"""OAuth through the deployed topology (issue 48: "works through nginx and across replicas, no
per-replica state needed to validate"): a real OpenID provider (tests/oidc_harness.py), real
nginx with the shipped generated config, two replicas with state directories of their own (as
on separate machines) and one real redis-server. Every replica is configured alike: the
provider as issuer, the public nginx URL's /mcp as its resource, the same policy file.

A token is checked against the provider's signing keys alone: any replica, even one started
after the token was issued, accepts it; what a replica learns from the other (through Redis)
is where a session lives, never whether a token is good."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp.shared.exceptions import MCPError
from mcp_harness import Servers, free_port, open_client
from oidc_harness import Memory, Provider, claims_of, code_of, running_provider, signed_in
from topology_harness import Topology, replica_server, running_topology

pytestmark = pytest.mark.e2e

POLICY = """
[groups.engineers]
scopes = ["sandbox:execute", "sandbox:files", "snapshots"]

[groups.viewers]
scopes = ["sandbox:files"]
"""
WELL_KNOWN = "/.well-known/oauth-protected-resource"
LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
ACCEPT = {"accept": "application/json, text/event-stream"}


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    with running_provider(tmp_path_factory.mktemp("oidc")) as running:
        yield running


@pytest.fixture(scope="module")
def nginx_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def settings(
    provider: Provider, nginx_port: int, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """What every replica is configured with: their resource is the public URL (nginx's port
    is chosen before they start), not their own."""
    policy = tmp_path_factory.mktemp("policy") / "policy.toml"
    policy.write_text(POLICY)
    return {
        "SANDBOX_OAUTH_ISSUER": provider.issuer,
        "SANDBOX_OAUTH_RESOURCE": f"http://127.0.0.1:{nginx_port}/mcp",
        "SANDBOX_POLICY_FILE": str(policy),
    }


@pytest.fixture(scope="module")
def topology(
    settings: dict[str, str], nginx_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    path = tmp_path_factory.mktemp("topology")
    with running_topology(path, count=2, nginx_port=nginx_port, **settings) as topology:
        yield topology


def public(topology: Topology) -> str:
    return f"http://127.0.0.1:{topology.nginx.port}"


def offsets(topology: Topology) -> dict[str, int]:
    return {rid: server.log_size() for rid, server in topology.replicas.items()}


def answered(topology: Topology, since: dict[str, int], line: str) -> set[str]:
    """The replicas whose access log has `line` (e.g. '"POST /mcp HTTP/1.1" 200') since."""
    return {
        rid
        for rid, server in topology.replicas.items()
        if line in server.log_since(since[rid], max_lines=5000)
    }


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


def test_a_401_through_nginx_names_metadata_reachable_through_nginx(
    topology: Topology, provider: Provider
) -> None:
    """Whichever replica answers, the challenge names the public metadata URL (built from the
    configured resource, not the replica's own address), and nginx serves that document."""
    since = offsets(topology)
    for path, expected in (("/mcp", "/mcp"), ("/s/team/mcp", "/s/team/mcp")):
        for _ in range(len(topology.replicas) * 2):  # (spread over the replicas in turn)
            resp = httpx2.post(public(topology) + path, json=LIST, headers=ACCEPT, timeout=10)
            assert resp.status_code == 401, resp.text
            challenge = resp.headers["www-authenticate"]
            url = f"{public(topology)}{WELL_KNOWN}{expected}"
            assert challenge.startswith(f'Bearer resource_metadata="{url}"'), challenge
            assert "error=" not in challenge, challenge
        document = httpx2.get(url, timeout=10)
        assert document.status_code == 200, document.text
        metadata = document.json()
        assert metadata["resource"] == public(topology) + expected, metadata
        assert metadata["authorization_servers"] == [provider.issuer], metadata
        assert "sandbox:execute" in metadata["scopes_supported"], metadata
    assert answered(topology, since, '"POST /mcp HTTP/1.1" 401') == set(topology.replicas)
    bad = httpx2.post(
        topology.nginx.url,
        json=LIST,
        headers={**ACCEPT, "Authorization": "Bearer not-a-token"},
        timeout=10,
    )
    assert bad.status_code == 401, bad.text
    assert 'error="invalid_token"' in bad.headers["www-authenticate"], bad.headers


async def test_sdk_signs_in_through_nginx_and_any_replica_validates_the_token_alone(
    topology: Topology, provider: Provider, settings: dict[str, str], tmp_path: Path
) -> None:
    since = offsets(topology)
    session = f"sdk-{uuid.uuid4().hex[:6]}"
    async with signed_in(topology.nginx.url, provider, "alice") as (conn, storage, sent_to):
        for i in range(4):
            out = await conn.ok("execute_code", command=f"echo call{i}", session=session)
            assert stdout_of(out) == f"call{i}\n", out
    # The SDK found the provider through nginx and asked for a token for the public URL.
    assert len(sent_to) == 1 and sent_to[0].startswith(provider.issuer + "/auth?"), sent_to
    assert code_of(sent_to[0])["resource"] == topology.nginx.url, sent_to
    assert storage.tokens is not None
    token = storage.tokens.access_token
    assert claims_of(token)["aud"] == topology.nginx.url, claims_of(token)
    # nginx spread the SDK's requests: both replicas validated the token and answered.
    assert answered(topology, since, '"POST /mcp HTTP/1.1" 200') == set(topology.replicas)

    # A replica started after the token was issued, with a state directory of its own that
    # never saw it, accepts it at once and runs the call itself.
    rid = f"fresh{uuid.uuid4().hex[:4]}"
    with Servers(lambda name: tmp_path / name, release=True) as servers:
        fresh = servers.add(replica_server(tmp_path, topology.redis, rid, **settings))
        async with open_client(fresh.url, token, "auto") as direct:
            out = await direct.ok("execute_code", command="echo fresh", session=f"f-{rid}")
        assert stdout_of(out) == "fresh\n", out
        assert topology.replica_of(out["execution_id"]) == rid
        assert "principal=alice" in fresh.log_since(0, max_lines=5000)


async def test_an_oauth_session_keeps_working_when_its_calls_reach_the_other_replica(
    topology: Topology, provider: Provider
) -> None:
    """alice's named session, made through nginx, lives on one replica; her calls that nginx
    (or she) sends to the other are forwarded there as hers: the same workspace. carol's
    session of the same name through that other replica is hers alone."""
    session = f"kept-{uuid.uuid4().hex[:6]}"
    async with signed_in(topology.nginx.url, provider, "alice") as (alice, storage, _):
        made = await alice.ok("execute_code", command="echo kept > note", session=session)
        home = topology.replica_of(made["execution_id"])
        (other,) = set(topology.replicas) - {home}
        forwarded = topology.metric(other, "srt_forwarded_calls_total")
        for _ in range(4):
            out = await alice.ok("execute_code", command="cat note", session=session)
            assert stdout_of(out) == "kept\n", out
            assert topology.replica_of(out["execution_id"]) == home
        assert topology.metric(other, "srt_forwarded_calls_total") > forwarded, (
            "nginx sent none of the session's calls to the other replica"
        )
        assert storage.tokens is not None
        token = storage.tokens.access_token
    async with open_client(topology.replicas[other].url, token, "auto") as direct:
        out = await direct.ok("execute_code", command="cat note", session=session)
        assert stdout_of(out) == "kept\n" and topology.replica_of(out["execution_id"]) == home
    carol = provider.mint(sub="carol", aud=topology.nginx.url)
    async with open_client(topology.replicas[other].url, carol, "auto") as theirs:
        out = await theirs.ok("execute_code", command="cat note || echo none", session=session)
        assert stdout_of(out) == "none\n", "carol's session is not alice's"


async def test_a_viewer_gets_403_insufficient_scope_through_nginx_with_the_challenge(
    topology: Topology, provider: Provider
) -> None:
    bob = provider.mint(sub="bob", groups=["viewers"], aud=topology.nginx.url)
    since = offsets(topology)
    call = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "execute_code", "arguments": {"command": "echo no"}},
    }
    headers = {**ACCEPT, "Authorization": f"Bearer {bob}"}
    for path in ("/mcp", "/mcp", "/s/bob/mcp", "/s/bob/mcp"):
        resp = httpx2.post(public(topology) + path, json=call, headers=headers, timeout=10)
        assert resp.status_code == 403, resp.text
        challenge = resp.headers["www-authenticate"]
        url = f"{public(topology)}{WELL_KNOWN}{path}"
        assert challenge.startswith('Bearer error="insufficient_scope", scope="sandbox:execute"')
        assert f'resource_metadata="{url}"' in challenge and "error_description=" in challenge
        error = resp.json()["error"]
        assert error["data"] == {"scope": "sandbox:execute"} and resp.json()["id"] == 7, error
    assert answered(topology, since, '"POST /mcp HTTP/1.1" 403') == set(topology.replicas)
    # The official client at a session's endpoint through nginx: what a viewer may do works;
    # execute_code's 403 sends it to sign in again for the scope (step-up), and the policy
    # still refuses, in words. Restarted with its stored tokens, the client has no metadata
    # yet: on the 403 it reads the one the challenge names, and goes on only if that names
    # this endpoint (RFC 9728 §3.3). The refused calls ran nowhere.
    endpoint = f"{public(topology)}/s/bob-{uuid.uuid4().hex[:6]}/mcp"
    kept = Memory()
    for restarted in (False, True):
        async with signed_in(endpoint, provider, "bob", storage=kept) as (viewer, _, to):
            assert await viewer.ok("write_file", path="b.txt", content="viewer")
            with pytest.raises(MCPError) as refused:
                await viewer.call("execute_code", command="echo no")
        text = str(refused.value)
        assert "sandbox:execute" in text and "insufficient scope" in text, text
        assert len(to) == (1 if restarted else 2), to
        assert code_of(to[-1])["resource"] == endpoint, to
        assert "sandbox:execute" in code_of(to[-1])["scope"].split(), to
    for server in topology.replicas.values():
        assert "execution started principal=bob" not in server.log_since(0, max_lines=10000)
