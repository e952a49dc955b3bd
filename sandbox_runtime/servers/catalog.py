"""The catalog of hosted MCP servers: what the operator configured, read from and written to
one TOML file (`SANDBOX_SERVERS_FILE`).

An entry is a stdio server named by package (`pypi:NAME[==VERSION]`, `npm:NAME[@VERSION]`)
or by a local command, or a remote Streamable HTTP server named by URL. Secrets are
references (`env:NAME` or `file:PATH`), resolved only when an instance starts or a remote is
called: the catalog, `servers list` and `list_servers` never hold or show their values. A
remote's URL is shown to principals without its user, password, query or fragment.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple
from urllib.parse import unquote, urlsplit, urlunsplit

from sandbox_runtime.errors import InvalidRequestError

NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
PYPI_SPEC = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?((==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!_-]+)?"
)
NPM_SPEC = re.compile(
    r"(@[a-z0-9][a-z0-9._~-]*/)?[a-z0-9][a-z0-9._~-]*(@[A-Za-z0-9.^~<>=|*+_ -]+)?"
)
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}")
MAX_ENTRIES = 64
MAX_MESSAGE_KB = 65536
MAX_TEXT = 4096  # one value (an argument, a URL, a variable's value)
MAX_ITEMS = 128  # one list or table
Scope = Literal["principal", "session", "shared"]
SCOPES: tuple[Scope, ...] = ("principal", "session", "shared")


class CatalogError(InvalidRequestError):
    """The catalog file, or an entry, is not valid: the message names the entry and field."""


@dataclass(frozen=True)
class Entry:
    """One hosted server as the operator configured it."""

    name: str
    package: str = ""  # pypi:SPEC | npm:SPEC ("": a command or a url)
    command: tuple[str, ...] = ()  # a local command (argv) when there is no package
    args: tuple[str, ...] = ()  # after the package's program, or the command
    # A command's host directory (its program and files), bound read-only at /opt/srt-server
    directory: str = ""
    # The environment a command runs on (docs/environments.md; "": default)
    image: str = ""
    # Entries naming the same state share their state directory (per principal, or session)
    state: str = ""
    url: str = ""  # a remote Streamable HTTP server
    headers: Mapping[str, str] = field(default_factory=dict)  # remote only; values may be refs
    env: Mapping[str, str] = field(default_factory=dict)  # given to the instance as they are
    secrets: Mapping[str, str] = field(default_factory=dict)  # VAR -> env:NAME | file:PATH
    scope: Scope = "principal"
    principals: tuple[str, ...] = ()  # who may use it (empty: every principal)
    tools_allow: tuple[str, ...] = ()  # only these tools (empty: all)
    tools_deny: tuple[str, ...] = ()
    egress: tuple[str, ...] = ()  # names (as SANDBOX_EGRESS_ALLOW) it may reach; () no network
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 128
    call_timeout: float = 60.0  # seconds one request may take
    max_message_kb: int = 4096  # the largest JSON-RPC message it may send
    idle_timeout: float = 600.0  # seconds without a call before an instance stops
    warm: int = 0  # 1: started ahead (shared: with the server; else at a client's initialize)
    # The OAuth scope a caller needs to use it (policy file); "": servers:<name>
    required_scope: str = ""

    @property
    def kind(self) -> Literal["pypi", "npm", "command", "remote"]:
        if self.url:
            return "remote"
        if self.package.startswith("pypi:"):
            return "pypi"
        if self.package.startswith("npm:"):
            return "npm"
        return "command"

    @property
    def package_spec(self) -> str:
        """The package's requirement without its registry prefix."""
        return self.package.split(":", 1)[1] if ":" in self.package else ""

    def allows_principal(self, principal: str) -> bool:
        return not self.principals or principal in self.principals

    def allows_tool(self, tool: str) -> bool:
        if self.tools_allow and tool not in self.tools_allow:
            return False
        return tool not in self.tools_deny

    def filter_tools(self, listed: dict[str, Any]) -> dict[str, Any]:
        """A tools/list result without the tools this entry does not allow."""
        tools = listed.get("tools")
        if not isinstance(tools, list) or not (self.tools_allow or self.tools_deny):
            return listed
        kept = [t for t in tools if isinstance(t, dict) and self.allows_tool(str(t.get("name")))]
        return {**listed, "tools": kept}

    def describe(self) -> dict[str, Any]:
        """What a principal may see: no environment values, no secrets, no headers' values."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "scope": self.scope}
        if self.package:
            out["package"] = self.package
        if self.url:
            out["url"] = shown_url(self.url)
        if self.tools_allow:
            out["tools_allow"] = list(self.tools_allow)
        if self.tools_deny:
            out["tools_deny"] = list(self.tools_deny)
        out["network"] = list(self.egress)
        return out

    def as_table(self) -> dict[str, Any]:
        """The entry as the catalog file stores it (defaults left out)."""
        default = Entry(name=self.name)
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def parse_entry(name: str, table: Mapping[str, Any]) -> Entry:
    """An Entry from its TOML table. Raises CatalogError naming the entry and the field."""
    where = f"servers.{name}"
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise CatalogError(
            f"{where}: a server's name is 1-48 of a-z 0-9 _ - starting with a letter or digit"
        )
    if not isinstance(table, Mapping):
        raise CatalogError(f"{where} must be a table")
    known = {f.name for f in fields(Entry)} - {"name"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise CatalogError(
            f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    values: dict[str, Any] = {}
    for key, value in table.items():
        values[key] = _field(where, key, value)
    entry = Entry(name=name, **values)
    _check_entry(where, entry)
    return entry


def _field(where: str, key: str, value: Any) -> Any:
    at = f"{where}.{key}"
    if key in ("package", "url", "scope", "directory", "state", "image", "required_scope"):
        return _text(at, value)
    if key in ("command", "args", "principals", "tools_allow", "tools_deny", "egress"):
        if isinstance(value, str) and key != "command" and key != "args":
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise CatalogError(f"{at} must be a list of strings")
        if len(value) > MAX_ITEMS:
            raise CatalogError(f"{at}: at most {MAX_ITEMS} items")
        return tuple(_text(at, v) for v in value)
    if key in ("headers", "env", "secrets"):
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise CatalogError(f"{at} must be a table of strings")
        if len(value) > MAX_ITEMS:
            raise CatalogError(f"{at}: at most {MAX_ITEMS} items")
        pattern = HEADER_NAME if key == "headers" else ENV_NAME
        for k, v in value.items():
            if not pattern.fullmatch(k):
                raise CatalogError(f"{at}: {k!r} is not a valid name")
            _text(f"{at}.{k}", v)
            if key == "headers" and v.startswith("file:") and not v[5:].startswith("/"):
                raise CatalogError(f"{at}.{k}: file: takes an absolute path")
        return dict(value)
    if key == "max_message_kb" and isinstance(value, int) and value > MAX_MESSAGE_KB:
        raise CatalogError(f"{at}: at most {MAX_MESSAGE_KB} (64 MiB)")
    if key in ("memory_mb", "pids", "max_message_kb", "warm"):
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < 0
            or (value == 0 and key != "warm")
        ):
            raise CatalogError(f"{at} must be a positive whole number")
        return value
    if key in ("cpus", "call_timeout", "idle_timeout"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CatalogError(f"{at} must be a number")
        if not math.isfinite(value) or value <= 0:
            raise CatalogError(f"{at} must be a positive number")
        return float(value)
    raise CatalogError(f"{at}: unknown field")  # (parse_entry checked the names)


def _text(at: str, value: Any) -> str:
    if not isinstance(value, str):
        raise CatalogError(f"{at} must be a string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate (from JSON's \ud800): no file can hold it
        raise CatalogError(f"{at}: not valid Unicode text") from None
    if "\x00" in value or size > MAX_TEXT:
        raise CatalogError(f"{at}: no NUL bytes, at most {MAX_TEXT} bytes")
    return value


def _check_entry(where: str, entry: Entry) -> None:
    sources = [bool(entry.package), bool(entry.command), bool(entry.url)]
    if sum(sources) != 1:
        raise CatalogError(f"{where}: give exactly one of package, command or url")
    if entry.command and not entry.command[0]:
        raise CatalogError(f"{where}.command: its first item, the program, is empty")
    if entry.image and not entry.command:
        raise CatalogError(
            f"{where}.image: only a command runs on an environment (a package's install runs "
            "on default's runtime)"
        )
    if entry.package:
        prefix, _, spec = entry.package.partition(":")
        if prefix == "pypi":
            if not PYPI_SPEC.fullmatch(spec):
                raise CatalogError(
                    f"{where}.package: {spec!r} is not a PyPI requirement (NAME or NAME==VERSION)"
                )
        elif prefix == "npm":
            if not NPM_SPEC.fullmatch(spec):
                raise CatalogError(
                    f"{where}.package: {spec!r} is not an npm package "
                    "(NAME or @SCOPE/NAME, with @VERSION)"
                )
        else:
            raise CatalogError(
                f"{where}.package must start with pypi: or npm: (got {entry.package!r})"
            )
    if entry.url:
        if not re.fullmatch(r"https?://[^\s]+", entry.url):
            raise CatalogError(f"{where}.url must be an http:// or https:// URL")
        for key in ("command", "args", "env", "secrets", "egress"):
            if getattr(entry, key):
                raise CatalogError(
                    f"{where}.{key}: a remote server runs elsewhere; it has no {key}"
                )
    elif entry.headers:
        raise CatalogError(f"{where}.headers: only a remote (url) server has headers")
    if entry.state and not NAME.fullmatch(entry.state):
        raise CatalogError(f"{where}.state: a name like a server's (a-z 0-9 _ -)")
    if entry.directory and (not entry.command or not entry.directory.startswith("/")):
        raise CatalogError(f"{where}.directory: an absolute host path, for a command entry only")
    if entry.scope not in SCOPES:
        raise CatalogError(f"{where}.scope must be one of {', '.join(SCOPES)}")
    if entry.warm > 1:
        raise CatalogError(f"{where}.warm: 0 or 1 (an owner has one instance)")
    for var, ref in entry.secrets.items():
        if (
            not (ref.startswith("env:") and ENV_NAME.fullmatch(ref[4:]))
            and not (ref.startswith("file:") and ref[5:].startswith("/"))
            and not (ref.startswith("secret:") and SECRET_NAME.fullmatch(ref[7:]))
        ):
            raise CatalogError(
                f"{where}.secrets.{var} must be env:NAME (from the server's environment), "
                "file:/absolute/path or secret:NAME (the secrets store)"
            )
    overlap = set(entry.env) & set(entry.secrets)
    if overlap:
        raise CatalogError(f"{where}: {', '.join(sorted(overlap))} in both env and secrets")


SECRET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def resolve_secret(ref: str, environ: Mapping[str, str] | None = None) -> str:
    """The value a secret reference names. Raises CatalogError (naming the reference, never
    a value)."""
    environ = os.environ if environ is None else environ
    if ref.startswith("env:"):
        if ref[4:] not in environ:
            raise CatalogError(
                f"secret {ref} is not set (the server's environment has no {ref[4:]})"
            )
        return environ[ref[4:]]
    if ref.startswith("file:"):
        try:
            with open(ref[5:], encoding="utf-8") as f:
                value = f.read(MAX_TEXT + 1)
        except OSError as exc:
            raise CatalogError(f"secret {ref}: cannot read it ({exc.strerror})") from None
        if len(value) > MAX_TEXT:
            raise CatalogError(f"secret {ref}: longer than {MAX_TEXT} bytes")
        return value.strip("\r\n")
    return ref  # (a literal: headers may hold one)


def missing_secret(entry: Entry, environ: Mapping[str, str] | None = None) -> str | None:
    """Why a secret the entry references (its `secrets`, its headers' env:/file: values)
    cannot be had now, naming the reference; None when each can."""
    refs = [*entry.secrets.values()]
    refs += [v for v in entry.headers.values() if v.startswith(("env:", "file:"))]
    for ref in refs:
        try:
            resolve_secret(ref, environ)
        except CatalogError as exc:
            return str(exc)
    return None


def shown_url(url: str) -> str:
    """`url` as principals may see it: scheme://host[:port]/path, without user, password,
    query or fragment (they may hold credentials)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:  # (a port that is not a number: the user part may be in it)
        return "(a URL that does not parse)"
    if ":" in host:
        host = f"[{host}]"
    path = parts.path if "@" not in parts.path else "/…"  # (a password holding a /)
    return urlunsplit((parts.scheme, host if port is None else f"{host}:{port}", path, "", ""))


def url_secrets(url: str) -> list[str]:
    """The parts of `url` that shown_url leaves out, as written and decoded (what an
    error's text must not hold)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    userinfo = parts.netloc.rpartition("@")[0]
    found = [userinfo, *userinfo.split(":", 1), parts.query, parts.fragment]
    found += [pair.partition("=")[2] for pair in parts.query.split("&")]
    found += [unquote(v) for v in found]
    return sorted({v for v in found if v}, key=len, reverse=True)


@dataclass(frozen=True)
class Catalog:
    """Every entry, by name."""

    entries: Mapping[str, Entry] = field(default_factory=dict)

    def get(self, name: str) -> Entry | None:
        return self.entries.get(name)

    def for_principal(self, principal: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.allows_principal(principal)]

    def with_entry(self, entry: Entry) -> Catalog:
        if entry.name not in self.entries and len(self.entries) >= MAX_ENTRIES:
            raise CatalogError(f"the catalog holds at most {MAX_ENTRIES} servers")
        return Catalog({**self.entries, entry.name: entry})

    def without(self, name: str) -> Catalog:
        if name not in self.entries:
            raise CatalogError(f"no server named {name!r} in the catalog")
        return Catalog({k: v for k, v in self.entries.items() if k != name})


class Broken(NamedTuple):
    """An entry left out of the catalog: its name, who may use it (empty: everyone; None: it
    cannot be told, the list itself being invalid) and the error (the operator's words)."""

    name: str
    principals: tuple[str, ...] | None
    text: str


def _principals_of(table: Any) -> tuple[str, ...] | None:
    listed = table.get("principals", []) if isinstance(table, dict) else None
    listed = [listed] if isinstance(listed, str) else listed  # (as _field reads it)
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        return None
    return tuple(listed)


def parse_catalog(
    text: str, source: str = "catalog", broken: list[Broken] | None = None
) -> Catalog:
    """The catalog in `text`. Raises CatalogError; with `broken`, an entry that is not valid
    is left out and its error added there instead (the others still load)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{source}: not valid TOML ({exc})") from None
    servers = data.get("servers", {})
    extra = sorted(set(data) - {"servers"})
    if extra:
        raise CatalogError(
            f"{source}: unknown top-level key(s) {', '.join(extra)} "
            "(entries go under [servers.NAME])"
        )
    if not isinstance(servers, dict):
        raise CatalogError(f"{source}: servers must be a table of [servers.NAME] tables")
    if len(servers) > MAX_ENTRIES:
        raise CatalogError(f"{source}: at most {MAX_ENTRIES} servers")
    entries = {}
    for name, table in servers.items():
        try:
            entries[name] = parse_entry(name, table)
        except CatalogError as exc:
            if broken is None:
                raise
            broken.append(Broken(name, _principals_of(table), str(exc)))
    return Catalog(entries)


def load_catalog(path: Path, broken: list[Broken] | None = None) -> Catalog:
    """The catalog at `path` (none there: empty). Raises CatalogError (see parse_catalog for
    `broken`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Catalog()
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise CatalogError(f"{path}: not UTF-8 text") from None
    return parse_catalog(text, str(path), broken)


def entry_from_source(name: str, source: str, args: Iterable[str] = (), **table: Any) -> Entry:
    """An entry from the CLI's words: `pypi:…`, `npm:…`, an http(s) URL, or a command."""
    values: dict[str, Any] = dict(table)
    if source.startswith(("pypi:", "npm:")):
        values["package"] = source
    elif source.startswith(("http://", "https://")):
        values["url"] = source
    else:
        values["command"] = [source]
    if args:
        values["args"] = list(args)
    return parse_entry(name, values)


def with_changes(entry: Entry, **changes: Any) -> Entry:
    """The entry with `changes` (table values), checked again."""
    table = {**entry.as_table(), **changes}
    return parse_entry(entry.name, table) if table else replace(entry)
