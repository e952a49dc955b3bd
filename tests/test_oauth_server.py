"""The resource server on a real server process: protected resource metadata, the spec's 401
challenge for missing and bad tokens, OAuth tokens from an issuer served by the test and
static tokens accepted at once, the policy's scopes enforced per tool (403 insufficient_scope
at the edge; a tool error for what the edge cannot read), and two signed-in users apart.
(The real OpenID provider and the SDKs' sign-in flows are tests/test_oauth_e2e*.py's.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from issuer_harness import Issuer, serve_issuer
from mcp.shared.auth import ProtectedResourceMetadata
from mcp.shared.exceptions import MCPError
from mcp_harness import ServerProcess, Servers, free_port, open_client, run_server_once

pytestmark = pytest.mark.e2e

STATIC = "static-token-for-ci"
LEGACY = "2025-11-25"
BOTH = "application/json, text/event-stream"
POLICY = """
[default]
scopes = ["snapshots"]

[groups.devs]
scopes = ["sandbox:execute", "sandbox:files", "servers:*"]

[principals.ci]
scopes = ["sandbox:execute"]
"""


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    with serve_issuer() as served:
        yield served


@pytest.fixture(scope="module")
def server(issuer: Issuer, serve: Servers) -> ServerProcess:
    port = free_port()
    workdir = serve.workdirs("oauth")
    (workdir / "policy.toml").parent.mkdir(parents=True, exist_ok=True)
    (workdir / "policy.toml").write_text(POLICY)
    (workdir / "servers.toml").write_text(
        '[servers.time]\nurl = "http://127.0.0.1:9/mcp"\n\n'
        '[servers.github]\nurl = "http://127.0.0.1:9/mcp"\nrequired_scope = "github:write"\n'
    )
    settings = {
        "SANDBOX_OAUTH_ISSUER": issuer.url,
        "SANDBOX_OAUTH_RESOURCE": f"http://127.0.0.1:{port}/mcp",
        "SANDBOX_AUTH_TOKENS": f"ci:{STATIC}",
        "SANDBOX_POLICY_FILE": str(workdir / "policy.toml"),
        "SANDBOX_SERVERS_FILE": str(workdir / "servers.toml"),
    }
    return serve.add(ServerProcess(workdir, settings, port=port))


def post(server: ServerProcess, body: dict[str, Any], token: str | None, **headers: str) -> Any:
    sent = {"content-type": "application/json", "accept": BOTH, **headers}
    if token is not None:
        sent["authorization"] = f"Bearer {token}"
    return httpx2.post(server.url, json=body, headers=sent, timeout=30)


def challenge(response: Any) -> dict[str, str]:
    """The WWW-Authenticate parameters of a Bearer challenge."""
    value = response.headers["www-authenticate"]
    assert value.startswith("Bearer ")
    params = {}
    for part in value[len("Bearer ") :].split('", '):
        key, _, quoted = part.partition("=")
        params[key.strip()] = quoted.strip('"')
    return params


def initialize(server: ServerProcess, token: str) -> str:
    """A legacy MCP session opened with `token`: its Mcp-Session-Id."""
    body = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": LEGACY,
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }
    response = post(server, body, token)
    assert response.status_code == 200, response.text
    sid = response.headers["mcp-session-id"]
    done = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    post(server, done, token, **{"mcp-session-id": sid, "mcp-protocol-version": LEGACY})
    return str(sid)


def test_the_metadata_names_the_issuer_and_the_scopes(
    server: ServerProcess, issuer: Issuer
) -> None:
    for path in (
        "/.well-known/oauth-protected-resource/mcp",
        "/.well-known/oauth-protected-resource",
    ):
        response = httpx2.get(server.base_url + path, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json() == {
            "resource": server.url,
            "authorization_servers": [issuer.url],
            "scopes_supported": ["sandbox:execute", "sandbox:files", "snapshots"],
            "bearer_methods_supported": ["header"],
            "resource_name": "sandbox_runtime",
        }
        ProtectedResourceMetadata.model_validate(response.json())  # (as the SDK reads it)
        assert response.headers["access-control-allow-origin"] == "*"
    hosted = httpx2.get(
        server.base_url + "/.well-known/oauth-protected-resource/servers/time/mcp", timeout=10
    ).json()
    assert hosted["resource"] == server.base_url + "/servers/time/mcp"
    assert hosted["scopes_supported"] == ["servers:time"]
    missing = httpx2.get(
        server.base_url + "/.well-known/oauth-protected-resource/other", timeout=10
    )
    assert missing.status_code == 404


def test_a_request_without_a_token_gets_the_resource_metadata(server: ServerProcess) -> None:
    response = post(server, {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, None)
    assert response.status_code == 401
    params = challenge(response)
    assert params["resource_metadata"] == (
        server.base_url + "/.well-known/oauth-protected-resource/mcp"
    )
    assert params["scope"] == "sandbox:execute sandbox:files snapshots"
    assert "error" not in params  # (RFC 6750 3.1: no error code when no credentials came)
    hosted = httpx2.post(server.base_url + "/servers/time/mcp", json={}, timeout=10)
    assert hosted.status_code == 401
    assert challenge(hosted)["resource_metadata"].endswith(
        "/.well-known/oauth-protected-resource/servers/time/mcp"
    )


@pytest.mark.parametrize(
    ("claims", "reason"),
    [
        ({"audience": "https://elsewhere.example.com/mcp"}, "audience is not this server"),
        ({"lifetime": -300}, "the token has expired"),
        ({"nbf": 4102444800}, "not valid yet"),
    ],
)
def test_bad_tokens_are_refused_with_the_reason(
    server: ServerProcess, issuer: Issuer, claims: dict[str, Any], reason: str
) -> None:
    claims = {"audience": server.url, **claims}
    token = issuer.token(**claims)
    response = post(server, {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, token)
    assert response.status_code == 401
    params = challenge(response)
    assert params["error"] == "invalid_token"
    assert reason in params["error_description"]
    assert params["resource_metadata"].endswith("/.well-known/oauth-protected-resource/mcp")
    assert reason in response.json()["error"]["message"]
    assert token not in response.text
    hosted = httpx2.post(
        server.base_url + "/servers/time/mcp",
        json={},
        headers={"authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert hosted.status_code == 401
    assert reason in challenge(hosted)["error_description"]
    assert challenge(hosted)["scope"] == "servers:time"


async def test_signed_in_users_and_static_tokens_work_at_once_each_apart(
    server: ServerProcess, issuer: Issuer
) -> None:
    ann = issuer.token(audience=server.url, sub="ann", groups=["devs"])
    ben = issuer.token(audience=server.url, sub="ben", groups=["devs"])
    async with open_client(server.url, ann, mode="auto") as conn:
        done = await conn.ok("execute_code", command="echo from-ann > mine.txt; cat mine.txt")
        assert "from-ann" in json.dumps(done)
    async with open_client(server.url, ben, mode="legacy") as conn:
        listed = await conn.ok("execute_code", command="ls")
        assert "mine.txt" not in json.dumps(listed)  # (ben's workspace is his own)
    async with open_client(server.url, STATIC, mode="auto") as conn:
        assert "ok-ci" in json.dumps(await conn.ok("execute_code", command="echo ok-ci"))


def test_a_call_without_its_scope_is_refused_with_the_scope_named(
    server: ServerProcess, issuer: Issuer
) -> None:
    """cy is signed in but in no group: the default's snapshots only."""
    token = issuer.token(audience=server.url, sub="cy")
    sid = initialize(server, token)
    call = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "execute_code", "arguments": {"command": "echo no"}},
    }
    headers = {"mcp-session-id": sid, "mcp-protocol-version": LEGACY}
    response = post(server, call, token, **headers)
    assert response.status_code == 403, response.text
    params = challenge(response)
    assert params["error"] == "insufficient_scope"
    assert params["scope"] == "sandbox:execute"
    assert params["resource_metadata"].endswith("/.well-known/oauth-protected-resource/mcp")
    error = response.json()
    assert error["id"] == 7 and error["error"]["data"] == {"scope": "sandbox:execute"}
    assert "groups devs" in error["error"]["message"]
    # What the scope allows goes through.
    allowed = {**call, "params": {"name": "list_snapshots", "arguments": {}}}
    assert post(server, allowed, token, **headers).status_code == 200


