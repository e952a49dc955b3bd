"""Workspace images on the host, without any store state: making and formatting one, mounting
it, unmounting it, and finding what is mounted or attached under a root.

An image is a file of `mkfs.ext4 -N` (its byte and inode quota), root's and 0600, loop-mounted
with MOUNT_OPTIONS on its mount point; the sandbox only ever sees the mounted filesystem. It is
thin unless the state disk allocates images (workspaces/diskspace.py): a new 1 GiB image takes
52 KiB of the host's disk (mkfs writes the superblock, group descriptors, root directory and
a few bitmaps; the inode tables and the journal are made lazily; see mkfs_argv), ~85 KiB once
a session wrote a small file in it (the journal's first blocks, the file's).
Every call here blocks (a worker thread's work) and raises OSError or SubprocessError;
`mkfs_argv` and `mount_argv` are the pure parts.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from sandbox_runtime.workspaces.diskguard import unlimit_dirty
from sandbox_runtime.workspaces.diskspace import StateDisk, punch_unwritten
from sandbox_runtime.workspaces.ext4meta import INODE_SIZE, JOURNAL_MB, journal_body

# errors=remount-ro: a filesystem error stops writes at once (and we see the mount turn
# read-only) rather than letting them go on into a damaged filesystem.
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime,noinit_itable,errors=remount-ro"
MS_BIND = 4096
MNT_DETACH = 2
COMMAND_TIMEOUT = 30.0
PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def umount(path: Path) -> None:
    """Unmount `path` (detached if busy). Raises OSError."""
    raw = os.fsencode(path)
    try:
        dev = os.stat(path).st_dev
    except OSError:
        dev = 0
    if _libc.umount2(raw, 0) == 0:
        unlimit_dirty(dev)  # (its loop device goes back to serving anything)
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and _libc.umount2(raw, MNT_DETACH) == 0:
        unlimit_dirty(dev)
        return
    if err != errno.EINVAL:  # EINVAL: not mounted
        raise OSError(err, os.strerror(err), str(path))


def release_journal(image: Path) -> bool:
    """Give back the host blocks of the journal of `image`, unmounted cleanly, but its first
    block; whether it did. A clean unmount leaves the journal empty (checkpointed, its
    superblock saying so), and its blocks read as zeros again, as before it first went round
    (mkfs leaves it unwritten: lazy_journal_init): an idle workspace costs what it holds, not
    what its journal once carried (up to 4 MiB). Nothing is done while a loop device still
    serves the image (a detached mount lives on: its filesystem is not gone). Raises OSError."""
    if loop_devices_under(image) > 0:
        return False
    ranges = journal_body(image)
    fd = os.open(image, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for offset, length in ranges:
            if _libc.fallocate(fd, PUNCH_HOLE, offset, length) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(image))
    finally:
        os.close(fd)
    return bool(ranges)


def bind(source: Path, target: Path) -> None:
    """Bind-mount `source` on `target`. Raises OSError."""
    if _libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(target))


def mounts_under(root: Path) -> list[Path]:
    """Mount points below `root`, deepest first (from /proc/self/mountinfo), named under
    `root` as given: the kernel lists them by their real path, which differs when the state
    directory is reached through a symlink."""
    prefix = os.path.realpath(root).rstrip("/") + "/"
    found: list[Path] = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = line.split(b" ")[4].decode("utf-8", "surrogateescape")
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)
            if point.startswith(prefix):
                found.append(root / point[len(prefix) :])
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def loop_devices_under(root: Path) -> int:
    """Loop devices whose backing file is under `root` (this replica's images) or is `root`,
    detached mounts a sandbox still holds included (from /sys/block/loop*/loop/backing_file)."""
    real = os.path.realpath(root)  # (the kernel's name for it)
    prefix = real.rstrip("/") + "/"
    count = 0
    with contextlib.suppress(OSError), os.scandir("/sys/block") as entries:
        for entry in entries:
            if not entry.name.startswith("loop"):
                continue
            with contextlib.suppress(OSError), open(f"{entry.path}/loop/backing_file") as f:
                backing = f.read(4096).rstrip("\n")  # (a path: PATH_MAX)
                if backing.startswith(prefix) or backing == real:
                    count += 1
    return count


def run(argv: list[str]) -> None:
    """Run a mount or mkfs command; raises OSError with its words if it fails."""
    done = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"},
    )
    if done.returncode != 0:
        message = (done.stderr or done.stdout).decode(errors="replace").strip()
        raise OSError(f"{argv[0]} failed ({done.returncode}): {message[:500]}")


def mkfs_argv(image: Path, inodes: int, owner: tuple[int, int]) -> list[str]:
    """mkfs.ext4 of `image` with `inodes` files at most, its root owned by `owner` (uid, gid),
    no reserved blocks, the smallest journal, its inode tables and journal initialised lazily.
    What a thin image costs is what mkfs writes, so it writes little: no resize inode (images
    never grow; its reserved descriptor blocks: 512 KiB), no backup superblocks (sparse_super2
    with none: 8 KiB in each of 4 groups; they serve e2fsck when the primary is destroyed,
    which a crash does not do: the journal is what keeps a workspace whole, and an image
    e2fsck cannot repair is set aside and replaced, workspaces/repair.py), the bitmaps, inode
    tables and journal packed at the start, and flex groups of 2 (from 4 on, ext4 puts files
    in the second group: its bitmap is one block more)."""
    uid, gid = owner
    options = f"root_owner={uid}:{gid},lazy_itable_init=1,lazy_journal_init=1"
    options += ",num_backup_sb=0,packed_meta_blocks=1,nodiscard"
    mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", "-N", str(inodes), "-G", "2"]
    mkfs += ["-I", str(INODE_SIZE), "-J", f"size={JOURNAL_MB}"]
    return [*mkfs, "-O", "^resize_inode,sparse_super2", "-E", options, str(image)]


def mount_argv(image: Path, point: Path, options: str) -> list[str]:
    return ["mount", "-t", "ext4", "-o", options, str(image), str(point)]


def make_image(
    image: Path,
    size_mb: int,
    inodes: int,
    owner: tuple[int, int],
    disk: StateDisk,
    probe: bool = False,
) -> None:
    """Make and format an image (thin, or allocated in full if the disk allocates; `probe`: a
    test image, made without looking for room or reserving it). Raises OSError,
    SubprocessError, DiskFullError."""
    size = size_mb * 1024 * 1024
    if not probe:
        disk.check_room(size)
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        if not probe:  # (a full disk must not fail the start: see images_problem)
            disk.allocate(fd, size, image)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            image.unlink()
        raise
    os.close(fd)
    try:
        run(mkfs_argv(image, inodes, owner))
        if disk.thin:  # (an allocated image's unwritten extents are its reservation)
            with contextlib.suppress(OSError):  # (no FIEMAP: it costs 64 KiB more, no harm)
                punch_unwritten(image)
    except BaseException:
        with contextlib.suppress(OSError):
            image.unlink()
        raise


def mount(image: Path, point: Path, disk: StateDisk) -> None:
    """Mount `image` on `point` (with the state disk's options). Raises OSError."""
    run(mount_argv(image, point, disk.mount_options(MOUNT_OPTIONS)))


PROBE = ".probe"
PROBE_ROOM = 64 * 1024 * 1024  # free space below which a failed probe is blamed on the disk


def images_problem(
    root: Path, owner: tuple[int, int], disk: StateDisk, remove: Callable[[str], None]
) -> str | None:
    """Why workspace images cannot be made and mounted under `root` (None: they can), tried
    with a small image named PROBE that `remove` (the store's removal by name) takes away."""
    if os.geteuid() != 0:
        return "mounting workspace images needs a server running as root"
    if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        return "mkfs.ext4 or mount is missing (apt-get install e2fsprogs mount)"
    if not os.path.exists("/dev/loop-control") and not os.path.exists("/dev/loop0"):
        return "there are no loop devices (/dev/loop-control)"
    image, point = root / f"{PROBE}.img", root / PROBE
    try:
        remove(PROBE)
        make_image(image, 16, 256, owner, disk, probe=True)
        point.mkdir(mode=0)
        mount(image, point, disk)
        umount(point)
    except (OSError, subprocess.SubprocessError) as exc:
        if disk.status().free_bytes < PROBE_ROOM:
            # (A full disk must not turn the images it holds into empty directories.)
            logger.warning(
                "no room to try a workspace image ({}); images are assumed to work (root, "
                "loop devices and mkfs.ext4 are there)",
                exc,
            )
            return None
        return f"a test image could not be made and mounted: {exc}"
    finally:
        with contextlib.suppress(OSError):
            remove(PROBE)
    return None
