"""Loop-mounted test filesystems (btrfs with quotas, ext4, ...) made on a sparse file and given
back at the end: unmounted (lazily if a killed server's sandbox still holds it), its loop
device detached (autoclear) and its file removed, also when the test fails."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

MIB = 1024 * 1024


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


@contextlib.contextmanager
def loop_filesystem(base: Path, kind: str, size_mb: int) -> Iterator[Path]:
    """A fresh `kind` filesystem of `size_mb` MiB mounted at base/mnt, traversable by the
    sandbox user: btrfs (quotas enabled), ext4, ext4-project (the `project` and `quota`
    features, mounted `prjquota`) or xfs (mounted `pquota`; at least 300 MiB)."""
    image, point = base / f"{kind}.img", base / "mnt"
    point.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size_mb * MIB)
    mounted = False
    try:
        options = "loop"
        if kind == "btrfs":
            _run("mkfs.btrfs", "-q", "-f", str(image))
        elif kind == "xfs":
            _run("mkfs.xfs", "-q", "-f", str(image))
            options += ",pquota"
        elif kind == "ext4-project":
            _run("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "project,quota", str(image))
            options += ",prjquota"
        else:
            _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
        _run("mount", "-o", options, str(image), str(point))
        mounted = True
        if kind == "btrfs":
            _run("btrfs", "quota", "enable", str(point))
        os.chmod(point, 0o755)
        yield point
    finally:
        if mounted:
            give_back(point)
        image.unlink(missing_ok=True)


def give_back(point: Path) -> None:
    """Unmount `point` and whatever is mounted below it (a server's leftovers), lazily if
    busy; the loop device goes with it (mount -o loop sets autoclear)."""
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        below = [line.split()[4] for line in f if line.split()[4].startswith(str(point) + "/")]
    for inner in sorted(below, key=len, reverse=True):
        subprocess.run(["umount", "-l", inner], check=False, capture_output=True)
    for _ in range(20):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode == 0:
            return
        time.sleep(0.25)
    subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


def btrfs_qgroups(point: Path) -> set[str]:
    """The qgroups of the btrfs at `point` (0/<subvolume id>), from `btrfs qgroup show`."""
    done = subprocess.run(
        ["btrfs", "qgroup", "show", "--raw", str(point)],
        check=True,
        capture_output=True,
        text=True,
    )
    return {line.split()[0] for line in done.stdout.splitlines() if line.startswith("0/")}


def disk_used(point: Path) -> int:
    """Bytes used on the filesystem at `point` (after a sync)."""
    os.sync()
    st = os.statvfs(point)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
