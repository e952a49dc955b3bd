"""Adding and removing one client's entry: by the client's own CLI when it is installed (it
knows its file best), else by editing the file in place (`jsonc`, `toml_tables`) under the
lock of `files`. Either way the entry already there is read first: one that is already what
`connect` would write is left alone, so running it twice changes nothing."""

from __future__ import annotations

import copy
import difflib
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_runtime.connect import files, jsonc, toml_tables
from sandbox_runtime.connect.clients import Change, Client, Target

CLI_TIMEOUT = 60.0


class WiringError(Exception):
    """A client that cannot be wired as asked: says why and what to do."""


class MisreadError(ValueError):
    """An edit whose result, read back, is not the file with just the entry changed."""


@dataclass
class Outcome:
    changed: bool
    how: str  # "file", or the CLI command that did it
    path: Path
    backup: Path | None = None
    diff: str = ""  # --dry-run: what would change


def read_entries(client: Client, path: Path) -> dict[str, Any]:
    """The client's servers in `path` (name -> entry); {} without a file."""
    try:
        text = files.read_text(path)
        if text is None:
            return {}
        value: Any = toml_tables.loads(text) if client.fmt == "toml" else jsonc.loads(text)
    except (jsonc.JsoncError, toml_tables.TomlError) as exc:
        raise WiringError(f"{path}: cannot parse it ({exc}); fix it by hand first") from None
    except files.FileError as exc:
        raise WiringError(str(exc)) from None
    for key in client.container:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, dict) else {}


def _cli_commands(
    client: Client, scope: str, target: Target, change: Change
) -> tuple[list[str], list[str]] | None:
    """(add, remove) argv of the client's own CLI, None when it is not used for this."""
    if client.cli is None or shutil.which(client.cli) is None:
        return None
    name, url, var = target.name, target.url, target.token_env
    header = ["--header", f"Authorization: Bearer ${{{var}}}"] if var else []
    if client.key == "claude-code":
        add = ["claude", "mcp", "add", "--transport", "http", "--scope", scope, name, url]
        return [*add, *header], ["claude", "mcp", "remove", "--scope", scope, name]
    if client.key == "gemini":
        add = ["gemini", "mcp", "add", "--scope", scope, "--transport", "http", *header]
        return [*add, name, url], ["gemini", "mcp", "remove", "--scope", scope, name]
    if client.key == "codex" and scope == "user":
        token = ["--bearer-token-env-var", var] if var else []
        return ["codex", "mcp", "add", name, "--url", url, *token], ["codex", "mcp", "remove", name]
    if client.key == "vscode" and scope == "user" and not change.inputs:
        import json

        spec = json.dumps({"name": name, **change.entry})
        return ["code", "--add-mcp", spec], []
    return None


def _run(argv: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=CLI_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WiringError(f"`{shlex.join(argv)}` failed: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise WiringError(
            f"`{shlex.join(argv)}` exited {done.returncode}: {' / '.join(said)} "
            "(--no-cli edits the file instead)"
        )


def _inside_project(path: Path) -> None:
    """A project's file is edited only inside the project: a repository can hold a symlink
    (`.mcp.json -> /dev/null`, `.cursor -> /etc`) that would have it written elsewhere."""
    project = Path.cwd().resolve()
    real = path.resolve()
    if real != project and project not in real.parents:
        raise WiringError(
            f"{path} leads to {real}, outside the project ({project}): refused (edit it by "
            "hand, or run connect from that file's project)"
        )


def connect(client: Client, scope: str, target: Target, *, dry_run: bool, use_cli: bool) -> Outcome:
    path = client.file(scope)
    if path is None:
        other = "project" if scope == "user" else "user"
        raise WiringError(f"{client.title} has no {scope}-scope config (use --scope {other})")
    if scope == "project":
        _inside_project(path)
    try:
        change = client.build(target)
    except ValueError as exc:
        raise WiringError(f"{client.title}: {exc}") from None
    if change.secret and scope == "project":
        raise WiringError(
            f"{client.title} takes the token only as text, and {path.name} in a project is "
            "kept in its repository, where the token would be committed with it: use "
            "--scope user"
        )
    existing = read_entries(client, path).get(target.name)
    commands = _cli_commands(client, scope, target, change) if use_cli else None
    if commands is not None and existing == change.entry:
        return Outcome(False, "file", path)
    if commands is not None:
        add, remove = commands
        steps = ([remove] if existing is not None and remove else []) + [add]
        how = " && ".join(shlex.join(s) for s in steps)
        if not dry_run:
            for step in steps:
                _run(step, Path.cwd())
        return Outcome(True, how, path)
    return _edit(client, path, target.name, change, dry_run=dry_run, remove=False)


def disconnect(client: Client, scope: str, name: str, *, dry_run: bool, use_cli: bool) -> Outcome:
    path = client.file(scope)
    if path is None:
        raise WiringError(f"{client.title} has no {scope}-scope config")
    if scope == "project":
        _inside_project(path)
    if name not in read_entries(client, path):
        return Outcome(False, "file", path)
    dummy = Target("", name, None, None)
    commands = _cli_commands(client, scope, dummy, Change({}, False)) if use_cli else None
    if commands is not None and commands[1]:
        how = shlex.join(commands[1])
        if not dry_run:
            _run(commands[1], Path.cwd())
        return Outcome(True, how, path)
    return _edit(client, path, name, Change({}, False), dry_run=dry_run, remove=True)


def _edit(
    client: Client, path: Path, name: str, change: Change, *, dry_run: bool, remove: bool
) -> Outcome:
    try:
        if dry_run:  # (no lock: taking it would make the directory)
            real = path.resolve() if path.is_symlink() else path
            return _edit_locked(client, path, real, name, change, dry_run=True, remove=remove)
        with files.locked(path) as real:
            return _edit_locked(client, path, real, name, change, dry_run=False, remove=remove)
    except files.FileError as exc:
        raise WiringError(str(exc)) from None


def _edit_locked(
    client: Client, path: Path, real: Path, name: str, change: Change, *, dry_run: bool,
    remove: bool,
) -> Outcome:  # fmt: skip
    old = files.read_text(real)
    try:
        new = _edited(client, old or "", name, change, remove)
        _check(client, old or "", new, name, None if remove else change.entry)
    except (jsonc.JsoncError, toml_tables.TomlError, MisreadError) as exc:
        raise WiringError(f"{path}: cannot edit it ({exc}); fix it by hand first") from None
    if new == (old or "") or (old is None and remove):
        return Outcome(False, "file", path)
    diff = "".join(
        difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            new.splitlines(keepends=True),
            str(path),
            f"{path} (after)",
        )
    )
    if dry_run:
        return Outcome(True, "file", path, diff=diff)
    private = change.secret or _private(real)
    backup = files.replace(real, new, private=private)
    return Outcome(True, "file", path, backup)


