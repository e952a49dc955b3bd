"""The server's side of secrets at the proxy: rules and store in, each sandbox's bindings out.

`SecretsBroker` holds the operator's rules (domain/secrets.py), the encrypted store
(secrets_store.py) and the deployment CA (ca.py). For each sandbox the egress supervisor
opens, it renders the rules the sandbox's grant allows with the principal's values — that
is the only place a value leaves the store, and it goes to the proxy over its control
channel, nowhere else. Each use the proxy reports becomes one audit log line (principal,
session, execution, host, rule, secret name), a metric and an event, never the value.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.egress import parse_rules
from sandbox_runtime.domain.secrets import (
    SecretRule,
    SecretsGrant,
    for_principal,
    masks,
    narrow,
    parse_rules_document,
)
from sandbox_runtime.egress import ca
from sandbox_runtime.egress.secrets_store import SecretsKeyError, SecretsStore, load_key


def load_rules(path: Path) -> list[SecretRule]:
    """The rules in `path` (none if it does not exist). Raises ValueError."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ValueError(f"secret rules {path}: {exc.strerror}") from None
    try:
        return parse_rules_document(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"secret rules {path}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


class SecretsBroker:
    """Rules, store and CA, for the egress supervisor."""

    def __init__(
        self,
        rules: list[SecretRule],
        store: SecretsStore,
        ca_dir: Path,
        trust_dir: Path,
        upstream_cas: bytes = b"",
    ) -> None:
        self.rules = rules
        self.store = store
        self.ca_cert, self.ca_key = ca.load_or_create(ca_dir)
        self.bundle = ca.write_bundle(trust_dir, self.ca_cert)
        self.upstream_cas = upstream_cas

    def tls_message(self) -> dict[str, Any]:
        """What the proxy needs to terminate TLS (op "tls")."""
        return {
            "op": "tls",
            "cert": self.ca_cert.decode(),
            "key": self.ca_key.decode(),
            "upstream_cas": self.upstream_cas.decode("ascii", "replace"),
        }

    def bindings(self, grant: SecretsGrant | None) -> list[dict[str, Any]]:
        """The rules `grant`'s sandbox gets, rendered with its principal's values (a rule whose
        secret is not stored is left out, with a warning)."""
        if grant is None:
            return []
        out: list[dict[str, Any]] = []
        for rule in narrow(for_principal(self.rules, grant.principal), grant.names):
            try:
                value = self.store.value(rule.secret, grant.principal)
            except SecretsKeyError as exc:
                logger.error("secret rule {}: {}", rule.name, exc)
                continue
            if value is None:
                logger.warning(
                    "secret rule {}: no secret {!r} stored for principal {} (set it with "
                    "`srt-mcp-server secrets set {}`)",
                    rule.name,
                    rule.secret,
                    grant.principal,
                    rule.secret,
                )
                continue
            rendered = rule.render(value)
            out.append(
                {
                    "rule": rule.name,
                    "secret": rule.secret,
                    "hosts": [str(h) for h in rule.hosts],
                    "headers": rendered,
                    "methods": sorted(rule.methods),
                    "paths": list(rule.paths),
                    "masks": [m.decode() for m in masks(value, rendered)],
                }
            )
        return out

    def used(self, grant: SecretsGrant | None, message: dict[str, Any]) -> None:
        """The proxy put a secret into a request: the audit line, last use, the event."""
        rule, secret = str(message.get("rule")), str(message.get("secret"))
        host, port = str(message.get("host")), int(message.get("port") or 0)
        principal = grant.principal if grant is not None else ""
        logger.bind(audit="secret").info(
            "secret used: rule={} secret={} host={}:{} method={} path={} principal={} "
            "session={} execution={}",
            rule,
            secret,
            host,
            port,
            message.get("method"),
            message.get("path"),
            principal,
            grant.session if grant is not None else "",
            grant.execution_id if grant is not None else "",
        )
        self.store.mark_used(secret, principal)
        if grant is not None and grant.on_used is not None and message.get("event"):
            grant.on_used(rule, host, port)

    def for_instance(self, name: str, principal: str, egress: list[str]) -> str:
        """What a hosted server's `secrets = { VAR = "secret:NAME" }` puts in VAR: the
        placeholder when a rule of `principal`'s binds NAME to a host the entry may reach (the
        proxy adds the value; the instance never has it), else the stored value. Raises
        ValueError (not stored), SecretsKeyError."""
        reachable = parse_rules(",".join(egress))
        for rule in for_principal(self.rules, principal):
            if rule.secret == name and any(
                h.covers(e) or e.covers(h) for h in rule.hosts for e in reachable
            ):
                return f"{{{{secret:{name}}}}}"
        value = self.store.value(name, principal)
        if value is None:
            raise ValueError(
                f"no secret {name!r} is stored (set it with `srt-mcp-server secrets set {name}`)"
            )
        return value

    def describe(self) -> list[dict[str, Any]]:
        """The rules, with no value (for `secrets list`, doctor and health)."""
        return [r.describe() for r in self.rules]


def broker_from_settings(settings: Settings, trust_dir: Path) -> SecretsBroker | None:
    """The secret rules, store and CA the settings name (None: no rule, nothing to inject).
    Raises ValueError (bad rules, no key, a CA that cannot be made)."""
    rules = load_rules(settings.secrets_rules_path())
    if not rules:
        return None
    key = load_key(settings.secrets_key_bytes(), settings.secrets_key_file)
    if key is None:
        raise ValueError(
            f"{len(rules)} secret rules but no secrets key: set SANDBOX_SECRETS_KEY or "
            "SANDBOX_SECRETS_KEY_FILE (make one with `srt-mcp-server secrets keygen`)"
        )
    upstream = b""
    if settings.egress_upstream_ca_file is not None:
        upstream = settings.egress_upstream_ca_file.read_bytes()
    try:
        return SecretsBroker(
            rules,
            SecretsStore(settings.secrets_store_path(), key),
            settings.egress_ca_path(),
            trust_dir,
            upstream,
        )
    except OSError as exc:
        raise ValueError(
            f"the deployment CA in {settings.egress_ca_path()}: {exc.strerror} (make it where "
            "it can be written: `srt-mcp-server secrets ca DIRECTORY`)"
        ) from None


def settings_problem(settings: Settings) -> str | None:
    """Why the secret settings cannot work (bad rules, rules without a key), checked before
    the server starts; None when they can."""
    try:
        rules = load_rules(settings.secrets_rules_path())
        key = load_key(settings.secrets_key_bytes(), settings.secrets_key_file)
    except (ValueError, SecretsKeyError) as exc:
        return str(exc)
    if rules and key is None:
        return (
            f"{settings.secrets_rules_path()} has {len(rules)} secret rules but there is no "
            "secrets key: set SANDBOX_SECRETS_KEY or SANDBOX_SECRETS_KEY_FILE (make one with "
            "`srt-mcp-server secrets keygen`)"
        )
    if not rules or not settings.egress_policy().enabled or settings.role == "api":
        return None  # (no broker is made: nothing below is read)
    if settings.egress_upstream_ca_file is not None:
        problem = ca.upstream_problem(settings.egress_upstream_ca_file)
        if problem:
            return problem
    return ca.problem(settings.egress_ca_path())
