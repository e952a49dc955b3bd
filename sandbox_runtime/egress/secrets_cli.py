"""`srt-mcp-server secrets …`: set, list, remove secrets; make and change the store's key.

Values go in (stdin, an environment variable or a file) and never come out: `list` shows
names, principals, the hosts their rules bind and the last use. Settings (the store, the key,
the rules) come from the environment as the server reads them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.secrets import MAX_VALUE
from sandbox_runtime.egress import ca
from sandbox_runtime.egress.secrets import load_rules
from sandbox_runtime.egress.secrets_store import SecretsStore, load_key, make_key
from sandbox_runtime.errors import InvalidRequestError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="srt-mcp-server secrets",
        description="Secrets the egress proxy adds to requests (docs/secrets.md). Values are "
        "write-only: nothing here prints one.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    put = sub.add_parser("set", help="store a secret (the value from stdin unless a --from-*)")
    put.add_argument("name")
    source = put.add_mutually_exclusive_group()
    source.add_argument("--from-env", metavar="VAR", help="read the value from this variable")
    source.add_argument("--from-file", metavar="FILE", type=Path, help="read it from this file")
    put.add_argument("--principal", default="", help="only for this principal's sandboxes")
    listing = sub.add_parser("list", help="names, principals, bound hosts, last use")
    listing.add_argument("--json", action="store_true")
    remove = sub.add_parser("rm", help="remove a secret")
    remove.add_argument("name")
    remove.add_argument("--principal", default="")
    sub.add_parser("keygen", help="print a new random key for SANDBOX_SECRETS_KEY")
    authority = sub.add_parser("ca", help="make the deployment CA (ca.pem, ca.key) in a directory")
    authority.add_argument("directory", type=Path, nargs="?", help="default SANDBOX_EGRESS_CA_DIR")
    rekey = sub.add_parser("rekey", help="encrypt every secret under a new key")
    rekey.add_argument("--new-key-file", type=Path, required=True)
    return parser


READ_LIMIT = MAX_VALUE + 2  # characters read of a value: enough to tell one is too long


def _value(args: argparse.Namespace) -> str:
    if args.from_env:
        value = os.environ.get(args.from_env)
        if value is None:
            raise InvalidRequestError(f"the environment has no variable {args.from_env}")
        return value
    if args.from_file is not None:
        try:
            with args.from_file.open(encoding="utf-8", errors="surrogateescape") as file:
                text = file.read(READ_LIMIT)  # (past MAX_VALUE: check_value refuses it)
        except OSError as exc:
            raise InvalidRequestError(f"{args.from_file}: {exc.strerror}") from None
    else:
        if sys.stdin.isatty():
            print("value (then Enter):", file=sys.stderr)
        text = sys.stdin.readline(READ_LIMIT) if sys.stdin.isatty() else sys.stdin.read(READ_LIMIT)
    return text[:-1] if text.endswith("\n") else text


def _when(ts: float | None) -> str:
    if ts is None:
        return "never"
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def main(argv: Sequence[str]) -> int:
    """Run `secrets ACTION …`. Returns the exit code."""
    args = _parser().parse_args(list(argv))
    if args.action == "keygen":
        print(make_key())
        return 0
    try:
        environment_only: dict[str, Any] = {}
        settings = Settings(**environment_only)
    except (ValidationError, ValueError) as exc:
        print(f"invalid settings: {exc}", file=sys.stderr)
        return 2
    try:
        key = load_key(settings.secrets_key_bytes(), settings.secrets_key_file)
        store = SecretsStore(settings.secrets_store_path(), key)
        if args.action == "set":
            store.set(args.name, _value(args), args.principal)
            who = f" for principal {args.principal}" if args.principal else ""
            print(f"secret {args.name} stored{who}")
        elif args.action == "rm":
            store.remove(args.name, args.principal)
            print(f"secret {args.name} removed")
        elif args.action == "ca":
            directory = args.directory or settings.egress_ca_path()
            ca.load_or_create(directory)
            print(f"the deployment CA is {directory}/ca.pem (its key {directory}/ca.key, 0600)")
        elif args.action == "rekey":
            new = load_key(None, args.new_key_file)
            if new is None:
                raise InvalidRequestError(f"{args.new_key_file} is empty")
            count = store.rekey(new)
            print(f"{count} secrets encrypted under the new key: now set SANDBOX_SECRETS_KEY "
                  "(or the key file) to it on every replica and restart them")  # fmt: skip
        else:
            return _list(settings, store, args.json)
    except (InvalidRequestError, ValueError) as exc:
        print(f"secrets {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def _list(settings: Settings, store: SecretsStore, as_json: bool) -> int:
    rules = load_rules(settings.secrets_rules_path())
    rows = []
    for info in sorted(store.names(), key=lambda i: (i.name, i.principal)):
        bound = [r for r in rules if r.secret == info.name]
        rows.append(
            {
                "name": info.name,
                "principal": info.principal or "*",
                "rules": [r.name for r in bound],
                "hosts": sorted({str(h) for r in bound for h in r.hosts}),
                "created_at": _when(info.created_at),
                "last_used_at": _when(info.last_used_at),
            }
        )
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no secrets (store one: srt-mcp-server secrets set NAME < value-file)")
    for row in rows:
        hosts = ",".join(row["hosts"]) or "(no rule binds it)"
        print(f"{row['name']}\tprincipal={row['principal']}\thosts={hosts}\t"
              f"last_used={row['last_used_at']}")  # fmt: skip
    return 0
