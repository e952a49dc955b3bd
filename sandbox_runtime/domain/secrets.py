"""Secret rules: which stored secret goes into which header of requests to which hosts.

Pure logic, standard library only. The operator writes rules in a TOML file
(SANDBOX_SECRETS_RULES, default `<state_dir>/secrets.toml`):

    [[rule]]
    name = "openai"                                   # events, metrics and the audit log say it
    secret = "openai"                                 # `srt-mcp-server secrets set openai`
    hosts = ["api.openai.com"]                        # exact or *.suffix, optional :port
    headers = { Authorization = "Bearer {{secret:openai}}" }
    methods = ["POST"]                                # optional: only these methods
    paths = ["/v1/"]                                  # optional: only these path prefixes
    principals = ["alice"]                            # optional: only these principals

`basic = "user"` instead of `headers` sets `Authorization: Basic base64(user:secret)`. The
egress proxy sets (replaces) those headers on requests that match, whatever the code sent in
them (a placeholder such as `{{secret:openai}}`, or nothing); requests to any other host go
out exactly as the code sent them: a placeholder there is only a placeholder.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sandbox_runtime.domain.egress import Rule, parse_rules
from sandbox_runtime.errors import InvalidRequestError, PolicyViolationError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PLACEHOLDER = re.compile(r"\{\{secret:([A-Za-z0-9][A-Za-z0-9_.-]{0,63})\}\}")
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
# An escape still there once the path is decoded, of a character that matters to a path.
_DOUBLE_ENCODED = re.compile(r"%(2e|2f|5c|3b|25)", re.IGNORECASE)
MAX_VALUE = 8 * 1024  # bytes of one secret's value
MAX_RULES = 256
# Headers a rule may not set: they frame the request or address it.
FORBIDDEN_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te"}


def check_name(name: str, what: str = "secret") -> str:
    """`name` if it is a valid secret or rule name. Raises InvalidRequestError."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError(
            f"bad {what} name {name!r}: 1-64 of letters, digits, '_', '.', '-' (first: a letter "
            "or digit)"
        )
    return name


def check_value(value: str) -> str:
    """`value` if it can go into a header. Raises InvalidRequestError (never quoting it)."""
    raw = value.encode("utf-8", "surrogateescape")
    if not raw:
        raise InvalidRequestError("the secret's value is empty")
    if len(raw) > MAX_VALUE:
        raise InvalidRequestError(f"the secret's value is over {MAX_VALUE} bytes")
    if any(c < 0x20 or c == 0x7F for c in raw) or len(raw) < 4:
        raise InvalidRequestError(
            "the secret's value must be at least 4 printable characters on one line (a "
            "trailing newline is dropped)"
        )
    return value


@dataclass(frozen=True)
class SecretRule:
    """One binding of a secret to destinations and headers."""

    name: str
    secret: str
    hosts: tuple[Rule, ...]
    headers: tuple[tuple[str, str], ...]  # (name, template with {{secret:NAME}})
    basic_user: str | None = None
    methods: frozenset[str] = frozenset()  # empty: every method
    paths: tuple[str, ...] = ()  # empty: every path
    principals: frozenset[str] = frozenset()  # empty: every principal

    def binds(self, host: str, port: int, tls: bool = True) -> bool:
        """Whether requests to `host` (canonical) and `port` may carry this secret: over TLS
        (`tls`, a CONNECT the proxy terminates) or in clear. In clear only to a port the
        rule names (`host:80`, `host:8080`): a value sent in clear is readable on the way and
        goes to whatever answers, so a host without a port gets it over TLS only; and never
        in clear to port 443 (`http://host:443/`)."""
        if tls:
            return any(r.matches_name(host) and port in r.ports for r in self.hosts)
        return port != 443 and any(
            r.matches_name(host) and r.port is not None and r.port == port for r in self.hosts
        )

    def applies(self, method: str, path: str) -> bool:
        """Whether a request (to a host it binds) with `method` and `path` gets the headers."""
        if self.methods and method.upper() not in self.methods:
            return False
        if not self.paths:
            return True
        plain = urllib.parse.unquote(path)  # (`/v1/%2e%2e/admin` is not under /v1/)
        if _DOUBLE_ENCODED.search(plain) or "\\" in plain:
            return False  # (`%252e%252e` is `..` to an origin that decodes again)
        # A dot segment, with a path parameter too (`..;x`: Tomcat and Spring read it as `..`).
        if any(part.split(";", 1)[0] in (".", "..") for part in plain.split("/")):
            return False
        return any(plain.startswith(p) for p in self.paths)

    def render(self, value: str) -> list[tuple[str, str]]:
        """The headers with `value` in place of the placeholders."""
        out = [(n, PLACEHOLDER.sub(lambda _m: value, t)) for n, t in self.headers]
        if self.basic_user is not None:
            pair = f"{self.basic_user}:{value}".encode()
            out.append(("Authorization", "Basic " + base64.b64encode(pair).decode("ascii")))
        return out

    def describe(self) -> dict[str, Any]:
        """The rule without any value (list, doctor, health)."""
        return {
            "rule": self.name,
            "secret": self.secret,
            "hosts": [str(h) for h in self.hosts],
            "headers": [n for n, _ in self.headers]
            + (["Authorization"] if self.basic_user is not None else []),
            "methods": sorted(self.methods),
            "paths": list(self.paths),
            "principals": sorted(self.principals),
        }


