"""The catalog file as the running server reads it: again whenever it changed, keeping the
last good catalog when it is broken, and its problems, told to each principal only as far as
they concern entries that principal may use (the operator reads them all: the log, and
`srt-mcp-server servers list`)."""

from __future__ import annotations

import os
from pathlib import Path

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
