"""OAuth the MCP way, end to end (issue 48): a real OpenID provider (oidc-provider, see
tests/oidc_harness.py), the real server as its protected resource, and real clients that find
where to sign in from the server's 401 and protected resource metadata, register themselves,
sign a user in (authorization code + PKCE; the test plays the person at the browser) and call
tools: the official Python SDK, the official TypeScript SDK and MCP Inspector's CLI. Each user
sees only their own sessions."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp.shared.exceptions import MCPError
from mcp_harness import MODERN_PROTOCOL, ROOT, ServerProcess, Servers, eventually, free_port
from oidc_harness import (
    Provider,
    claims_of,
    code_of,
    linked_beside,
    missing,
    node22,
    oauth_clients,
    running_provider,
    signed_in,
)

pytestmark = pytest.mark.e2e

POLICY = """
[groups.engineers]
scopes = ["sandbox:execute", "sandbox:files", "snapshots"]

[groups.viewers]
scopes = ["sandbox:files"]
"""


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    with running_provider(tmp_path_factory.mktemp("oidc")) as running:
        yield running


def oauth_server(
    serve: Servers, workdir: Path, provider: Provider, **settings: str
) -> ServerProcess:
    """A server whose resource is its own /mcp URL, trusting `provider`, with POLICY."""
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.toml"
    policy.write_text(POLICY)
    server = ServerProcess(workdir)
    server.settings.update(
        SANDBOX_OAUTH_ISSUER=provider.issuer,
        SANDBOX_OAUTH_RESOURCE=server.url,
        SANDBOX_POLICY_FILE=str(policy),
        **settings,
    )
    return serve.add(server)


@pytest.fixture(scope="module")
def server(
    serve: Servers, provider: Provider, tmp_path_factory: pytest.TempPathFactory
) -> ServerProcess:
    workdir = tmp_path_factory.mktemp("oauth-server")
    return oauth_server(serve, workdir, provider, SANDBOX_AUDIT_LOG=str(workdir / "audit.log"))


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


def assert_discovered(server: ServerProcess, offset: int) -> None:
    """The server's access log since `offset`: a 401 on /mcp, then the client read the
    protected resource metadata it named."""
    log = server.log_since(offset, max_lines=2000)
    refused = log.find('"POST /mcp HTTP/1.1" 401')
    assert refused >= 0, f"no 401 on /mcp:\n{log[-3000:]}"
    read = log.find('"GET /.well-known/oauth-protected-resource/mcp HTTP/1.1" 200', refused)
    assert read > refused, f"the metadata was not read after the 401:\n{log[-3000:]}"


# --- the official Python SDK -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_python_sdk_signs_in_with_pkce_and_calls_tools(
    server: ServerProcess, provider: Provider, mode: str
) -> None:
    async with signed_in(server.url, provider, "alice", mode) as (conn, storage, sent_to):
        if mode == "auto":
            assert conn.client.protocol_version == MODERN_PROTOCOL
        result = await conn.ok("execute_code", command="echo signed in", session="py-sdk")
        assert stdout_of(result) == "signed in\n", result
    # It found the provider through the server's metadata, registered itself, and asked for
    # a token for this server (RFC 8707) with PKCE.
    assert len(sent_to) == 1, sent_to
    asked = code_of(sent_to[0])
    assert sent_to[0].startswith(provider.issuer + "/auth?"), sent_to
    assert asked["resource"] == server.url, asked
    assert asked["code_challenge_method"] == "S256" and asked["code_challenge"], asked
    assert storage.client is not None and storage.client.client_id, "no dynamic registration"
    assert storage.tokens is not None
    claims = claims_of(storage.tokens.access_token)
    assert claims["aud"] == server.url and claims["sub"] == "alice", claims
    assert claims["groups"] == ["engineers"], claims


async def test_discovery_the_clients_rely_on(server: ServerProcess, provider: Provider) -> None:
    """What every client reads before signing in: the 401's challenge names the resource
    metadata, and that names the provider and this server as the resource."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"accept": "application/json, text/event-stream"}
    resp = httpx2.post(server.url, json=body, headers=headers, timeout=10)
    assert resp.status_code == 401, resp.text
    challenge = resp.headers["www-authenticate"]
    expected = f"{server.base_url}/.well-known/oauth-protected-resource/mcp"
    assert challenge.startswith("Bearer ") and f'resource_metadata="{expected}"' in challenge
    assert "error=" not in challenge, "no error code when no token came (RFC 6750 3.1)"
    metadata = httpx2.get(expected, timeout=10).json()
    assert metadata["resource"] == server.url, metadata
    assert metadata["authorization_servers"] == [provider.issuer], metadata
    assert "sandbox:execute" in metadata["scopes_supported"], metadata


