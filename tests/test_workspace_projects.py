"""ext4/XFS project quotas' pure parts (workspaces/projects.py): the ioctl and quotactl
numbers, struct if_dqblk and struct fsxattr packing, what an errno means, what a mount
lacks; and the probe's words on real filesystems without project quotas (a loop-mounted
ext4 made without the `project` feature, a btrfs without quotas enabled). The ext4/XFS path
itself runs for real in the VM harness (a kernel with quota support)."""

from __future__ import annotations

import errno
import struct
import subprocess
from pathlib import Path

import pytest
from loopfs_harness import loop_filesystem

from sandbox_runtime.config.settings import Settings
from sandbox_runtime.doctor.sandboxes import check_project_quotas
from sandbox_runtime.workspaces import projects, subvolumes
from sandbox_runtime.workspaces.quotainfo import MountEntry, parse_mountinfo
from sandbox_runtime.workspaces.quotamode import probe_project


def test_ioctl_and_quotactl_numbers_match_the_kernel_headers() -> None:
    assert projects.FSXATTR.size == 28
    assert projects.FS_IOC_FSGETXATTR == 0x801C581F
    assert projects.FS_IOC_FSSETXATTR == 0x401C5820
    assert projects.DQBLK.size == 72  # (struct if_dqblk: eight u64, a u32, padded)
    assert projects.qcmd(projects.Q_GETQUOTA) == 0x80000702
    assert projects.qcmd(projects.Q_SETQUOTA) == 0x80000802
    assert subvolumes.IOC_SUBVOL_CREATE == 0x5000940E
    assert subvolumes.IOC_SNAP_DESTROY == 0x5000940F
    assert subvolumes.IOC_QGROUP_LIMIT == 0x8030942B
    assert subvolumes.IOC_INO_LOOKUP == 0xD0009412


def test_limits_pack_and_usage_unpacks() -> None:
    raw = projects.pack_limits(1024 * 1024 * 1024 + 1, 65536)
    bhard, bsoft, space, ihard, isoft, inodes, _, _, valid = projects.DQBLK.unpack(raw)
    assert bhard == 1024 * 1024 + 1, "bytes to 1 KiB blocks, rounded up"
    assert (bsoft, space, isoft, inodes) == (0, 0, 0, 0)
    assert ihard == 65536 and valid == projects.QIF_LIMITS
    got = projects.unpack_usage(projects.DQBLK.pack(2048, 0, 5000, 10, 0, 3, 0, 0, 0))
    assert (got.bytes_used, got.bytes_limit, got.files_used, got.files_limit) == (
        5000,
        2048 * 1024,
        3,
        10,
    )
    assert projects.unpack_usage(bytes(72)).bytes_limit is None  # (0: no limit)
    args = subvolumes.limit_args(16 * 1024 * 1024)
    assert struct.unpack("=6Q", args)[:3] == (0, subvolumes.QGROUP_LIMIT_MAX_RFER, 16 << 20)
    assert subvolumes.vol_args("ws-1")[8:12] == b"ws-1" and len(subvolumes.vol_args("x")) == 4096
    with pytest.raises(OSError):
        subvolumes.vol_args("a/b")


def test_errors_are_said_in_words() -> None:
    assert "quotactl_fd" in projects.why(errno.ENOSYS)
    assert "not turned on" in projects.why(errno.ESRCH)
    assert "does not support" in projects.why(errno.EOPNOTSUPP)
    assert "root" in projects.why(errno.EPERM)
    line = (
        "36 25 7:1 / /srv/state rw,noatime shared:1 - ext4 /dev/loop1 rw,prjquota,errors=remount-ro"
    )
    entry = parse_mountinfo(line)
    assert entry == MountEntry(
        "/srv/state",
        "ext4",
        "/dev/loop1",
        frozenset({"rw", "noatime", "prjquota", "errors=remount-ro"}),
    )
    assert projects.setup_problem(entry) is None
    plain = MountEntry("/srv", "ext4", "/dev/sda1", frozenset({"rw"}))
    assert "not mounted with project quotas" in (projects.setup_problem(plain) or "")
    tmpfs = MountEntry("/tmp", "tmpfs", "tmpfs", frozenset({"rw"}))
    assert "tmpfs, not ext4 or XFS" in (projects.setup_problem(tmpfs) or "")
    xfs = MountEntry("/srv", "xfs", "/dev/sdb", frozenset({"rw", "prjquota"}))
    assert projects.setup_problem(xfs) is None


def test_the_probe_says_why_and_how_to_enable(tmp_path: Path) -> None:
    """On an ext4 without the project feature: not mounted with project quotas, and the
    tune2fs command naming its device; on a btrfs without quotas: `btrfs quota enable`."""
    with loop_filesystem(tmp_path / "e", "ext4", 64) as point:
        kind, problem, enable = probe_project(point / "ws")
        assert kind is None and "not mounted with project quotas" in (problem or ""), problem
        device = subprocess.run(
            ["findmnt", "-no", "SOURCE", str(point)], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert enable.startswith(f"tune2fs -O project,quota {device}"), enable
        assert "prjquota" in enable
        check = check_project_quotas(
            Settings(state_dir=point, workspace_quota="auto", _env_file=None)  # type: ignore[call-arg]
        )
        assert not check.ok and not check.required and "tune2fs" in check.fix, check
    with loop_filesystem(tmp_path / "b", "btrfs", 128) as point:
        subprocess.run(["btrfs", "quota", "disable", str(point)], check=True)
        kind, problem, enable = probe_project(point / "ws")
        assert kind is None and "quotas are not enabled" in (problem or ""), problem
        assert enable == f"btrfs quota enable {point / 'ws'}"
        subprocess.run(["btrfs", "quota", "enable", str(point)], check=True)
        assert probe_project(point / "ws")[:2] == ("btrfs", None)
        check = check_project_quotas(
            Settings(state_dir=point, workspace_quota="project", _env_file=None)  # type: ignore[call-arg]
        )
        assert check.ok and "btrfs" in check.detail, check
