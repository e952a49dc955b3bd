"""What an OSError met in a workspace means to the caller: the domain error to raise.

An I/O error from the workspace's filesystem (EIO; EROFS or EUCLEAN once the kernel aborted
its journal), or any failed fsync, means the filesystem lost writes it had taken: the call
fails with WorkspaceDamagedError and the owner of the workspace is told (`on_damage`), never
a success. ENOSPC/EDQUOT is the quota (WorkspaceFullError); the rest are FileAccessError or
FileMissingError with a sentence the caller can act on.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Protocol

from sandbox_runtime.errors import (
    FileAccessError,
    FileMissingError,
    WorkspaceDamagedError,
    WorkspaceFullError,
)
from sandbox_runtime.workspaces.paths import display

# The filesystem under the workspace failed: an I/O error, a journal the kernel aborted
# (EROFS), metadata that fails its checksum (EUCLEAN, ext4's EFSCORRUPTED).
DAMAGE_ERRNOS = (errno.EIO, errno.EROFS, errno.EUCLEAN)


class Fail(Protocol):
    """A workspace's mapping of an OSError to the domain error (WorkspaceFiles._fail)."""

    def __call__(
        self, exc: OSError, parts: tuple[str, ...], doing: str, synced: bool = False
    ) -> Exception: ...


def domain_error(
    exc: OSError,
    parts: tuple[str, ...],
    doing: str,
    synced: bool = False,
    on_damage: Callable[[str], None] | None = None,
) -> Exception:
    """The domain error for `exc` met while `doing` `parts`; `synced`: met by an fsync,
    whose every failure means the filesystem lost writes it had taken (a quota's ENOSPC
    comes from write(): ext4 reserves the blocks then; at fsync it is the disk under the
    image failing)."""
    where = display(parts)
    code = exc.errno
    if code in DAMAGE_ERRNOS or synced:
        detail = f"{doing} {where}: {os.strerror(code or 0)}"
        if synced:
            detail += ", putting it on disk"
        if on_damage is not None:
            on_damage(detail)
        return WorkspaceDamagedError(
            f"the workspace's filesystem failed ({detail}); this call did not complete. "
            "The workspace is checked (and repaired, or set aside for the operator and "
            "replaced) before its next use, which says so in `session_reset`: retry"
        )
    if code in (errno.ENOSPC, errno.EDQUOT):
        return WorkspaceFullError(
            f"the workspace is full ({doing} {where}): its quota of bytes or files is "
            "spent; delete files first"
        )
    if code == errno.ENOENT:
        return FileMissingError(f"{where}: no such file or directory")
    if code in (errno.ELOOP, errno.EXDEV, errno.EMLINK):
        return FileAccessError(
            f"{where}: the path goes through a symbolic link or leaves the workspace "
            "(file tools never follow links)"
        )
    if code == errno.ENOTDIR:
        return FileAccessError(
            f"{where}: a component of the path is not a directory (or is a symbolic link: "
            "file tools never follow links)"
        )
    if code == errno.EISDIR:
        return FileAccessError(f"{where}: is a directory")
    if code == errno.EEXIST:
        return FileAccessError(f"{where}: already exists (pass overwrite=true to replace it)")
    if code == errno.ENOTEMPTY:
        return FileAccessError(
            f"{where}: the directory is not empty (pass recursive=true to delete it all)"
        )
    if code == errno.EAGAIN:
        return FileAccessError(f"{where}: the workspace kept changing; retry")
    return FileAccessError(f"{where}: cannot {doing} it: {os.strerror(code or 0)}")
