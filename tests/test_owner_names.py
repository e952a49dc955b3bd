"""valid_owner: the names a placement request (or any owner from outside the MCP edge) may
carry are those the edge itself accepts (issue 40: forged placements made homes for `bob\\nx`
and `s:../../etc`)."""

from __future__ import annotations

import pytest

from sandbox_runtime.domain.owner import SESSION_RE, Owner, valid_owner
from sandbox_runtime.server import calls

pytestmark = pytest.mark.unit


def test_the_edge_and_the_queue_check_sessions_with_one_pattern() -> None:
    assert calls.SESSION_RE is SESSION_RE


@pytest.mark.parametrize(
    "owner",
    [
        Owner("default", "default"),
        Owner("anonymous", "s:one"),
        Owner("team-a", "s:a.b_c:d@e-f"),
        Owner("Zoë Ops", "s:" + "x" * 128),
    ],
)
def test_names_the_edge_makes_are_valid(owner: Owner) -> None:
    assert valid_owner(owner)


@pytest.mark.parametrize(
    "owner",
    [
        Owner("bob\nx", "s:ok"),
        Owner("bob", "s:../../etc"),
        Owner("bob", "s:.."),
        Owner("bob", "s:"),
        Owner("bob", "s:" + "x" * 129),
        Owner("bob", "s:evil\n"),
        Owner("bob", "other"),
        Owner("bob", "../etc"),
        Owner("", "default"),
        Owner(" bob", "default"),
        Owner("a:b", "default"),
        Owner("a,b", "default"),
        Owner("nul\x00", "default"),
        Owner("x" * 257, "default"),
    ],
)
def test_names_no_caller_could_have_are_not(owner: Owner) -> None:
    assert not valid_owner(owner)
