"""The web console signing in with the server's identity provider, in a real headless Chromium:
a real OpenID provider (tests/oidc_harness.py: oidc-provider, PKCE required) with the console
registered as a public client whose redirect URI is the server's /console/callback. The page
runs authorization code + PKCE (S256), keeps the access token in sessionStorage only, calls
tools with it, signs in again when the server refuses it (expired), and still takes a static
token. The audit log names the signed-in user and the console's client."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import pytest
from browser_harness import Browser, Console, browser_available, open_browser, wait_for
from mcp_harness import ServerProcess, Servers
from oidc_harness import Provider, running_provider, with_query

pytestmark = [pytest.mark.e2e]
assert browser_available() is None, browser_available()

TOKEN = f"srt-console-oauth-{secrets.token_hex(16)}"
CONSOLE_CLIENT: list[str] = []  # the console's client id at the provider (registered once)
POLICY = """
[groups.engineers]
scopes = ["sandbox:execute", "sandbox:files", "snapshots"]

[principals.default]
groups = ["engineers"]
"""


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    with running_provider(tmp_path_factory.mktemp("oidc")) as running:
        yield running


def register_console(provider: Provider, redirect_uri: str) -> str:
    """The console as the operator registers it: a public client (no secret), code flow,
    redirect URI the server's /console/callback; its client id."""
    discovery = httpx2.get(f"{provider.issuer}/.well-known/openid-configuration", timeout=10)
    registration = discovery.json()["registration_endpoint"]
    answer = httpx2.post(
        registration,
        json={
            "client_name": "sandbox_runtime console",
            "application_type": "web",
            "redirect_uris": [redirect_uri],
            "grant_types": ["authorization_code"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
        },
        timeout=10,
    )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["client_id"])


@pytest.fixture(scope="module")
def server(
    serve: Servers, provider: Provider, tmp_path_factory: pytest.TempPathFactory
) -> ServerProcess:
    workdir = tmp_path_factory.mktemp("console-oauth")
    (workdir / "policy.toml").write_text(POLICY)
    server = ServerProcess(workdir / "server")
    client_id = register_console(provider, f"{server.base_url}/console/callback")
    server.settings.update(
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_OAUTH_ISSUER=provider.issuer,
        SANDBOX_OAUTH_RESOURCE=server.url,
        SANDBOX_OAUTH_CONSOLE_CLIENT_ID=client_id,
        SANDBOX_POLICY_FILE=str(workdir / "policy.toml"),
        SANDBOX_AUDIT_LOG=str(workdir / "audit.log"),
    )
    CONSOLE_CLIENT.append(client_id)
    return serve.add(server)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    with open_browser(tmp_path / "browser") as b:
        yield b


def sign_in_at_provider(page: Console, provider: Provider, user: str) -> None:
    """Be `user` at the provider's sign-in and consent pages (the test provider's scripted
    login: `?as=USER`), until the browser is back on the console."""

    def back_or_asked() -> bool:
        url = page.d.current_url
        at_provider = url.startswith(provider.issuer + "/")
        if at_provider and urlsplit(url).path.startswith("/interaction/"):
            if "as=" not in url:
                page.d.get(with_query(url, **{"as": user}))
            return False
        return url.startswith(page.base_url + "/") and page.displayed("#app")

    page.wait(back_or_asked, "the provider's sign-in to send the browser back, signed in")


def stored(page: Console) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = page.js(
        "const all = s => Object.fromEntries(Object.keys(s).map(k => [k, s.getItem(k)]));"
        "return {session: all(sessionStorage), local: all(localStorage)};"
    )
    return found


