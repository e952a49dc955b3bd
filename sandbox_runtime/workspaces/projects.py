"""ext4 and XFS workspaces: one directory per workspace with a project quota on its bytes and
files, enforced by the state filesystem itself.

A project quota limits what every inode carrying one project id holds together. A workspace's
directory gets a project id of its own and FS_XFLAG_PROJINHERIT (FS_IOC_FSSETXATTR), so that
everything made in it inherits the id; its limits are set with quotactl_fd(Q_SETQUOTA,
PRJQUOTA). No command runs on this path: a workspace costs a mkdir, two ioctls and a syscall.
The sandbox cannot change a file's project id: the kernel refuses it to anything outside the
initial user namespace (every sandbox is in its own), and quotactl is denied by its seccomp
filter. A rename or hard link into a directory of another project fails with EXDEV; the
file tools only rename inside one workspace.

Project ids are drawn at random from [2^20, 2^31) and used only when the filesystem has no
limit and no usage recorded for them. The id is read back from the directory when needed,
never kept beside it; removing a workspace clears its limits.

Needs: ext4 with the `project` and `quota` features mounted with `prjquota`, or XFS mounted
with `pquota` (`prjquota`), a kernel with quota support and quotactl_fd (Linux 5.14), root.
`probe` says which is missing and `enable_command` the command that enables it.

Every call blocks and raises OSError; the struct packing, the command numbers and the
wording of errors are the pure parts.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import secrets
import shutil
import struct
from pathlib import Path

from sandbox_runtime.workspaces.quotainfo import MountEntry, QuotaUsage, mount_of

FSXATTR = struct.Struct("=IIIII8x")  # xflags, extsize, nextents, projid, cowextsize, pad
FS_IOC_FSGETXATTR = (2 << 30) | (FSXATTR.size << 16) | (ord("X") << 8) | 31
FS_IOC_FSSETXATTR = (1 << 30) | (FSXATTR.size << 16) | (ord("X") << 8) | 32
FS_XFLAG_PROJINHERIT = 0x200

# struct if_dqblk: bhardlimit, bsoftlimit (1 KiB blocks), curspace (bytes), ihardlimit,
# isoftlimit, curinodes, btime, itime, valid.
DQBLK = struct.Struct("=QQQQQQQQI4x")
Q_GETQUOTA = 0x800007
Q_SETQUOTA = 0x800008
PRJQUOTA = 2
QIF_BLIMITS = 1
QIF_ILIMITS = 4
QIF_LIMITS = QIF_BLIMITS | QIF_ILIMITS
QUOTACTL_FD = {"x86_64": 443, "aarch64": 443, "arm64": 443}
ID_LOW, ID_HIGH = 2**20, 2**31

EXT4 = "tune2fs -O project,quota {device} (unmounted), then mount it with -o prjquota"
XFS = "mount {device} with -o pquota (in /etc/fstab; XFS cannot turn it on by remount)"

_libc = ctypes.CDLL(None, use_errno=True)


def qcmd(command: int) -> int:
    """QCMD(command, PRJQUOTA)."""
    return (command << 8) | PRJQUOTA


def pack_limits(limit_bytes: int, inodes: int) -> bytes:
    """An if_dqblk setting hard limits of `limit_bytes` (rounded up to KiB) and `inodes`."""
    return DQBLK.pack(-(-limit_bytes // 1024), 0, 0, inodes, 0, 0, 0, 0, QIF_LIMITS)


def unpack_usage(raw: bytes) -> QuotaUsage:
    """The usage and limits in an if_dqblk Q_GETQUOTA filled (0: no limit)."""
    bhard, _, space, ihard, _, inodes, _, _, _ = DQBLK.unpack(raw)
    return QuotaUsage(space, bhard * 1024 or None, inodes, ihard or None)


def why(code: int) -> str:
    """What a quotactl or project-id ioctl failing with `code` means here."""
    if code == errno.ENOSYS:
        return "the kernel lacks quota support or quotactl_fd (Linux 5.14 and later)"
    if code == errno.ESRCH:
        return "project quotas are not turned on for the state filesystem"
    if code in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
        return "the state filesystem does not support project quotas"
    if code == errno.EPERM:
        return "setting project quotas needs a server running as root"
    return os.strerror(code)


def quotactl(fd: int, command: int, ident: int, buf: ctypes.Array[ctypes.c_char]) -> None:
    """quotactl_fd(fd, QCMD(command, PRJQUOTA), ident, buf). Raises OSError."""
    nr = QUOTACTL_FD.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"quotactl_fd: unknown on {platform.machine()}")
    if _libc.syscall(nr, fd, qcmd(command), ident, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, why(err))


def get_project(fd: int) -> tuple[int, int]:
    """(xflags, project id) of the open file `fd`."""
    buf = bytearray(FSXATTR.size)
    fcntl.ioctl(fd, FS_IOC_FSGETXATTR, buf)
    xflags, _, _, projid, _ = FSXATTR.unpack(buf)
    return xflags, projid


def set_project(fd: int, projid: int) -> None:
    """Give the directory `fd` project `projid`, inherited by what is made in it."""
    buf = bytearray(FSXATTR.size)
    fcntl.ioctl(fd, FS_IOC_FSGETXATTR, buf)
    xflags, extsize, nextents, _, cow = FSXATTR.unpack(buf)
    new = FSXATTR.pack(xflags | FS_XFLAG_PROJINHERIT, extsize, nextents, projid, cow)
    fcntl.ioctl(fd, FS_IOC_FSSETXATTR, bytearray(new))


def setup_problem(entry: MountEntry | None) -> str | None:
    """What the state filesystem's mount lacks for project quotas (None: nothing seen)."""
    if entry is None:
        return "the state filesystem's mount was not found in /proc/self/mountinfo"
    if entry.fstype not in ("ext4", "xfs"):
        return f"the state filesystem is {entry.fstype}, not ext4 or XFS"
    if not entry.options & {"prjquota", "pquota", "pqnoenforce"}:
        return f"{entry.fstype} at {entry.point} is not mounted with project quotas (prjquota)"
    return None


