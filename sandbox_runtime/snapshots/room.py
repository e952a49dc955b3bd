"""How much a workspace's filesystem can hold: the bound a capture and a restore are held to
(a snapshot that could never be restored into a fresh workspace is refused when taken)."""

from __future__ import annotations

import os
from pathlib import Path

# What an empty workspace filesystem uses itself (its root directory, lost+found; measured:
# 24 KiB), with room to spare: a capture's usable size is the filesystem's less this.
EMPTY_FS_BYTES = 64 * 1024


def usable_bytes(path: Path, empty: bool) -> int | None:
    """The bytes files may take on the workspace filesystem mounted at `path` (an image):
    what it has free now if `empty`, else what it would have free empty. None: `path` is a
    plain directory (no filesystem of its own, no quota but the setting's)."""
    if os.stat(path).st_dev == os.stat(path.parent).st_dev:
        return None
    st = os.statvfs(path)
    if empty:
        return st.f_bavail * st.f_frsize
    reserved = st.f_bfree - st.f_bavail  # (ext4 keeps a few blocks back even with -m 0)
    return (st.f_blocks - reserved) * st.f_frsize - EMPTY_FS_BYTES