async def test_a_body_too_large_to_read_at_the_edge_is_refused_by_the_tool_layer(
    server: ServerProcess,
) -> None:
    """ci (a static token) has sandbox:execute only: a big write_file passes the edge's
    peek unread and is refused as a tool error naming the scope."""
    async with open_client(server.url, STATIC, mode="auto") as conn:
        text = await conn.error("write_file", path="big.txt", content="x" * 300_000)
        assert "insufficient scope" in text and "'sandbox:files'" in text
        # (refused by ScopeCheck on the direct tools/call path, server/dispatch.py)
        assert "fixed tools on the direct path" in server.stderr_text()
        with pytest.raises(MCPError, match="'sandbox:files'"):  # (the edge's 403, as shown)
            await conn.call("write_file", path="small.txt", content="x")


async def test_code_mode_needs_the_scope_of_each_server_it_names(
    server: ServerProcess, issuer: Issuer
) -> None:
    async with open_client(server.url, STATIC, mode="auto") as conn:
        text = await conn.error("execute_code", command="true", servers=["time"])
        assert "'servers:time'" in text
        text = await conn.error("execute_code", command="true", servers=["*"])
        assert "'servers:*'" in text


def test_a_hosted_server_needs_its_scope(server: ServerProcess, issuer: Issuer) -> None:
    """servers:<name> (devs have servers:*), or the entry's own required_scope."""
    initialize_body = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": LEGACY,
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }
    headers = {"content-type": "application/json", "accept": BOTH}

    def hosted(name: str, token: str, under: str = "") -> Any:
        return httpx2.post(
            f"{server.base_url}{under}/servers/{name}/mcp",
            json=initialize_body,
            headers={**headers, "authorization": f"Bearer {token}"},
            timeout=30,
        )

    cy = issuer.token(audience=server.url, sub="cy")
    refused = hosted("time", cy)
    assert refused.status_code == 403
    params = challenge(refused)
    assert (params["error"], params["scope"]) == ("insufficient_scope", "servers:time")
    assert params["resource_metadata"].endswith("/oauth-protected-resource/servers/time/mcp")
    assert "groups devs" in refused.json()["error"]["message"]
    # In a session's endpoint, the challenge names that endpoint's metadata (the one the
    # client used), not the path the server rewrote it to.
    params = challenge(hosted("time", cy, under="/s/work"))
    assert params["resource_metadata"].endswith("/oauth-protected-resource/s/work/servers/time/mcp")

    # A token minted for the hosted endpoint itself is this server's too.
    ann = issuer.token(audience=f"{server.base_url}/servers/time/mcp", sub="ann", groups=["devs"])
    assert hosted("time", ann).status_code not in (401, 403)
    github = hosted("github", ann)
    assert github.status_code == 403 and challenge(github)["scope"] == "github:write"


