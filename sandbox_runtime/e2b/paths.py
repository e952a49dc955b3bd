"""E2B's paths onto the session's workspace: E2B keeps the user's files in /home/user (also a
link to /workspace inside our sandboxes), so `/home/user/x`, `/workspace/x` and `x` are one
file; any other absolute path is outside what this server lets a client reach by name."""

from __future__ import annotations

import posixpath

from sandbox_runtime.errors import InvalidRequestError

HOME = "/home/user"
WORKSPACE = "/workspace"


def to_workspace(path: object, default: str = HOME) -> str:
    """The workspace path (`/workspace/...`) of an E2B path. Raises InvalidRequestError."""
    if path is None or path == "":
        path = default
    if not isinstance(path, str) or "\x00" in path:
        raise InvalidRequestError("path must be a string without NUL")
    if path == "~" or path.startswith("~/"):
        path = HOME + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(HOME, path)
    if ".." in path.split("/"):
        raise InvalidRequestError(f"path {path!r} must not contain '..'")
    normal = posixpath.normpath(path)
    for root in (HOME, WORKSPACE):
        if normal == root or normal.startswith(root + "/"):
            return WORKSPACE + normal[len(root) :]
    raise InvalidRequestError(
        f"path {path!r} is outside the sandbox's home: this server keeps files under "
        f"{HOME} (the same directory as {WORKSPACE})"
    )


def to_e2b(workspace_path: str) -> str:
    """The E2B path (`/home/user/...`) of a workspace path (`/workspace/...` or relative)."""
    rest = workspace_path
    if rest.startswith(WORKSPACE):
        rest = rest[len(WORKSPACE) :]
    rest = rest.strip("/")
    return f"{HOME}/{rest}" if rest else HOME