class Projects:
    """Project-quota workspace directories under one root (ext4 or XFS)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.entry = mount_of(root)
        self.kind = "xfs" if self.entry is not None and self.entry.fstype == "xfs" else "ext4"

    def enable_command(self) -> str:
        device = self.entry.device if self.entry is not None else "DEVICE"
        return (XFS if self.kind == "xfs" else EXT4).format(device=device)

    def probe(self) -> str | None:
        """Why project-quota workspaces cannot be used under the root (None: they can)."""
        if os.geteuid() != 0:
            return "project quotas need a server running as root"
        if (problem := setup_problem(self.entry)) is not None:
            return problem
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            return f"{self.root}: {exc.strerror}"
        try:
            get_project(fd)
            self._get(fd, ID_LOW)
        except OSError as exc:
            return why(exc.errno or 0)
        finally:
            os.close(fd)
        return None

    def _get(self, fd: int, ident: int) -> QuotaUsage:
        buf = ctypes.create_string_buffer(DQBLK.size)
        try:
            quotactl(fd, Q_GETQUOTA, ident, buf)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # (XFS: no quota record for the id, nothing used)
                raise
            return QuotaUsage(0, None, 0, None)
        return unpack_usage(buf.raw)

    def _set(self, fd: int, ident: int, limit_bytes: int, inodes: int) -> None:
        buf = ctypes.create_string_buffer(pack_limits(limit_bytes, inodes), DQBLK.size)
        quotactl(fd, Q_SETQUOTA, ident, buf)

    def _free_id(self, fd: int) -> int:
        for _ in range(64):
            ident = secrets.randbelow(ID_HIGH - ID_LOW) + ID_LOW
            got = self._get(fd, ident)
            if not (got.bytes_used or got.bytes_limit or got.files_used or got.files_limit):
                return ident
        raise OSError(errno.EAGAIN, "no unused project id found in 64 tries")

    def is_workspace(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            return get_project(fd)[1] != 0
        except OSError:
            return False
        finally:
            os.close(fd)

    def create(self, path: Path, limit_bytes: int, inodes: int, uid: int, gid: int) -> None:
        """Make the workspace `path` (mode 0700, owned by uid/gid) with its limits."""
        os.mkdir(path, 0o700)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                ident = self._free_id(fd)
                self._set(fd, ident, limit_bytes, inodes)
                set_project(fd, ident)
                os.fchown(fd, uid, gid)
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                self.remove(path)
            raise

    def remove(self, path: Path) -> None:
        """Remove the workspace `path` with everything in it, and clear its limits."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            ident = get_project(fd)[1]
        finally:
            os.close(fd)
        shutil.rmtree(path)
        if ident:
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._set(root, ident, 0, 0)
            finally:
                os.close(root)

    def usage(self, path: Path) -> QuotaUsage:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            return self._get(fd, get_project(fd)[1])
        finally:
            os.close(fd)
