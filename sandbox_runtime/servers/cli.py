"""`srt-mcp-server servers …`: edit the hosted servers' catalog, install their packages, read
their logs."""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from sandbox_runtime.config import Settings, cli_name
from sandbox_runtime.servers.catalog import (
    NAME,
    SCOPES,
    Catalog,
    CatalogError,
    Entry,
    entry_from_source,
    load_catalog,
)
from sandbox_runtime.servers.catalog_file import save_catalog, unknown_name
from sandbox_runtime.servers.desktop import import_desktop_config
from sandbox_runtime.servers.installs import (
    INSTALL_MOUNT,
    Installed,
    install_entry,
    read_installed,
    remove_install,
)

LOG_LINES = 50
# `add`'s options whose dest is the entry's field, taken as they are when given.
SCALAR_FIELDS = "directory state scope memory_mb cpus pids call_timeout idle_timeout warm".split()
LIST_FIELDS = "principals tools_allow tools_deny egress".split()


Run = Callable[[argparse.Namespace, Settings], int]


class UsageError(Exception):
    """The command line is wrong (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes reach main() (one line, exit 2) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def main(argv: Sequence[str], settings: Settings | None = None) -> int:
    """Run `servers ACTION …` (argv: the words after `servers`). Settings come from the
    environment (`--state-dir`, `--file` override them) unless given. Returns the exit code:
    0 done, 1 failed, 2 a usage mistake."""
    words = list(argv)
    if words[:1] == ["servers"]:
        words = words[1:]
    try:
        args = _parse(words)
        settings = _settings(args, settings)
        run: Run = args.run
        return run(args, settings)
    except UsageError as exc:
        return _fail(str(exc), 2)
    except CatalogError as exc:
        return _fail(str(exc), 1)
    except OSError as exc:  # the state dir or the catalog cannot be written (not root?)
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}", 1)
    except SystemExit as exc:  # --help, --version: argparse has printed them
        return exc.code if isinstance(exc.code, int) else 0


def _fail(message: str, code: int) -> int:
    print(f"{cli_name()} servers: {message}", file=sys.stderr)
    return code


def _settings(args: argparse.Namespace, settings: Settings | None) -> Settings:
    overrides: dict[str, Any] = {}
    if getattr(args, "state_dir", None):
        overrides["state_dir"] = Path(args.state_dir)
    if getattr(args, "file", None):
        overrides["servers_file"] = Path(args.file)
    if settings is not None:
        return settings.model_copy(update=overrides)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"SANDBOX_{'.'.join(map(str, e['loc'])).upper()}: {e['msg']}" if e["loc"] else e["msg"]
            for e in exc.errors()
        )
        raise UsageError(f"invalid settings: {problems}") from None


# --- the command line --------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--state-dir", default=default, help="server state (SANDBOX_STATE_DIR)")
    parser.add_argument(
        "--file",
        default=default,
        metavar="PATH",
        help="the catalog (SANDBOX_SERVERS_FILE; default <state_dir>/servers.toml)",
    )


def _parse(words: list[str]) -> argparse.Namespace:
    top = _Parser(
        prog=f"{cli_name()} servers",
        description="The catalog of hosted MCP servers: add, list, remove, install, logs, import.",
    )
    _common(top, None)
    top.add_argument("action", choices=sorted(ACTIONS), help="what to do (ACTION --help)")
    top.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = top.parse_args(words)
    build, run = ACTIONS[args.action]
    sub = _Parser(prog=f"{cli_name()} servers {args.action}")
    _common(sub, argparse.SUPPRESS)  # (given before the action too: kept then)
    build(sub)
    rest: list[str] = args.rest
    tail: list[str] = []
    if "--" in rest:  # after it, words are the server's arguments even if they start with -
        cut = rest.index("--")
        rest, tail = rest[:cut], rest[cut + 1 :]
        if args.action != "add":
            raise UsageError(f"{args.action} takes no arguments after --")
    sub.parse_intermixed_args(rest, namespace=args)
    if tail:
        args.args = [*args.args, *tail]
    args.run = run
    return args


def _build_add(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Add a server. SOURCE is pypi:NAME[==VERSION], npm:NAME[@VERSION], an http(s) URL "
        "(a remote Streamable HTTP server) or a command; ARGS follow its program (put -- "
        "before ARGS that start with -)."
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("args", nargs="*", default=[], metavar="ARGS")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="a variable")
    p.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="K=env:NAME|file:/path",
        help="a variable whose value is read at start, from the server's environment or a file",
    )
    p.add_argument("--header", action="append", default=[], metavar="K=V", help="remote: a header")
    p.add_argument(
        "--directory",
        metavar="PATH",
        help="a command's host directory (its program and files), bound read-only at "
        f"{INSTALL_MOUNT}",
    )
    p.add_argument("--state", help="share the state directory of other entries naming it")
    p.add_argument("--scope", choices=SCOPES, help="one instance per principal (default), …")
    p.add_argument("--principal", dest="principals", action="append", help="who may use it")
    p.add_argument("--allow-tool", dest="tools_allow", action="append", help="only these tools")
    p.add_argument("--deny-tool", dest="tools_deny", action="append", help="not these tools")
    p.add_argument("--egress", action="append", help="a host it may reach (default: none)")
    p.add_argument("--memory-mb", type=int)
    p.add_argument("--cpus", type=float)
    p.add_argument("--pids", type=int)
    p.add_argument("--call-timeout", type=float, metavar="S")
    p.add_argument("--idle-timeout", type=float, metavar="S")
    p.add_argument("--warm", type=int, metavar="N", help="1: start it ahead of calls")
    p.add_argument("--replace", action="store_true", help="replace a server of this name")


def _build_list(p: argparse.ArgumentParser) -> None:
    p.description = "List the servers (never a variable's, secret's or header's value)."
    p.add_argument("--json", action="store_true", help="as JSON")


def _build_remove(p: argparse.ArgumentParser) -> None:
    p.description = "Remove a server and its install."
    p.add_argument("name", metavar="NAME")


def _build_install(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Install servers' packages ahead (default: every pypi: and npm: server); an instance "
        "never downloads at start."
    )
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--force", action="store_true", help="reinstall what is installed")


def _build_logs(p: argparse.ArgumentParser) -> None:
    p.description = "Print the end of a server's log (its instances' stderr)."
    p.add_argument("name", metavar="NAME")
    p.add_argument("--lines", "-n", type=int, default=LOG_LINES, metavar="N")


def _build_import(p: argparse.ArgumentParser) -> None:
    p.description = (
        'Add the servers of a desktop client\'s config ({"mcpServers": {…}}; - reads stdin).'
    )
    p.add_argument("path", metavar="FILE")
    p.add_argument("--replace", action="store_true", help="replace servers of the same names")


# --- the actions -------------------------------------------------------------------------


def _add(args: argparse.Namespace, settings: Settings) -> int:
    path = settings.servers_path()
    catalog = load_catalog(path)
    table: dict[str, Any] = {
        key: getattr(args, key) for key in SCALAR_FIELDS if getattr(args, key) is not None
    }
    table.update({key: getattr(args, key) for key in LIST_FIELDS if getattr(args, key)})
    for flag, given, key in (
        ("--env", args.env, "env"),
        ("--secret", args.secret, "secrets"),
        ("--header", args.header, "headers"),
    ):
        pairs = _pairs(flag, given)
        if pairs:
            table[key] = pairs
    old = catalog.get(args.name)
    if old is not None and not args.replace:
        raise CatalogError(
            f"the catalog already has a server named {args.name} ({_source(old)}): "
            "add --replace to replace it"
        )
    entry = entry_from_source(args.name, args.source, args.args, **table)
    save_catalog(path, catalog.with_entry(entry))
    if old is not None and old.package != entry.package:
        remove_install(settings.servers_dir(), entry.name)  # another package's (or none)
    print(f"{'replaced' if old else 'added'} {entry.name}: {_source(entry)} ({entry.scope} scope)")
    if entry.kind in ("pypi", "npm"):
        print(f"install it before use: {cli_name()} servers install {entry.name}")
    return 0


def _pairs(flag: str, items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} takes NAME=VALUE")  # (not echoed: it may be a secret)
        if key in out:
            raise UsageError(f"{flag} {key} is given twice")
        out[key] = value
    return out


def _list(args: argparse.Namespace, settings: Settings) -> int:
    path = settings.servers_path()
    catalog = load_catalog(path)
    servers_dir = settings.servers_dir()
    entries = [catalog.entries[name] for name in sorted(catalog.entries)]
    if args.json:
        described = [_describe(e, read_installed(servers_dir, e.name)) for e in entries]
        print(json.dumps(described, indent=1))
        return 0
    if not entries:
        print(f"no servers in {path} (add one: {cli_name()} servers add NAME SOURCE)")
        return 0
    rows = [("NAME", "KIND", "SOURCE", "SCOPE", "INSTALLED", "")]
    for e in entries:
        rows.append(
            (
                e.name,
                e.kind,
                _source(e),
                e.scope,
                _status(e, read_installed(servers_dir, e.name)),
                _names(e),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return 0


def _source(entry: Entry) -> str:
    program = entry.package or entry.url or shlex.join(entry.command)
    return " ".join([program, *(shlex.quote(a) for a in entry.args)])


def _status(entry: Entry, installed: Installed | None) -> str:
    if entry.kind not in ("pypi", "npm"):
        return "-"
    if installed is None:
        return "not installed"
    if installed.package != entry.package:
        return f"not installed ({installed.package} is)"
    return installed.version


def _names(entry: Entry) -> str:
    """The names of its variables, secrets and headers: their values are not shown."""
    parts = []
    for label, mapping in (("env", entry.env), ("secrets", entry.secrets)):
        if mapping:
            parts.append(f"{label}: {','.join(sorted(mapping))}")
    if entry.headers:
        parts.append(f"headers: {','.join(sorted(entry.headers))}")
    if entry.directory:
        parts.append(f"directory: {entry.directory}")
    return " ".join(parts)


def _describe(entry: Entry, installed: Installed | None) -> dict[str, Any]:
    out = entry.describe()
    if entry.command:
        out["command"] = list(entry.command)
    if entry.directory:
        out["directory"] = entry.directory
    out["args"] = list(entry.args)
    out["env"] = sorted(entry.env)  # names only, here and below
    out["secrets"] = sorted(entry.secrets)
    out["headers"] = sorted(entry.headers)
    out["principals"] = list(entry.principals)
    if entry.kind in ("pypi", "npm"):
        current = installed is not None and installed.package == entry.package
        out["installed"] = (
            {"version": installed.version, "installed_at": installed.installed_at}
            if current and installed is not None
            else None
        )
    return out


def _remove(args: argparse.Namespace, settings: Settings) -> int:
    path = settings.servers_path()
    catalog = load_catalog(path).without(args.name)
    save_catalog(path, catalog)
    remove_install(settings.servers_dir(), args.name)
    print(f"removed {args.name}")
    return 0


def _install(args: argparse.Namespace, settings: Settings) -> int:
    catalog = load_catalog(settings.servers_path())
    servers_dir = settings.servers_dir()
    names = args.names or [
        name for name in sorted(catalog.entries) if catalog.entries[name].kind in ("pypi", "npm")
    ]
    if not names:
        print("nothing to install: the catalog has no pypi: or npm: server")
        return 0
    failed = 0
    for name in names:
        entry = catalog.get(name)
        if entry is None:
            _fail(f"{name}: no server of this name in the catalog", 1)
            failed += 1
            continue
        before = read_installed(servers_dir, name)
        try:
            installed = install_entry(entry, servers_dir, force=args.force, log=_progress)
        except CatalogError as exc:
            _fail(str(exc), 1)
            failed += 1
            continue
        except Exception:  # one broken entry never stops the others: reported, then on
            traceback.print_exc()
            _fail(f"{name}: the install failed unexpectedly (above)", 1)
            failed += 1
            continue
        if installed is None:
            print(f"{name}: nothing to install ({entry.kind})")
        elif before is not None and before.installed_at == installed.installed_at:
            print(f"{name}: {entry.package} {installed.version} is installed (--force reinstalls)")
        else:
            print(f"{name}: installed {entry.package} {installed.version}")
    return 1 if failed else 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _logs(args: argparse.Namespace, settings: Settings) -> int:
    if not NAME.fullmatch(args.name):
        raise UsageError(f"{args.name!r} is not a server's name")
    if args.lines < 1:
        raise UsageError("--lines takes a positive number")
    path = settings.servers_dir() / "logs" / f"{args.name}.log"
    if not path.exists() and (close := unknown_name(settings.servers_path(), args.name)):
        raise CatalogError(f"no server named {args.name!r} {close}")
    try:
        with open(path, "rb") as f:
            tail = collections.deque(f, maxlen=args.lines)
    except FileNotFoundError:
        raise CatalogError(
            f"no log for {args.name} at {path}: no instance of it has run on this host"
        ) from None
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read it ({exc.strerror})") from None
    out = b"".join(tail).decode("utf-8", "replace")
    sys.stdout.write(out if out.endswith("\n") or not out else out + "\n")
    return 0


def _import(args: argparse.Namespace, settings: Settings) -> int:
    try:
        text = sys.stdin.read() if args.path == "-" else Path(args.path).read_text("utf-8")
    except OSError as exc:
        raise CatalogError(f"{args.path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise CatalogError(f"{args.path}: not UTF-8 text") from None
    path = settings.servers_path()
    catalog, report = import_desktop_config(text, load_catalog(path), replace_existing=args.replace)
    save_catalog(path, catalog)
    for line in report:
        print(f"imported {line}")
    if not report:
        print("the file names no servers")
    elif any(e.kind in ("pypi", "npm") for e in _imported(catalog, report)):
        print(f"install their packages before use: {cli_name()} servers install")
    return 0


def _imported(catalog: Catalog, report: list[str]) -> list[Entry]:
    names = (line.split(":", 1)[0] for line in report)
    return [e for e in (catalog.get(n) for n in names) if e is not None]


ACTIONS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Run]] = {
    "add": (_build_add, _add),
    "list": (_build_list, _list),
    "remove": (_build_remove, _remove),
    "install": (_build_install, _install),
    "logs": (_build_logs, _logs),
    "import": (_build_import, _import),
}