def _check(client: Client, old: str, new: str, name: str, entry: dict[str, Any] | None) -> None:
    """The edited text read back is the old one with just `name`'s entry set (or gone): an
    editor misled by an odd file (a table header inside a multi-line string, an entry
    written inline) is caught here, before anything is written."""
    parse = toml_tables.loads if client.fmt == "toml" else jsonc.loads
    expected = copy.deepcopy(parse(old) if old.strip() else {})
    got = parse(new) if new.strip() else {}
    servers = expected
    for key in client.container:
        if not isinstance(servers.get(key), dict):
            servers[key] = {}  # (an entry being removed has its container)
        servers = servers[key]
    if entry is None:
        servers.pop(name, None)
    else:
        servers[name] = entry
    if client.key == "vscode":  # its `inputs` (the token's prompt) change with the entry
        expected.pop("inputs", None)
        got.pop("inputs", None)
    if got != expected and got != toml_tables.without_empty(expected, list(client.container)):
        how = "removing" if entry is None else "writing"
        raise MisreadError(
            f"{how} {name!r} would change more than its entry (is it written inline or in "
            "parts, or is a table header inside a multi-line string?)"
        )


def _private(path: Path) -> bool:
    """An existing file that is private stays so."""
    try:
        return path.stat().st_mode & 0o077 == 0
    except OSError:
        return False


def _edited(client: Client, text: str, name: str, change: Change, remove: bool) -> str:
    table = [*client.container, name]
    if client.fmt == "toml":
        if remove:
            out = toml_tables.remove_table(text, table)
            return text if out is None else out
        return toml_tables.set_table(text, table, change.entry)
    doc = jsonc.Document(text)
    if remove:
        entry = doc.get(table) or {}
        doc.remove(table)
        if doc.blank(list(client.container)):  # the object connect made goes with its entry
            doc.remove(list(client.container))
        if client.key == "vscode" and "${input:" in str(entry):
            _drop_unused_inputs(doc, client)
    else:
        doc.set(table, change.entry)
        for item in change.inputs:
            if not any(
                isinstance(i, dict) and i.get("id") == item["id"] for i in doc.get(["inputs"]) or []
            ):
                doc.append(["inputs"], item)
    return doc.rendered() if (text.strip() or not remove) else text


def _drop_unused_inputs(doc: jsonc.Document, client: Client) -> None:
    from sandbox_runtime.connect.clients import VSCODE_INPUT

    servers = doc.get(list(client.container)) or {}
    if f"${{input:{VSCODE_INPUT}}}" in str(servers):
        return  # another entry (a hosted server's) still asks for it
    for item in list(doc.get(["inputs"]) or []):
        if isinstance(item, dict) and item.get("id") == VSCODE_INPUT:
            doc.remove_item(["inputs"], item)
    if doc.get(["inputs"]) == []:
        doc.remove(["inputs"])  # (connect made it)
