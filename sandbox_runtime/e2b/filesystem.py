"""envd's `filesystem.Filesystem` over the session's workspace (the session router's file
operations: run on the session's home, with the workspace's safe path handling and quotas).

Paths are E2B's (`/home/user/...`, the same directory as `/workspace`). Watching a directory
(WatchDir and the watcher calls) is not supported: a clear `unimplemented`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sandbox_runtime.e2b.connect import ConnectError, Method
from sandbox_runtime.e2b.paths import to_e2b, to_workspace
from sandbox_runtime.e2b.process import connect_error
from sandbox_runtime.e2b.sandboxes import E2BSandbox
from sandbox_runtime.errors import FileAccessError, FileMissingError

TYPES = {
    "file": "FILE_TYPE_FILE",
    "directory": "FILE_TYPE_DIRECTORY",
    "symlink": "FILE_TYPE_SYMLINK",
}
MAX_DEPTH = 10
MAX_ENTRIES = 10_000


def entry_info(entry: dict[str, Any]) -> dict[str, Any]:
    """Our listing entry (path relative to /workspace) as envd's EntryInfo."""
    path = to_e2b(str(entry.get("path", "")))
    kind = str(entry.get("type"))
    mode = 0o755 if kind == "directory" else 0o777 if kind == "symlink" else 0o644
    info: dict[str, Any] = {
        "name": path.rsplit("/", 1)[-1],
        "type": TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
        "path": path,
        "size": str(int(entry.get("size") or 0)),
        "mode": mode,
        "permissions": _permissions(kind, mode),
        "owner": "user",
        "group": "user",
        "modifiedTime": dt.datetime.fromtimestamp(float(entry.get("mtime") or 0), dt.UTC)
        .isoformat()
        .replace("+00:00", "Z"),
    }
    if entry.get("target") is not None:
        info["symlinkTarget"] = entry["target"]
    return info


def _permissions(kind: str, mode: int) -> str:
    head = {"directory": "d", "symlink": "L"}.get(kind, "-")
    bits = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return head + bits


def fs_error(exc: Exception) -> ConnectError:
    if isinstance(exc, FileMissingError):
        return ConnectError("not_found", str(exc))
    if isinstance(exc, FileAccessError) and "already exists" in str(exc):
        return ConnectError("already_exists", str(exc))
    if isinstance(exc, FileAccessError):
        return ConnectError("failed_precondition", str(exc))
    return connect_error(exc)


class FilesystemService:
    def __init__(self, services: Any) -> None:
        self.services = services

    def methods(self) -> dict[str, Method]:
        p = "/filesystem.Filesystem/"
        return {
            p + "Stat": Method("unary", self.stat),
            p + "ListDir": Method("unary", self.list_dir),
            p + "MakeDir": Method("unary", self.make_dir),
            p + "Move": Method("unary", self.move),
            p + "Remove": Method("unary", self.remove),
        }

    async def _run(self, sandbox: E2BSandbox, op: str, args: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.services.router.run(sandbox.owner, op, args)
        except Exception as exc:
            raise fs_error(exc) from None

    @staticmethod
    def _path(message: dict[str, Any], key: str = "path") -> str:
        try:
            return to_workspace(message.get(key))
        except Exception as exc:
            raise ConnectError("invalid_argument", str(exc)) from None

    async def stat(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        found = await self._run(sandbox, "stat_file", {"path": self._path(message)})
        return {"entry": entry_info(found["entry"])}

    async def list_dir(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        depth = message.get("depth") or 1
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ConnectError("invalid_argument", "depth must be a positive number")
        path = self._path(message)
        found = await self._run(sandbox, "stat_file", {"path": path})
        if found["entry"]["type"] != "directory":
            raise ConnectError("invalid_argument", f"{to_e2b(path)} is not a directory")
        listing = await self._run(
            sandbox,
            "list_files",
            {"path": path, "depth": min(depth, MAX_DEPTH), "limit": MAX_ENTRIES},
        )
        return {"entries": [entry_info(e) for e in listing["entries"]]}

    async def make_dir(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        path = self._path(message)
        made = await self._run(sandbox, "make_dir", {"path": path})
        if not made["created"]:
            raise ConnectError("already_exists", f"directory {to_e2b(path)} already exists")
        return {"entry": entry_info(made["entry"])}

    async def move(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        args = {
            "source": self._path(message, "source"),
            "destination": self._path(message, "destination"),
        }
        moved = await self._run(sandbox, "move_file", args)
        return {"entry": entry_info(moved["entry"])}

    async def remove(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        path = self._path(message)
        await self._run(sandbox, "delete_file", {"path": path, "recursive": True})
        return {}
