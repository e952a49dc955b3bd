"""The policy file: groups, principals and the default get scopes; a bad file is refused with
the line or the key at fault; the scope table covers every tool the server has."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.identity import Identity
from sandbox_runtime.oauth.policy import PolicyError, load_policy, parse_policy, refusal_text
from sandbox_runtime.oauth.scopes import EXECUTE, TOOL_SCOPES, tool_scope

pytestmark = pytest.mark.unit

GOOD = """
[default]
scopes = ["sandbox:files"]

[groups.devs]
scopes = ["sandbox:execute", "servers:*"]

[groups.admins]
scopes = ["*"]

[groups.github-users]
scopes = ["github:write"]          # a catalog entry's own required_scope

[principals."alice@example.com"]
groups = ["admins"]

[principals.ci]
groups = ["devs"]
scopes = ["snapshots"]
"""


def test_scopes_come_from_the_default_groups_and_principal() -> None:
    policy = parse_policy(GOOD)
    assert policy.scopes_of("nobody", ()) == {"sandbox:files"}
    assert policy.scopes_of("ci", policy.groups_of("ci")) == {
        "sandbox:files",
        "sandbox:execute",
        "servers:*",
        "snapshots",
    }
    assert policy.groups_of("ci", ("ops", "devs")) == ("ops", "devs")
    assert policy.scopes_of("alice@example.com", policy.groups_of("alice@example.com")) is None
    assert policy.scopes_of("x", ("unknown-group",)) == {"sandbox:files"}


def test_servers_star_covers_every_server_and_nothing_else() -> None:
    scopes = parse_policy(GOOD).scopes_of("ci", ("devs",))
    identity = Identity("ci", "-", "static", scopes=scopes)
    assert identity.allows("servers:time") and identity.allows("servers:github")
    assert not identity.allows("github:write")
    assert identity.allows("")  # (discovery needs no scope)


def test_the_refusal_names_the_scope_and_the_groups_that_grant_it() -> None:
    text = refusal_text("servers:time", "bob", parse_policy(GOOD))
    assert "'servers:time'" in text and "'bob'" in text and "admins, devs" in text
    no_group = parse_policy('[groups.devs]\nscopes = ["sandbox:execute"]')
    assert "SANDBOX_POLICY_FILE" in refusal_text("snapshots", "bob", no_group)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[default\nscopes = []", "line 1"),
        ("[default]\nscopes = []\n[groups.devs]\nscopes = [sandbox]\n", "line 4"),
        ("[roles.devs]\nscopes = []", "unknown key 'roles'"),
        ('[groups.devs]\nscopes = ["sandbox:exec"]', "groups.devs.scopes[0] = 'sandbox:exec'"),
        ('[groups.devs]\nscopes = ["snapshot"]', "groups.devs.scopes[0]"),
        ('[groups.devs]\nscopes = "sandbox:execute"', "groups.devs.scopes must be a list"),
        ('[groups.devs]\ngroups = ["x"]', "groups.devs.groups is not a known key"),
        ('[principals.ci]\nscope = ["snapshots"]', "principals.ci.scope is not a known key"),
        ("groups = 3", "groups must be a table"),
        ('[default]\nscopes = ["a b"]', "default.scopes[0] = 'a b'"),
    ],
)
def test_a_bad_file_is_refused_naming_the_line_or_key(text: str, words: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "/etc/srt/policy.toml")
    assert words in str(caught.value) and "/etc/srt/policy.toml" in str(caught.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"policy\.toml: cannot be read"):
        load_policy(tmp_path / "policy.toml")


def test_oauth_settings_are_checked_together() -> None:
    with pytest.raises(ValueError, match="needs SANDBOX_OAUTH_RESOURCE"):
        Settings(_env_file=None, oauth_issuer="https://idp.example.com")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="must be an http"):
        Settings(
            _env_file=None,  # type: ignore[call-arg]
            oauth_issuer="idp.example.com",
            oauth_resource="https://s.example.com/mcp",
        )
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        oauth_issuer="https://a.example.com, https://b.example.com/realms/x",
        oauth_resource="https://s.example.com/mcp",
        oauth_audience="api://s",
    )
    assert settings.oauth_issuers() == ["https://a.example.com", "https://b.example.com/realms/x"]
    assert settings.oauth_audiences() == ["https://s.example.com/mcp", "api://s"]


async def test_every_tool_of_the_server_has_a_scope_in_the_table() -> None:
    from sandbox_runtime.app.services import Root
    from sandbox_runtime.server.app import build_mcp

    mcp = build_mcp(Settings(_env_file=None), Root())  # type: ignore[call-arg]
    names = {t.name for t in await mcp.list_tools(run_middleware=False)}
    assert names - set(TOOL_SCOPES) == set(), "add them to oauth/scopes.py's TOOL_SCOPES"
    assert set(TOOL_SCOPES) - names == set(), "a tool the table names is gone"
    assert tool_scope("a-new-tool") == EXECUTE  # (never open by accident)


def test_metrics_are_closed_when_only_oauth_authenticates() -> None:
    from sandbox_runtime.server.app import _metrics_token_digests

    oauth = {"oauth_issuer": "https://idp.example.com", "oauth_resource": "https://s.example/mcp"}
    assert _metrics_token_digests(Settings(_env_file=None, **oauth)) == []  # type: ignore[call-arg]
    assert _metrics_token_digests(Settings(_env_file=None)) is None  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("setting", "advertised"),
    [
        (None, ["sandbox:execute", "sandbox:files", "snapshots"]),
        ("api://sandbox/.default", ["api://sandbox/.default"]),
        ("openid, sandbox:execute", ["openid", "sandbox:execute"]),
        ("none", None),
    ],
)
def test_the_advertised_scopes_follow_the_setting(
    setting: str | None, advertised: list[str] | None
) -> None:
    from sandbox_runtime.server.oauth_edge import resource_metadata

    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        oauth_issuer="https://idp.example.com",
        oauth_resource="https://s.example.com/mcp",
        oauth_scopes=setting,
    )
    metadata = resource_metadata(settings)
    assert metadata is not None
    document = metadata.document("/mcp")
    assert document is not None and document.get("scopes_supported") == advertised
    hosted = metadata.document("/servers/time/mcp")
    assert hosted is not None
    assert hosted.get("scopes_supported") == (["servers:time"] if setting is None else advertised)