def test_the_console_signs_in_with_the_identity_provider_and_again_when_refused(
    server: ServerProcess, provider: Provider, browser: Browser
) -> None:
    page = Console(browser, server.base_url)
    page.open()
    button = page.wait(lambda: page.displayed("#signin-oauth"), "the provider's sign-in button")
    assert button and urlsplit(provider.issuer).netloc in page.el("#signin-oauth").text
    page.el("#session").clear()
    page.el("#session").send_keys("from-idp")
    page.el("#signin-oauth").click()
    sign_in_at_provider(page, provider, "alice")
    page.wait_signed_in()
    assert page.d.current_url == server.base_url + "/"  # (the code is off the address bar)

    page.run("python", "print(6 * 7)")
    assert "42" in page.stdout(), page.describe()

    # The authorization request was PKCE S256 for this server's resource, back to the callback.
    requests = browser.requests()
    authorize = [u for _, u in requests if u.startswith(provider.issuer + "/auth")]
    assert authorize, requests
    query = dict(p.split("=", 1) for p in urlsplit(authorize[0]).query.split("&"))
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) == 43
    assert "console%2Fcallback" in query["redirect_uri"]
    token_calls = [u for m, u in requests if m == "POST" and u.startswith(provider.issuer)]
    assert token_calls == [provider.issuer + "/token"], token_calls

    # Kept in this tab's sessionStorage only; never in a URL.
    kept = stored(page)
    token = kept["session"]["srt-console-token"]
    assert kept["local"] == {} and kept["session"]["srt-console-kind"] == "oauth"
    assert token.count(".") == 2  # (a JWT access token for this server)
    assert not any(token in url for url in browser.request_urls())

    # The server refuses the token (as once it expires): the console signs in again at the
    # provider (whose own session answers at once) and carries on with a new token.
    expired = provider.mint(aud=server.url, exp=int(time.time()) - 120)
    page.js(
        "sessionStorage.setItem('srt-console-token', arguments[0]);"
        "sessionStorage.setItem('srt-console-since', '0');",
        expired,
    )
    page.open()  # (the page starts with the stored token: refused, so off to the provider)
    sign_in_at_provider(page, provider, "alice")
    page.wait_signed_in()
    renewed = stored(page)["session"]["srt-console-token"]
    assert renewed not in (token, expired)
    page.run("python", "print('again')")
    assert "again" in page.stdout(), page.describe()

    # The audit log names the user and the console's OAuth client, never the token.
    log = server.workdir.parent / "audit.log"

    def alice_lines() -> list[dict[str, object]]:
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        return [line for line in lines if line.get("principal") == "alice"]

    lines = wait_for(lambda: len(alice_lines()) >= 4 and alice_lines(), 10, "alice's lines")
    assert {line["client_id"] for line in lines} == {CONSOLE_CLIENT[0]}
    assert {line["session"] for line in lines} == {"from-idp"}
    assert token not in log.read_text() and renewed not in log.read_text()


def test_a_static_token_still_signs_in_beside_the_provider(
    server: ServerProcess, browser: Browser
) -> None:
    page = Console(browser, server.base_url)
    page.open()
    page.wait(lambda: page.displayed("#signin-oauth"), "the provider's sign-in button")
    page.sign_in(TOKEN)
    page.wait_signed_in()
    assert stored(page)["session"]["srt-console-kind"] == "token"
    page.run("python", "print('static ' + 'token')")
    assert "static token" in page.stdout(), page.describe()


def test_the_page_may_reach_the_provider_and_nothing_else(
    server: ServerProcess, provider: Provider
) -> None:
    answer = httpx2.get(server.base_url + "/", timeout=10)
    policy = answer.headers["content-security-policy"]
    origin = f"http://{urlsplit(provider.issuer).netloc}"
    assert f"connect-src 'self' {origin};" in policy, policy
    config = httpx2.get(server.base_url + "/console/config.json", timeout=10).json()
    assert config["callback"] == "/console/callback"
    assert config["oauth"]["issuer"] == provider.issuer
    assert config["oauth"]["resource"] == server.url
    assert "sandbox:execute" in config["oauth"]["scope"].split()
    callback = httpx2.get(server.base_url + "/console/callback?code=x&state=y", timeout=10)
    assert callback.status_code == 200 and "signin-oauth" in callback.text
