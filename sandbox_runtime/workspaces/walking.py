"""Walking a workspace's tree, bounded: a listing (`walk`) and the scan for the files a call
changed (`scan`). Links are listed, never entered; a directory is reopened O_NOFOLLOW from its
parent's fd; a name gone or replaced meanwhile is skipped; partial uploads are not shown. A
hostile tree (100k entries, thousands of levels) costs at most the limits the caller gives
and SCAN_DEPTH levels of recursion.
"""

from __future__ import annotations

import contextlib
import os
import stat

from sandbox_runtime.workspaces.paths import UPLOAD_PREFIX, Entry, as_text, is_text, kind_of

SCAN_DEPTH = 64  # directory levels the changed-files scan descends, at most


def walk(fd: int, parts: tuple[str, ...], depth: int, limit: int, out: list[Entry]) -> bool:
    """List the directory `fd` (consumed) into `out`; True when `limit` cut it short."""
    subdirs: list[str] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if len(out) >= limit:
                    return True
                if entry.name.startswith(UPLOAD_PREFIX):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone meanwhile
                target = None
                if stat.S_ISLNK(st.st_mode):
                    with contextlib.suppress(OSError):
                        target = as_text(os.readlink(entry.name, dir_fd=fd))
                name = as_text("/".join((*parts, entry.name)))
                out.append(Entry(name, kind_of(st.st_mode), st.st_size, st.st_mtime, target))
                if depth > 1 and stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.name)
        for name in subdirs:
            try:
                child = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except OSError:
                continue  # replaced or removed meanwhile
            if walk(child, (*parts, name), depth - 1, limit, out):
                return True
        return False
    finally:
        os.close(fd)


def scan(
    fd: int,
    parts: tuple[str, ...],
    since: float,
    budget: list[int],
    report: int,
    found: list[Entry],
) -> bool:
    """Add the regular files under the directory `fd` (consumed) whose status changed at or
    after `since` to `found`; False when `budget` (names to visit) or `report` stopped it."""
    subdirs: list[str] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                budget[0] -= 1
                if budget[0] < 0 or len(found) > report:
                    return False
                if not is_text(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if len(parts) + 1 < SCAN_DEPTH:  # no recursion a hostile tree can exhaust
                        subdirs.append(entry.name)
                elif (
                    stat.S_ISREG(st.st_mode)
                    and st.st_ctime >= since
                    and not entry.name.startswith(UPLOAD_PREFIX)
                ):
                    name = "/".join((*parts, entry.name))
                    found.append(Entry(name, "file", st.st_size, st.st_mtime))
        for name in subdirs:
            try:
                child = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except OSError:
                continue
            if not scan(child, (*parts, name), since, budget, report, found):
                return False
        return True
    finally:
        os.close(fd)
