"""The catalog file: written by the CLI (atomically, mode 0600), and read by the running
server again whenever it changed, keeping the last good catalog when it is broken, and its
problems, told to each principal only as far as they concern entries that principal may use
(the operator reads them all: the log, and `srt-mcp-server servers list`)."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.servers.catalog import Broken, Catalog, CatalogError, load_catalog

# What a principal is told of a problem whose entry it may not be shown.
UNKNOWN_ENTRY = "an entry the operator configured is invalid"
BROKEN_FILE = "the operator's catalog file is invalid (the last good catalog is in use)"


class CatalogFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._catalog = Catalog()
        self._stamp: tuple[int, int] | None = None
        self.problem: str | None = None  # (the operator's words)
        self._broken: list[Broken] = []  # entries left out of the last good catalog
        self._file_broken = False

    def current(self) -> Catalog:
        """The catalog as it is now (a broken file keeps the last good catalog and says why
        in `problem`)."""
        try:
            st = os.stat(self.path)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            broken: list[Broken] = []
            try:
                # One broken entry is left out; the others load.
                self._catalog = load_catalog(self.path, broken)
                self.problem = "; ".join(b.text for b in broken) or None
                self._broken, self._file_broken = broken, False
            except CatalogError as exc:  # (not TOML at all: the last good catalog stays)
                self.problem = f"{exc} (the last good catalog is in use)"
                self._file_broken = True
            if self.problem is not None:
                logger.error("hosted servers: {}", self.problem)
            self._stamp = stamp
        return self._catalog

    def problem_for(self, principal: str) -> str | None:
        """The problems as `principal` is told them: those of entries it may use (with
        their names and errors); of one whose principals cannot be read, only that there is
        one; of the file, only that it is invalid."""
        self.current()
        told = [b.text for b in self._broken if b.principals is not None
                and (not b.principals or principal in b.principals)]  # fmt: skip
        if any(b.principals is None for b in self._broken):
            told.append(UNKNOWN_ENTRY)
        if self._file_broken:
            told.append(BROKEN_FILE)
        return "; ".join(told) or None


def dump_catalog(catalog: Catalog) -> str:
    """The catalog as TOML (what load_catalog reads back to the same entries)."""
    lines = ["# Hosted MCP servers (srt-mcp-server servers add|remove|import edits this file).", ""]
    for name in sorted(catalog.entries):
        lines.append(f"[servers.{name}]")
        for key, value in catalog.entries[name].as_table().items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # JSON's escapes are TOML's, but JSON leaves DEL as it is and TOML refuses it raw.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = (f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + ", ".join(items) + " }" if value else "{}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def save_catalog(path: Path, catalog: Catalog) -> None:
    """Write the catalog atomically (readers see the old file or the new one), mode 0600:
    it names secrets' sources."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dump_catalog(catalog))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def unknown_name(path: Path, name: str) -> str | None:
    """None when the catalog at `path` has a server `name` (an invalid entry's name too; any
    name when the catalog cannot be read), else what to say: the name meant, or where the
    catalog is."""
    broken: list[Broken] = []
    try:
        names = [*load_catalog(path, broken).entries, *(b.name for b in broken)]
    except CatalogError:
        return None
    if name in names:
        return None
    close = difflib.get_close_matches(name, names, n=1)
    return f"(did you mean {close[0]!r}?)" if close else f"in {path}"