async def test_list_servers_shows_only_the_servers_the_caller_may_use(
    server: ServerProcess, issuer: Issuer
) -> None:
    ann = issuer.token(audience=server.url, sub="ann", groups=["devs"])
    async with open_client(server.url, ann, mode="auto") as conn:
        listed = await conn.ok("list_servers")
        assert [s["name"] for s in listed["servers"]] == ["time"]  # (github: github:write)
    async with open_client(server.url, STATIC, mode="auto") as conn:
        assert (await conn.ok("list_servers"))["servers"] == []  # (ci: no servers scope)


def test_a_bad_policy_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text('[groups.devs]\nscopes = ["sandbox:exec"]\n')
    code, stderr = run_server_once(
        tmp_path, SANDBOX_POLICY_FILE=str(policy), SANDBOX_AUTH_TOKEN=STATIC
    )
    assert code == 2, stderr
    assert stderr.strip() == (
        f"{policy}: groups.devs.scopes[0] = 'sandbox:exec' is not a scope of this server "
        "(known: sandbox:execute, sandbox:files, snapshots, servers:<name>, servers:*, *) "
        "(SANDBOX_POLICY_FILE)"
    )


def test_a_call_the_edge_reads_otherwise_than_the_tools_is_still_refused(
    server: ServerProcess, issuer: Issuer
) -> None:
    """What a hostile client tries so that the edge's peek sees another call than the tool
    layer: a duplicate `name` key, unicode escapes, a batch, a chunked body, the session
    path. Each is refused (403 at the edge, or a tool error naming the scope), none runs."""
    token = issuer.token(audience=server.url, sub="cy")
    sid = initialize(server, token)
    headers = {
        "content-type": "application/json",
        "accept": BOTH,
        "authorization": f"Bearer {token}",
        "mcp-session-id": sid,
        "mcp-protocol-version": LEGACY,
    }
    run = '{"command": "echo PWN\'\'ED"}'  # (prints PWNED; the request does not hold it)
    bodies = [
        '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"list_snapshots",'
        '"name":"execute_code","arguments":' + run + "}}",
        '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"\\u0065xecute_code",'
        '"arguments":' + run + "}}",
        '[{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"execute_code",'
        '"arguments":' + run + "}}]",
    ]
    for body in bodies:
        response = httpx2.post(server.url, content=body, headers=headers, timeout=30)
        assert "PWNED" not in response.text, body
        assert response.status_code >= 400 or "sandbox:execute" in response.text, response.text

    def chunks() -> Iterator[bytes]:
        yield bodies[1][:40].encode()
        yield bodies[1][40:].encode()

    response = httpx2.post(server.url, content=chunks(), headers=headers, timeout=30)
    assert "PWNED" not in response.text and "sandbox:execute" in response.text
    at_session = server.url.replace("/mcp", "/s/work/mcp")
    session_headers = {k: v for k, v in headers.items() if k != "mcp-session-id"}
    sid = post_initialize_at(at_session, token)
    response = httpx2.post(
        at_session,
        content=bodies[1],
        headers={**session_headers, "mcp-session-id": sid},
        timeout=30,
    )
    assert response.status_code == 403 and "sandbox:execute" in response.text


def post_initialize_at(url: str, token: str) -> str:
    body = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": LEGACY,
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }
    headers = {"content-type": "application/json", "accept": BOTH}
    response = httpx2.post(
        url, json=body, headers={**headers, "authorization": f"Bearer {token}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return str(response.headers["mcp-session-id"])


async def test_code_mode_with_every_server_reaches_only_those_the_scopes_cover(
    server: ServerProcess, issuer: Issuer
) -> None:
    """servers=["*"] with servers:* but not github's required_scope (github:write): the
    bridge shows time, not github (as list_servers and /servers/github/mcp refuse it)."""
    token = issuer.token(audience=server.url, sub="dee", groups=["devs"])
    code = "import mcp_servers\nprint(sorted(s['name'] for s in mcp_servers.servers()))"
    async with open_client(server.url, token, mode="auto") as conn:
        ran = await conn.ok("execute_code", command=f'python3 -c "{code}"', servers=["*"])
        text = await conn.error("execute_code", command="true", servers=["*", "github"])
        assert "'github:write'" in text
    printed = "".join(e["data"] for e in ran["output"] if e["type"] == "stdout")
    assert printed.strip() == "['time']", ran
