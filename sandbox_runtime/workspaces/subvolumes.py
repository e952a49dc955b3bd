"""btrfs workspaces: one subvolume per workspace, its qgroup limited to the workspace's bytes.

btrfs has no project quotas; its per-tree quota is the qgroup of a subvolume. A workspace is
made with BTRFS_IOC_SUBVOL_CREATE in the workspaces' root (a directory-like tree of its own,
~1 ms, nothing preallocated) and limited with BTRFS_IOC_QGROUP_LIMIT on its own qgroup
(0/<subvolume id>): a write past it fails with EDQUOT, to the writer. The limit is on
referenced bytes, data and metadata: btrfs has no inode limit, but every file costs metadata
bytes that count against the limit, which bounds how many a workspace can hold (usage says
`files_limit: None`). Usage is read from sysfs (/sys/fs/btrfs/<fsid>/qgroups/0_<id>/): the
bytes committed plus those reserved for writes not yet committed (the committed count lags
by up to a transaction, ~30 s).

Removing a workspace destroys its subvolume (BTRFS_IOC_SNAP_DESTROY) and then its qgroup;
the kernel frees the space in the background (the cleaner). The sandbox cannot make a
subvolume of its own in its workspace (which would escape the qgroup): its seccomp filter
refuses every btrfs ioctl (sandbox/seccomp.py).

Every call blocks (a worker thread's work) and raises OSError; the ioctl numbers and struct
packing are the pure parts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from pathlib import Path

from sandbox_runtime.workspaces.quotainfo import QuotaUsage

BTRFS_SUPER_MAGIC = 0x9123683E
FIRST_FREE_OBJECTID = 256  # the inode number of every subvolume's root directory
VOL_ARGS = 4096  # struct btrfs_ioctl_vol_args: s64 fd; char name[4088]
INO_LOOKUP_ARGS = 4096  # struct btrfs_ioctl_ino_lookup_args: u64 treeid, objectid; name[4080]
LIMIT_ARGS = 48  # struct btrfs_ioctl_qgroup_limit_args: u64 qgroupid; btrfs_qgroup_limit
FS_INFO_ARGS = 1024  # struct btrfs_ioctl_fs_info_args: u64 max_id, num_devices; u8 fsid[16]..
QGROUP_LIMIT_MAX_RFER = 1


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


IOC_SUBVOL_CREATE = _ioc(1, 14, VOL_ARGS)
IOC_SNAP_DESTROY = _ioc(1, 15, VOL_ARGS)
IOC_INO_LOOKUP = _ioc(3, 18, INO_LOOKUP_ARGS)
IOC_FS_INFO = _ioc(2, 31, FS_INFO_ARGS)
IOC_QGROUP_CREATE = _ioc(1, 42, 16)
IOC_QGROUP_LIMIT = _ioc(2, 43, LIMIT_ARGS)

ENABLE = "btrfs quota enable {root}"


def vol_args(name: str) -> bytearray:
    """struct btrfs_ioctl_vol_args naming `name` in the directory the ioctl is called on."""
    raw = os.fsencode(name)
    if not raw or b"/" in raw or len(raw) > 255:
        raise OSError(errno.EINVAL, "invalid subvolume name", name)
    buf = bytearray(VOL_ARGS)
    buf[8 : 8 + len(raw)] = raw
    return buf


def limit_args(limit_bytes: int | None) -> bytes:
    """struct btrfs_ioctl_qgroup_limit_args for the subvolume's own qgroup (id 0): a limit
    on referenced bytes, or none (`limit_bytes` None clears it)."""
    if limit_bytes is None:
        return struct.pack("=6Q", 0, QGROUP_LIMIT_MAX_RFER, 0, 0, 0, 0)
    return struct.pack("=6Q", 0, QGROUP_LIMIT_MAX_RFER, limit_bytes, 0, 0, 0)


def subvolume_id(path: Path) -> int:
    """The id of the subvolume whose root `path` is (INO_LOOKUP of its root directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        buf = bytearray(INO_LOOKUP_ARGS)
        struct.pack_into("=QQ", buf, 0, 0, FIRST_FREE_OBJECTID)
        fcntl.ioctl(fd, IOC_INO_LOOKUP, buf)
        return int(struct.unpack_from("=Q", buf, 0)[0])
    finally:
        os.close(fd)


def fsid(path: Path) -> str:
    """The filesystem's UUID as sysfs names it (/sys/fs/btrfs/<fsid>)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        buf = bytearray(FS_INFO_ARGS)
        fcntl.ioctl(fd, IOC_FS_INFO, buf)
    finally:
        os.close(fd)
    raw = bytes(buf[16:32]).hex()
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def is_subvolume(path: Path) -> bool:
    """Whether `path` is the root of a subvolume (a workspace made here)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_ino == FIRST_FREE_OBJECTID and os.path.isdir(path)


class Subvolumes:
    """btrfs subvolume workspaces under one root (on btrfs, with quotas enabled)."""

    kind = "btrfs"

    def __init__(self, root: Path) -> None:
        self.root = root
        self._sysfs: Path | None = None

    def enable_command(self) -> str:
        return ENABLE.format(root=self.root)

    def probe(self) -> str | None:
        """Why subvolume workspaces with a qgroup cannot be used under the root (None: they
        can): not btrfs, not root, or quotas not enabled on the filesystem."""
        if os.geteuid() != 0:
            return "btrfs subvolume quotas need a server running as root"
        try:
            qgroups = Path("/sys/fs/btrfs") / fsid(self.root) / "qgroups"
        except OSError as exc:
            return f"the state filesystem is not btrfs ({os.strerror(exc.errno or 0)})"
        if not qgroups.is_dir():
            return f"btrfs quotas are not enabled on the state filesystem ({qgroups} missing)"
        self._sysfs = qgroups
        return None

    def is_workspace(self, path: Path) -> bool:
        return is_subvolume(path)

    def create(self, path: Path, limit_bytes: int, inodes: int, uid: int, gid: int) -> None:
        """Make the workspace `path` (a subvolume, mode 0700, owned by uid/gid) with its byte
        limit; `inodes` has no btrfs counterpart (metadata bytes bound the file count)."""
        del inodes
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(parent, IOC_SUBVOL_CREATE, vol_args(path.name))
        finally:
            os.close(parent)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                fcntl.ioctl(fd, IOC_QGROUP_LIMIT, bytearray(limit_args(limit_bytes)))
                os.fchown(fd, uid, gid)
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                self.remove(path)
            raise

    def remove(self, path: Path) -> None:
        """Destroy the subvolume `path` with everything in it, and its qgroup."""
        ident = subvolume_id(path)
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(parent, IOC_SNAP_DESTROY, vol_args(path.name))
            # The qgroup goes with the subvolume's last extent (the cleaner, later); removing
            # it now succeeds on kernels that allow it, and is otherwise left to the kernel.
            with contextlib.suppress(OSError):
                fcntl.ioctl(parent, IOC_QGROUP_CREATE, struct.pack("=QQ", 0, ident))
        finally:
            os.close(parent)

    def usage(self, path: Path) -> QuotaUsage:
        """Bytes used (committed and reserved) and allowed; files are not limited."""
        ident = subvolume_id(path)
        if self._sysfs is None:
            self._sysfs = Path("/sys/fs/btrfs") / fsid(self.root) / "qgroups"
        group = self._sysfs / f"0_{ident}"
        used = _read(group / "referenced") + _read(group / "rsv_data")
        limit = _read(group / "max_referenced")
        return QuotaUsage(used, limit or None, None, None)


def _read(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0
