"""Setting or removing one `[mcp_servers.NAME]` table of a TOML file (Codex's config.toml),
every other line kept as it was (comments, other tables, their order).

A table is its header line, the lines up to the next header that is not one of its own
sub-tables (`[mcp_servers.NAME.env]`). Reading goes through `tomllib`; the result of an edit
is parsed again before it is written, so an edit never leaves a file the client cannot read.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from typing import Any

HEADER = re.compile(r"^\s*\[\[?\s*(?P<path>[^\]]+?)\s*\]\]?\s*(#.*)?$")


class TomlError(ValueError):
    """The file is not TOML, or the edit would not be."""


def loads(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TomlError(str(exc)) from None


def _path(header: str) -> list[str]:
    """The keys of a table header (`mcp_servers."a.b"` -> ['mcp_servers', 'a.b'])."""
    return [
        json.loads(part) if part.startswith('"') else part.strip("'")
        for part in re.findall(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'|[^.\s]+', header)
    ]


def _span(lines: list[str], table: list[str]) -> tuple[int, int] | None:
    """The [start, end) lines of `table` and its sub-tables; None when it has no header."""
    start = None
    for i, line in enumerate(lines):
        match = HEADER.match(line)
        if not match:
            continue
        path = _path(match["path"])
        if start is None:
            if path == table:
                start = i
        elif path[: len(table)] != table:
            end = i
            while end > start + 1 and _is_note(lines[end - 1]):
                end -= 1  # comments and blank lines just above the next table are its own
            return start, end
    return None if start is None else (start, len(lines))


def _crlf(text: str) -> bool:
    """Written with \r\n throughout (a file with both is edited as it is)."""
    return "\r\n" in text and text.count("\r\n") == text.count("\n")


def _is_note(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def render(table: list[str], values: dict[str, Any]) -> str:
    """`[a.b]` with its scalar values, then a sub-table per dict value."""
    lines = [f"[{'.'.join(_key(k) for k in table)}]"]
    subs = []
    for key, value in values.items():
        if isinstance(value, dict):
            subs.append((key, value))
        else:
            lines.append(f"{_key(key)} = {json.dumps(value, ensure_ascii=False)}")
    text = "\n".join(lines) + "\n"
    for key, value in subs:
        text += "\n" + render([*table, key], value)
    return text


def set_table(text: str, table: list[str], values: dict[str, Any]) -> str:
    """`text` with `table` holding exactly `values` (appended when missing)."""
    if _crlf(text):  # edited with \n, given back with the file's line ends
        return set_table(text.replace("\r\n", "\n"), table, values).replace("\n", "\r\n")
    document = loads(text)
    current: Any = document
    for key in table:
        current = current.get(key) if isinstance(current, dict) else None
    if current == values:
        return text
    lines = text.splitlines(keepends=True)
    block = render(table, values)
    span = _span(lines, table)
    if span is None:
        if current is not None:
            raise TomlError(f"{'.'.join(table)} is defined inline: edit it by hand")
        head = text if not text or text.endswith("\n") else text + "\n"
        new = head + ("\n" if head.strip() else "") + block
    else:
        start, end = span
        tail = lines[end:]
        gap = "\n" if tail and lines[end - 1].strip() else ""
        new = "".join(lines[:start]) + block + gap + "".join(tail)
    _expect(new, _with(document, table, values), table)
    return new


def remove_table(text: str, table: list[str]) -> str | None:
    """`text` without `table`; None when it has no such table."""
    if _crlf(text):
        out = remove_table(text.replace("\r\n", "\n"), table)
        return None if out is None else out.replace("\n", "\r\n")
    document = loads(text)
    lines = text.splitlines(keepends=True)
    span = _span(lines, table)
    if span is None:
        if _with(document, table, None) != document:
            raise TomlError(f"{'.'.join(table)} is defined inline: remove it by hand")
        return None
    start, end = span
    while start > 0 and not lines[start - 1].strip():
        start -= 1  # the blank line set_table put before it
    if start == 0:
        while end < len(lines) and not lines[end].strip():
            end += 1
    new = "".join(lines[:start]) + "".join(lines[end:])
    _expect(new, _with(document, table, None), table)
    return new


def _with(document: dict[str, Any], table: list[str], values: dict[str, Any] | None) -> Any:
    """`document` with `table` set to `values` (None: without it)."""
    out = copy.deepcopy(document)
    parent = out
    for key in table[:-1]:
        if not isinstance(parent.get(key), dict):
            if values is None:
                return out
            parent[key] = {}
        parent = parent[key]
    if values is None:
        parent.pop(table[-1], None)
    else:
        parent[table[-1]] = values
    return out


def without_empty(document: Any, path: list[str]) -> Any:
    """`document` less the tables on `path` left empty (`[mcp_servers]` goes with its last
    sub-table unless it has a header of its own)."""
    out = copy.deepcopy(document)
    for depth in range(len(path), 0, -1):
        parent: Any = out
        for key in path[: depth - 1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict) and parent.get(path[depth - 1]) == {}:
            del parent[path[depth - 1]]
    return out


def _expect(new: str, expected: Any, table: list[str]) -> None:
    """The edited text parses, to what the edit meant: the lines taken for the table's were
    its and only its (not, say, a header-like line inside a multi-line string)."""
    got = loads(new)
    if got != expected and got != without_empty(expected, table[:-1]):
        raise TomlError(
            f"{'.'.join(table)} is not only where its header says (a table header inside a "
            "multi-line string, or its sub-tables further on?): edit it by hand"
        )
