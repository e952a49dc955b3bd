"""The settings' small languages (config/parsing.py), parsed without any environment."""

from __future__ import annotations

import pytest

from sandbox_runtime.config import Settings, parsing
from sandbox_runtime.domain.egress import EgressDenied, EgressSettings

pytestmark = pytest.mark.unit


def test_tokens_map_each_token_to_its_principal() -> None:
    assert parsing.tokens("", "") == {}
    assert parsing.tokens("t0-secret", " a:token-aaa , ,b:token-bbb") == {
        "t0-secret": "default",
        "token-aaa": "a",
        "token-bbb": "b",
    }
    with pytest.raises(ValueError, match="principal:token"):
        parsing.tokens("", "no-colon")
    with pytest.raises(ValueError, match="under 8 characters"):
        parsing.tokens("", "a:short")


def test_warm_interpreters() -> None:
    assert parsing.warm_interpreters("Python=2, bash ,deno=0") == {
        "python": 2,
        "bash": 1,
        "deno": 0,
    }
    assert parsing.warm_interpreters("") == {}
    with pytest.raises(ValueError):
        parsing.warm_interpreters("python=many")


def test_resolvers_are_addresses_with_an_optional_port() -> None:
    assert parsing.resolvers("10.0.0.2, [2001:db8::1]:5353") == [
        ("10.0.0.2", 53),
        ("2001:db8::1", 5353),
    ]
    with pytest.raises(ValueError, match="not an IP address"):
        parsing.resolvers("dns.example")
    with pytest.raises(EgressDenied):
        parsing.resolvers("10.0.0.2:99999")


def test_cluster_bind_and_inode_count() -> None:
    assert parsing.cluster_bind("0.0.0.0", 8080, None, None) == ("0.0.0.0", 8081)
    assert parsing.cluster_bind("h", 65535, None, None) == ("h", 0)
    assert parsing.cluster_bind("h", 0, "c", 9000) == ("c", 9000)
    assert parsing.inode_count(1024, None) == 65536
    assert parsing.inode_count(16, 10**9) == 16 * 1024
    assert parsing.inode_count(16, 1) == 256


def test_choice_lowercases_and_refuses_the_rest() -> None:
    assert parsing.choice("JSON", ("text", "json"), "bad") == "json"
    with pytest.raises(ValueError, match="bad"):
        parsing.choice("xml", ("text", "json"), "bad")


def test_settings_still_derive_through_parsing() -> None:
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        auth_tokens="p:token-ppp",
        egress_allow="pypi.org",
        egress_resolver="192.0.2.53",
        egress_max_mb=2,
        log_format="JSON",
    )
    assert settings.tokens() == {"token-ppp": "p"}
    assert settings.log_format == "json"
    assert settings.egress_settings() == EgressSettings(
        max_bytes=2 * 1024 * 1024, resolvers=[("192.0.2.53", 53)]
    )
    with pytest.raises(ValueError, match="egress settings"):
        Settings(_env_file=None, egress_resolver="dns.example")  # type: ignore[call-arg]


def test_workspace_reserve_is_thin_by_default_and_sparse_is_its_old_name() -> None:
    assert Settings(_env_file=None).workspace_reserve == "thin"  # type: ignore[call-arg]
    for value, chosen in (("sparse", "thin"), ("Allocate", "allocate"), ("thin", "thin")):
        settings = Settings(_env_file=None, workspace_reserve=value)  # type: ignore[call-arg]
        assert settings.workspace_reserve == chosen
    with pytest.raises(ValueError, match="`thin` or `allocate`"):
        Settings(_env_file=None, workspace_reserve="lazy")  # type: ignore[call-arg]