@dataclass
class SecretsGrant:
    """Whose sandbox it is (the audit line says so) and which rules it may get: the
    principal's, narrowed to `names` (rule or secret names; None: all of them)."""

    principal: str
    session: str = ""
    execution_id: str = ""
    names: tuple[str, ...] | None = None
    on_used: Callable[[str, str, int], None] | None = None  # (rule, host, port)


def masks(value: str, rendered: list[tuple[str, str]]) -> list[bytes]:
    """What a response must not show: the value, and header values that carry it in another
    form (Basic's base64)."""
    found = {value.encode()}
    # As JSON writes it (an API error quoting the header it got): `"` and `\` escaped, and
    # `/` as `\/` too where a serializer does (PHP's, by default); a key with `/` or `+`
    # (an AWS secret key, base64) percent-encoded, as in a URL an origin sends back.
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    found |= {escaped.encode(), escaped.replace("/", "\\/").encode()}
    found.add(urllib.parse.quote(value, safe="").encode())
    for _, header in rendered:
        if value not in header and header.startswith("Basic "):
            found.add(header.split(" ", 1)[1].encode())
    return sorted((m for m in found if len(m) >= 4), key=len, reverse=True)


def _strings(raw: Any, where: str) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ValueError(f"{where} must be a list of strings")
    return raw


def parse_rule(raw: dict[str, Any]) -> SecretRule:
    """One `[[rule]]` table. Raises ValueError naming what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError("each [[rule]] must be a table")
    name = str(raw.get("name", ""))
    where = f"secret rule {name!r}"
    try:
        check_name(name, "rule")
        secret = check_name(str(raw.get("secret", name)))
    except InvalidRequestError as exc:
        raise ValueError(f"{where}: {exc}") from None
    unknown = set(raw) - {"name", "secret", "hosts", "headers", "basic", "methods", "paths",
                          "principals"}  # fmt: skip
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    hosts = parse_rules(",".join(_strings(raw.get("hosts"), f"{where}: hosts")))
    if not hosts:
        raise ValueError(f"{where}: hosts is empty (name the hosts the secret may go to)")
    headers_raw = raw.get("headers") or {}
    if not isinstance(headers_raw, dict):
        raise ValueError(f"{where}: headers must be a table of header name = template")
    headers: list[tuple[str, str]] = []
    for header, template in headers_raw.items():
        if not HEADER_NAME.fullmatch(header) or header.lower() in FORBIDDEN_HEADERS:
            raise ValueError(f"{where}: header {header!r} cannot be set")
        if not isinstance(template, str) or any(ord(c) < 0x20 for c in template):
            raise ValueError(f"{where}: header {header!r} must be a one-line string")
        named = set(PLACEHOLDER.findall(template))
        if named != {secret}:
            raise ValueError(
                f"{where}: header {header!r} must use {{{{secret:{secret}}}}} (and no other secret)"
            )
        headers.append((header, template))
    basic = raw.get("basic")
    if basic is not None and (not isinstance(basic, str) or ":" in basic):
        raise ValueError(f"{where}: basic must be the user name (without ':')")
    if not headers and basic is None:
        raise ValueError(f"{where}: give headers or basic (what the secret goes into)")
    methods = frozenset(m.upper() for m in _strings(raw.get("methods"), f"{where}: methods"))
    paths = tuple(_strings(raw.get("paths"), f"{where}: paths"))
    if any(not p.startswith("/") for p in paths):
        raise ValueError(f"{where}: paths must start with '/'")
    principals = frozenset(_strings(raw.get("principals"), f"{where}: principals"))
    return SecretRule(name, secret, tuple(hosts), tuple(headers), basic, methods, paths,
                      principals)  # fmt: skip


def parse_rules_document(document: dict[str, Any]) -> list[SecretRule]:
    """Every rule of a parsed TOML document (`[[rule]]` tables). Raises ValueError."""
    unknown = set(document) - {"rule"}
    if unknown:
        raise ValueError(f"secret rules: unknown tables {sorted(unknown)} (only [[rule]])")
    raw = document.get("rule", [])
    if not isinstance(raw, list):
        raise ValueError("secret rules: use [[rule]] tables")
    if len(raw) > MAX_RULES:
        raise ValueError(f"secret rules: more than {MAX_RULES}")
    rules = [parse_rule(r) for r in raw]
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        raise ValueError("secret rules: two rules have the same name")
    return rules


def for_principal(rules: Sequence[SecretRule], principal: str) -> list[SecretRule]:
    """The rules `principal`'s sandboxes may get."""
    return [r for r in rules if not r.principals or principal in r.principals]


def narrow(rules: Sequence[SecretRule], request: Sequence[str] | None) -> list[SecretRule]:
    """A caller's narrowing (`sandbox_config.secrets`: rule or secret names; None: all of
    `rules`). Raises PolicyViolationError for a name outside `rules` (never a widening)."""
    if request is None:
        return list(rules)
    wanted = set(request)
    known = {r.name for r in rules} | {r.secret for r in rules}
    outside = sorted(wanted - known)
    if outside:
        raise PolicyViolationError(
            f"sandbox_config.secrets: {', '.join(outside)} not among the secret rules this "
            f"principal has ({', '.join(sorted(known)) or 'none'}); a caller may only narrow them"
        )
    return [r for r in rules if r.name in wanted or r.secret in wanted]
