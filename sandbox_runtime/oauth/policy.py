"""The operator's policy file (SANDBOX_POLICY_FILE): which scopes each group and principal
gets, and what every signed-in caller gets. Read once at start; a bad file stops the start
with the key at fault.

    [default]                      # every authenticated caller (static token or OAuth)
    scopes = ["sandbox:execute"]

    [groups.developers]            # a group named by the token's groups claim
    scopes = ["sandbox:execute", "sandbox:files", "snapshots", "servers:*"]

    [principals.ci-bot]            # a principal (a static token's, or an OAuth one)
    groups = ["developers"]        # groups it belongs to besides its token's
    scopes = ["servers:github"]

`*` is every scope, `servers:*` every hosted server.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_runtime.oauth.scopes import EXECUTE, FILES, SCOPE_NAME, SERVERS_PREFIX, SNAPSHOTS

EVERY = "*"
EVERY_SERVER = SERVERS_PREFIX + "*"
_SECTIONS = ("default", "groups", "principals")


class PolicyError(ValueError):
    """The policy file cannot be used; the message names the file and the key at fault."""


@dataclass(frozen=True)
class Grant:
    scopes: frozenset[str] = frozenset()
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Policy:
    default: Grant = field(default_factory=Grant)
    groups: dict[str, Grant] = field(default_factory=dict)
    principals: dict[str, Grant] = field(default_factory=dict)

    def groups_of(self, principal: str, token_groups: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The caller's groups: its token's, then those the file gives its principal."""
        extra = self.principals.get(principal, Grant()).groups
        return tuple(dict.fromkeys((*token_groups, *extra)))

    def scopes_of(self, principal: str, groups: tuple[str, ...]) -> frozenset[str] | None:
        """The scopes `principal` in `groups` gets (None: every scope)."""
        found = set(self.default.scopes) | set(self.principals.get(principal, Grant()).scopes)
        for group in groups:
            found |= self.groups.get(group, Grant()).scopes
        return None if EVERY in found else frozenset(found)

    def granting(self, scope: str) -> list[str]:
        """The groups that would give `scope` (for the refusal's hint)."""
        wild = EVERY_SERVER if scope.startswith(SERVERS_PREFIX) else None
        return sorted(
            name
            for name, grant in self.groups.items()
            if scope in grant.scopes or EVERY in grant.scopes or wild in grant.scopes
        )


def refusal_text(needed: str, principal: str, policy: Policy | None) -> str:
    """What a caller without the scope `needed` reads: the scope, and how to get it."""
    groups = policy.granting(needed) if policy is not None else []
    if groups:
        how = f"the policy grants it to the groups {', '.join(groups)}: ask the operator to add you"
    else:
        how = "ask the operator to grant it in the policy file (SANDBOX_POLICY_FILE)"
    return (
        f"insufficient scope: this call needs the scope {needed!r}, which principal "
        f"{principal!r} does not have; {how}, then sign in again requesting it"
    )


def policy_problem(path: Path | None) -> str | None:
    """Why the policy file at `path` cannot be used (None: it can, or there is none)."""
    if path is None:
        return None
    try:
        load_policy(path)
    except PolicyError as exc:
        return f"{exc} (SANDBOX_POLICY_FILE)"
    return None


def load_policy(path: Path) -> Policy:
    """The policy in `path`. Raises PolicyError naming the file and the line or key."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"policy file {path}: cannot be read ({exc})") from None
    return parse_policy(text, str(path))


def parse_policy(text: str, where: str = "policy file") -> Policy:
    """The policy in TOML `text`. Raises PolicyError naming `where` and the line or key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # (its message names the line and column)
        raise PolicyError(f"{where}: not valid TOML: {exc}") from None
    for key in data:
        if key not in _SECTIONS:
            raise PolicyError(
                f"{where}: unknown key {key!r} at the top level (expected: default, "
                "[groups.NAME], [principals.NAME])"
            )
    default = _grant(data.get("default", {}), "default", where, groups_allowed=False)
    groups = {
        name: _grant(value, f"groups.{name}", where, groups_allowed=False)
        for name, value in _table(data.get("groups", {}), "groups", where).items()
    }
    principals = {
        name: _grant(value, f"principals.{name}", where, groups_allowed=True)
        for name, value in _table(data.get("principals", {}), "principals", where).items()
    }
    return Policy(default, groups, principals)


def _table(value: Any, key: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PolicyError(f"{where}: {key} must be a table ([{key}.NAME] sections)")
    return value


def _grant(value: Any, key: str, where: str, groups_allowed: bool) -> Grant:
    value = _table(value, key, where)
    allowed = ("scopes", "groups") if groups_allowed else ("scopes",)
    for name in value:
        if name not in allowed:
            raise PolicyError(
                f"{where}: {key}.{name} is not a known key (expected: {', '.join(allowed)})"
            )
    scopes = _strings(value.get("scopes", []), f"{key}.scopes", where)
    for i, scope in enumerate(scopes):
        if not _valid_scope(scope):
            raise PolicyError(
                f"{where}: {key}.scopes[{i}] = {scope!r} is not a scope of this server "
                f"(known: {EXECUTE}, {FILES}, {SNAPSHOTS}, servers:<name>, {EVERY_SERVER}, *)"
            )
    groups = _strings(value.get("groups", []), f"{key}.groups", where)
    return Grant(frozenset(scopes), tuple(groups))


def _strings(value: Any, key: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f'{where}: {key} must be a list of strings, like ["{EXECUTE}"]')
    return value


def _valid_scope(scope: str) -> bool:
    """Ours, `servers:*`, `*`, or a scope a catalog entry may require (`required_scope`); a
    misspelt `sandbox:` or `snapshot` scope is refused rather than granting nothing."""
    if scope in (EVERY, EXECUTE, FILES, SNAPSHOTS, EVERY_SERVER):
        return True
    if scope.startswith(("sandbox:", "snapshot")) or scope == SERVERS_PREFIX:
        return False
    return SCOPE_NAME.fullmatch(scope) is not None
