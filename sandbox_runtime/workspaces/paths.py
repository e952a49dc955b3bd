"""Workspace paths as the tools give them, and names as listings show them (pure: no I/O).

A path is relative to /workspace or absolute inside it; `..` is refused outright, as are NUL,
lone surrogates and over-long names (`clean_path`). Names read back from the filesystem may
be any bytes: `as_text` shows them, `is_text` says whether a path could name them.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from sandbox_runtime.errors import InvalidRequestError

WORKSPACE = "/workspace"
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
UPLOAD_PREFIX = ".srt-upload-"


def clean_path(path: str) -> tuple[str, ...]:
    """The components of a workspace path ("" or "." or "/workspace": the root, ()).

    Raises InvalidRequestError for anything outside /workspace, `..`, NUL or over-long names.
    """
    if not isinstance(path, str) or "\x00" in path:
        raise InvalidRequestError("path must be a string without NUL")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise InvalidRequestError("path must be valid Unicode (no lone surrogates)") from None
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidRequestError(f"path is longer than {MAX_PATH_BYTES} bytes")
    if path.startswith("/"):
        if path != WORKSPACE and not path.startswith(WORKSPACE + "/"):
            raise InvalidRequestError(
                f"path {path!r} is outside the workspace: give it relative to /workspace or "
                "absolute inside it"
            )
        path = path[len(WORKSPACE) :]
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise InvalidRequestError(f"path {path!r} must not contain '..'")
    for part in parts:
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise InvalidRequestError(f"a name in path {path!r} is longer than 255 bytes")
    return parts


def display(parts: tuple[str, ...]) -> str:
    return "/".join(parts) or "."


def is_text(name: str) -> bool:
    """Whether a name read from the filesystem is valid UTF-8 (os gives other bytes as lone
    surrogates, which JSON, URIs and the tools' paths cannot carry)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def as_text(name: str) -> str:
    """A name read from the filesystem as text to show: bytes that are not UTF-8 as U+FFFD."""
    return name if is_text(name) else os.fsencode(name).decode("utf-8", "replace")


@dataclass(frozen=True)
class Entry:
    """One name in a workspace, as a listing shows it (never followed if a link)."""

    path: str  # relative to /workspace
    type: str  # file, directory, symlink, fifo, socket, device
    size: int
    mtime: float
    target: str | None = None  # a symlink's target, as text (never followed)

    def wire(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "type": self.type,
            "size": self.size,
            "mtime": round(self.mtime, 3),
        }
        if self.target is not None:
            out["target"] = self.target
        return out


def kind_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"
