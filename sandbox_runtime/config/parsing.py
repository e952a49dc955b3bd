"""The settings' small languages, parsed; and what is derived from several settings.

Pure functions of plain values (no environment, no model): `Settings` (settings.py) calls
them from its validators and methods. Each raises ValueError with a message naming the
setting.
"""

from __future__ import annotations

from collections.abc import Iterable

from sandbox_runtime.domain.egress import is_ip, parse_authority


def choice(value: str, allowed: Iterable[str], message: str) -> str:
    """`value` lower-cased if it is one of `allowed` (lower-case), else ValueError(message)."""
    value = value.lower()
    if value not in allowed:
        raise ValueError(message)
    return value


def tokens(auth_token: str, auth_tokens: str) -> dict[str, str]:
    """token -> principal: `auth_token` (principal `default`) and each `principal:token` of
    the comma-separated `auth_tokens` (blanks skipped; tokens of at least 8 characters)."""
    out: dict[str, str] = {}
    if auth_token:
        out[auth_token] = "default"
    for item in auth_tokens.split(","):
        if not item.strip():
            continue
        principal, sep, token = item.strip().partition(":")
        if not sep or not principal or not token:
            raise ValueError("SANDBOX_AUTH_TOKENS entries must look like principal:token")
        if len(token) < 8:
            raise ValueError(f"the token of principal {principal!r} is under 8 characters")
        out[token] = principal
    return out


def warm_interpreters(text: str) -> dict[str, int]:
    """language -> interpreters to keep started ahead, from `python=1,bash=0` (a bare
    language: 1). Raises ValueError for a count that is not a number."""
    out: dict[str, int] = {}
    for item in text.split(","):
        if item.strip():
            language, _, count = item.strip().partition("=")
            out[language.strip().lower()] = int(count or 1)
    return out


def resolvers(text: str) -> list[tuple[str, int]]:
    """(address, port) of each DNS server `host[:port]` (default 53) the comma-separated
    `text` names; each must be an IP address. Raises ValueError or EgressDenied."""
    out: list[tuple[str, int]] = []
    for item in text.split(","):
        if item.strip():
            host, port = parse_authority(item.strip(), 53)
            if not is_ip(host):
                raise ValueError(f"SANDBOX_EGRESS_RESOLVER: {item!r} is not an IP address")
            out.append((host, port))
    return out


def cluster_bind(
    host: str, port: int, cluster_host: str | None, cluster_port: int | None
) -> tuple[str, int]:
    """(host, port) of the cluster listener: its own settings, else the public host and the
    public port + 1 (any free port when the public one is 0 or the last)."""
    bound = cluster_host or host
    if cluster_port is not None:
        return bound, cluster_port
    return bound, 0 if port in (0, 65535) else port + 1


def inode_count(workspace_mb: int, workspace_inodes: int | None) -> int:
    """Inodes per workspace image: the setting (or one per 16 KiB), at most one per KiB."""
    wanted = workspace_inodes or workspace_mb * 64
    return max(256, min(wanted, workspace_mb * 1024))


def environments_allow(text: str) -> dict[str, set[str]]:
    """SANDBOX_ENVIRONMENTS_ALLOW as {principal: names} ("*" for every principal not named,
    "*" among names for every environment). Empty text: {} (everyone may use everything).
    Raises ValueError naming the entry that is not `principal=name,name`."""
    allow: dict[str, set[str]] = {}
    for entry in text.replace("\n", ";").split(";"):
        if not entry.strip():
            continue
        principal, sep, names = entry.partition("=")
        if not sep or not principal.strip():
            raise ValueError(f"SANDBOX_ENVIRONMENTS_ALLOW entry {entry.strip()!r} is not "
                             "PRINCIPAL=NAME,NAME (e.g. `alice=r,go;*=default`)")  # fmt: skip
        chosen = {n.strip() for n in names.split(",") if n.strip()}
        allow.setdefault(principal.strip(), set()).update(chosen)
    return allow


def comma_list(value: str | None) -> list[str]:
    """The non-blank items of a comma-separated setting."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def oauth(issuers: list[str], resource: str | None) -> None:
    """Checks the OAuth settings together: an issuer needs the resource, URLs are http(s)."""
    if issuers and not resource:
        raise ValueError(
            "SANDBOX_OAUTH_ISSUER needs SANDBOX_OAUTH_RESOURCE: this server's URL as clients "
            "reach it (e.g. https://sandbox.example.com/mcp), the audience its tokens must name"
        )
    for url in [*issuers, *([resource] if resource else [])]:
        if not url.startswith(("https://", "http://")):
            raise ValueError(f"OAuth settings: {url!r} must be an http(s) URL")
    if resource and "#" in resource:
        raise ValueError("SANDBOX_OAUTH_RESOURCE must not have a fragment (RFC 8707)")