# --- each user their own sessions ------------------------------------------------------------


async def test_two_users_see_only_their_own_sessions(
    server: ServerProcess, provider: Provider
) -> None:
    async with (
        signed_in(server.url, provider, "alice") as (alice, _, _),
        signed_in(server.url, provider, "carol") as (carol, _, _),
    ):
        mine = await alice.ok("execute_code", command="echo alice > who", session="team")
        theirs = await carol.ok("execute_code", command="cat who || echo none", session="team")
        assert stdout_of(theirs) == "none\n", "carol's session 'team' is not alice's"
        listed = await carol.ok("list_executions", session="team")
        ids = {item["id"] for item in listed["result"]}
        assert mine["execution_id"] not in ids and theirs["execution_id"] in ids, listed
        refused = await carol.error(
            "get_execution_status", execution_id=mine["execution_id"], session="team"
        )
        assert "not found" in refused.lower(), refused
        again = await alice.ok("list_executions", session="team")
        assert [i["id"] for i in again["result"]] == [mine["execution_id"]], again


# --- the official TypeScript SDK -------------------------------------------------------------


@pytest.mark.parametrize("sdk", ["v1", "v2"])
def test_typescript_sdk_signs_in_with_pkce_and_calls_tools(
    server: ServerProcess, provider: Provider, tmp_path: Path, sdk: str
) -> None:
    modules = Path(os.environ.get("SRT_CLIENTS_NODE") or ROOT / ".clients/node") / "node_modules"
    if (
        not (modules / "@modelcontextprotocol/sdk").is_dir()
        or not (modules / "@modelcontextprotocol/client").is_dir()
    ):
        missing(f"no TypeScript SDK in {modules}")
    driver = linked_beside(modules, ROOT / "tests/clients/oauth_ts_driver.mjs", tmp_path)
    offset = server.log_size()
    proc = subprocess.Popen(
        [str(node22()), str(driver), "--url", server.url, "--sdk", sdk],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = json.loads(proc.stdout.readline() or "{}")  # (a crash report ends it too)
        if "authorize" not in first:
            rest, err = proc.communicate(timeout=30)
            raise AssertionError(f"no authorization URL: {first} {rest}\n{err[-3000:]}")
        asked = code_of(first["authorize"])
        assert asked["resource"] == server.url and asked["code_challenge_method"] == "S256"
        proc.stdin.write(provider.login(first["authorize"], "carol") + "\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    report = json.loads(out.strip().splitlines()[-1])
    assert "crash" not in report, f"{report}\n{err[-3000:]}"
    assert_discovered(server, offset)
    assert report["registered"], "the SDK registered itself (RFC 7591)"
    assert report["is_error"] is False, report
    assert "from typescript" in json.dumps(report["structured"]), report


# --- MCP Inspector's CLI ---------------------------------------------------------------------

AUTHORIZE_AT = re.compile(r"(http://127\.0\.0\.1:\d+/auth\?\S+)")


def test_inspector_cli_discovers_signs_in_and_calls_a_tool(
    server: ServerProcess, provider: Provider, tmp_path: Path
) -> None:
    """Inspector's CLI without a browser: with MCP_AUTO_OPEN_ENABLED it runs its OAuth flow
    without a terminal, prints the authorization URL and waits on its loopback callback;
    the test signs alice in there and delivers the redirect to that callback."""
    launcher = oauth_clients() / "@modelcontextprotocol/inspector/clients/launcher/build/index.js"
    callback = f"http://127.0.0.1:{free_port()}/oauth/callback"
    env = {
        **os.environ,
        "HOME": str(tmp_path),  # (its catalog and state: nothing of the user's)
        "MCP_STORAGE_DIR": str(tmp_path / "storage"),
        "MCP_INSPECTOR_SECRET_STORE": "memory",
        "MCP_AUTO_OPEN_ENABLED": "true",
        "BROWSER": "/bin/true",  # (the "browser" it opens does nothing: the test signs in)
    }
    argv = [
        str(node22()),
        str(launcher),
        "--cli",
        "--transport",
        "http",
        "--server-url",
        server.url,
        "--callback-url",
        callback,
        "--method",
        "tools/call",
        "--tool-name",
        "execute_code",
        "--tool-arg",
        "command=echo from inspector",
        "session=inspector",
    ]
    offset = server.log_size()
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    said: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 60
        found = None
        while found is None and time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(queue.Empty):
                said.append(lines.get(timeout=0.5))
                found = AUTHORIZE_AT.search(said[-1])
        assert found, f"no authorization URL from the Inspector:\n{''.join(said)[-3000:]}"
        asked = code_of(found.group(1))
        assert asked["resource"] == server.url and asked["redirect_uri"] == callback, asked
        landed = provider.login(found.group(1), "alice")
        assert landed.startswith(callback + "?code="), landed
        assert httpx2.get(landed, timeout=30).status_code == 200  # (its callback page)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, f"exit {proc.returncode}: {out[-2000:]}\n{''.join(said)[-3000:]}"
    assert_discovered(server, offset)
    result = json.loads(out)
    assert result["isError"] is False, result
    assert "from inspector" in json.dumps(result["structuredContent"]), result
    assert result["structuredContent"]["session"] == "inspector", result


# --- the audit log ---------------------------------------------------------------------------


async def test_the_audit_log_has_one_line_per_call_and_no_token(
    server: ServerProcess, provider: Provider
) -> None:
    log = server.workdir / "audit.log"
    async with signed_in(server.url, provider, "alice") as (alice, storage, _):
        assert storage.tokens is not None and storage.client is not None
        token_id = claims_of(storage.tokens.access_token)["jti"]
        await alice.ok("execute_code", command="echo audited", session="audit")
        await alice.ok("write_file", path="a.txt", content="x" * 1000, session="audit")
        await alice.ok("list_executions", session="audit")
        await alice.error("get_execution_status", execution_id="nope", session="audit")

    def mine() -> list[dict[str, Any]]:
        lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        return [line for line in lines if line.get("token_id") == token_id]

    # (one writer, in order: once the last call's line is there, so is every earlier one)
    await eventually(
        lambda: any(x["tool"] == "get_execution_status" for x in mine()), 10, "the audit lines"
    )
    lines = mine()
    assert [(x["event"], x["tool"], x["outcome"]) for x in lines] == [
        ("tool_call", "execute_code", "ok"),
        ("tool_call", "write_file", "ok"),
        ("tool_call", "list_executions", "ok"),
        ("tool_call", "get_execution_status", "not_found"),
    ], lines
    for line in lines:
        assert line["principal"] == "alice" and line["session"] == "audit", line
        assert line["client_id"] == storage.client.client_id, line
    assert lines[1]["argument_bytes"]["content"] == 1000, lines[1]
    text = log.read_text()
    assert storage.tokens.access_token not in text
    assert storage.tokens.access_token.split(".")[2] not in text, "not even its signature"
    if storage.tokens.refresh_token:
        assert storage.tokens.refresh_token not in text


async def test_a_viewer_signed_in_by_the_sdk_is_refused_execute_with_the_scope_named(
    server: ServerProcess, provider: Provider
) -> None:
    """bob (viewers: sandbox:files only) through the official client: the 403 names
    sandbox:execute; the SDK's step-up signs him in once more asking for it, the provider
    gives it, the policy still does not: the call fails with the scope in its words, and
    nothing ran. What the viewer may do works."""
    offset = server.log_size()
    async with signed_in(server.url, provider, "bob") as (bob, _, sent_to):
        written = await bob.ok("write_file", path="b.txt", content="viewer", session="bob")
        assert written, written
        with pytest.raises(MCPError) as refused:
            await bob.call("execute_code", command="echo no", session="bob")
    text = str(refused.value)
    assert "sandbox:execute" in text and "insufficient scope" in text, text
    step_up = code_of(sent_to[-1])
    assert len(sent_to) == 2 and "sandbox:execute" in step_up["scope"].split(), sent_to
    assert "execution started principal=bob" not in server.log_since(offset, max_lines=5000)
