"""Project quotas for real, under a kernel that has them (issue 41): the kernel VM.

This host's kernel cannot mount ext4 `prjquota` or XFS `pquota` (no CONFIG_QFMT_V2, no
CONFIG_XFS_QUOTA), so the tests marked `needs_vm_kernel` run inside tests/kernel_vm.py's VM
(Debian's User-mode Linux over this machine's root, read-only) and skip anywhere else; the
outer tests here start the VM, run pytest in it, and assert from its JUnit report that those
tests passed (a VM that cannot boot fails them, never skips them).

Inside: the kernel facts project mode relies on, on a loop-mounted ext4 (`-O project,quota`,
mounted `prjquota`) and an XFS (mounted `pquota`) made by the test, with the raw interfaces
(FS_IOC_FSSETXATTR, quotactl_fd): a directory's project id and PROJINHERIT, a byte and an inode
limit that an unprivileged writer meets, usage read back with Q_GETQUOTA. Then the product's
project mode on each, tests/test_workspace_quota.py run in the VM with SRT_QUOTA_FS: a real
server, real sandboxes, the official client.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import struct
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernel_vm import REPO, KernelVMError, default_env, kernel, needs_vm_kernel, run_in_vm
from loopfs_harness import loop_filesystem
from mcp_harness import traversable_by_others

MIB = 1024 * 1024
FSXATTR = struct.Struct("=IIIII8x")
FS_IOC_FSGETXATTR = 0x801C581F
FS_IOC_FSSETXATTR = 0x401C5820
FS_XFLAG_PROJINHERIT = 0x200
DQBLK = struct.Struct("=QQQQQQQQI4x")  # struct if_dqblk
Q_GETQUOTA, Q_SETQUOTA, PRJQUOTA, QIF_LIMITS = 0x800007, 0x800008, 2, 5
SYS_QUOTACTL_FD = 443
NOBODY = 65534
CAP_SYS_RESOURCE = 24
OVER = (errno.EDQUOT, errno.ENOSPC)  # (ext4 says EDQUOT, XFS ENOSPC for a project)

_libc = ctypes.CDLL(None, use_errno=True)
# Give `path` project id 1, by FS_IOC_FSGETXATTR and FS_IOC_FSSETXATTR.
SET_PROJID = (
    "import fcntl, os; fd = os.open({path!r}, os.O_RDONLY); raw = bytearray(28);"
    "fcntl.ioctl(fd, 0x801C581F, raw); raw[12:16] = (1).to_bytes(4, 'little');"
    "fcntl.ioctl(fd, 0x401C5820, raw)"
)


def set_project(path: Path, projid: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        raw = bytearray(FSXATTR.size)
        fcntl.ioctl(fd, FS_IOC_FSGETXATTR, raw)
        xflags, extsize, nextents, _, cow = FSXATTR.unpack(raw)
        new = FSXATTR.pack(xflags | FS_XFLAG_PROJINHERIT, extsize, nextents, projid, cow)
        fcntl.ioctl(fd, FS_IOC_FSSETXATTR, new)
    finally:
        os.close(fd)


def get_project(path: Path) -> tuple[int, int]:
    """(xflags, project id) of `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = bytearray(FSXATTR.size)
        fcntl.ioctl(fd, FS_IOC_FSGETXATTR, raw)
        xflags, _, _, projid, _ = FSXATTR.unpack(raw)
        return xflags, projid
    finally:
        os.close(fd)


def quotactl(point: Path, command: int, projid: int, block: bytearray) -> None:
    fd = os.open(point, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = (ctypes.c_char * len(block)).from_buffer(block)
        cmd = (command << 8) | PRJQUOTA
        if _libc.syscall(SYS_QUOTACTL_FD, fd, cmd, projid, buf) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"quotactl_fd({point}, {command:#x}, {projid})")
    finally:
        os.close(fd)


def set_limits(point: Path, projid: int, limit_bytes: int, inodes: int) -> None:
    block = bytearray(DQBLK.pack(limit_bytes // 1024, 0, 0, inodes, 0, 0, 0, 0, QIF_LIMITS))
    quotactl(point, Q_SETQUOTA, projid, block)


def usage(point: Path, projid: int) -> tuple[int, int, int, int]:
    """(bytes used, byte limit, inodes used, inode limit) of a project."""
    block = bytearray(DQBLK.size)
    quotactl(point, Q_GETQUOTA, projid, block)
    bhard, _, space, ihard, _, inodes, _, _, _ = DQBLK.unpack(block)
    return space, bhard * 1024, inodes, ihard


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    """argv run as an unprivileged user (root's CAP_SYS_RESOURCE passes ext4's limits)."""
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return subprocess.run([*drop, *argv], capture_output=True, text=True, timeout=60)


@pytest.fixture(params=["ext4-project", "xfs"])
def quota_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    traversable_by_others(tmp_path)  # (the unprivileged writers reach it)
    with loop_filesystem(tmp_path, request.param, 64 if request.param != "xfs" else 320) as p:
        yield p


@needs_vm_kernel
def test_inside_a_project_directory_is_limited(quota_fs: Path) -> None:
    """A directory given a project id and PROJINHERIT passes both to what is made in it; the
    project's byte and inode limits stop an unprivileged writer with EDQUOT (ext4) or ENOSPC
    (XFS); Q_GETQUOTA reads the use back; a limit set to 0 is gone."""
    ws, projid = quota_fs / "ws", 1_234_567
    ws.mkdir()
    set_project(ws, projid)
    os.chown(ws, NOBODY, NOBODY)
    set_limits(quota_fs, projid, 4 * MIB, 16)
    (ws / "sub").mkdir()
    xflags, got = get_project(ws / "sub")
    assert got == projid and xflags & FS_XFLAG_PROJINHERIT, (xflags, got)

    made = as_nobody("sh", "-c", f"for i in $(seq 1 40); do touch {ws}/f$i || exit 7; done")
    assert made.returncode == 7, made
    assert any(os.strerror(c) in made.stderr for c in OVER), made.stderr
    assert "/f15" in made.stderr, made.stderr  # (ws, sub and 14 files: 16 inodes)
    assert usage(quota_fs, projid)[2:] == (16, 16)
    as_nobody("sh", "-c", f"rm {ws}/f*")

    wrote = as_nobody("dd", "if=/dev/zero", f"of={ws}/big", "bs=64k", "count=160", "conv=fsync")
    assert wrote.returncode != 0, wrote
    assert any(os.strerror(c) in wrote.stderr for c in OVER), wrote.stderr
    space, limit, inodes, ilimit = usage(quota_fs, projid)
    assert limit == 4 * MIB and ilimit == 16, (limit, ilimit)
    assert 3 * MIB <= space <= 4 * MIB and inodes == 3, (space, inodes)  # (ws, sub, big)
    assert get_project(ws / "big")[1] == projid

    set_limits(quota_fs, projid, 0, 0)
    assert usage(quota_fs, projid)[1::2] == (0, 0)
    more = as_nobody("dd", "if=/dev/zero", f"of={ws}/more", "bs=1M", "count=8", "conv=fsync")
    assert more.returncode == 0, more.stderr


@needs_vm_kernel
def test_inside_what_root_may_and_a_user_namespace_may_not(quota_fs: Path) -> None:
    """Root past a project limit: ext4 lets CAP_SYS_RESOURCE through, XFS refuses root too;
    a thread of root's that took CAP_SYS_RESOURCE out of its effective set is refused on both
    (how a server that writes into workspaces is held to their quotas). A process in a
    user namespace (every sandbox) cannot change a project id, even its own files' (EINVAL)."""
    ws, projid = quota_fs / "ws", 7_654_321
    ws.mkdir()
    set_project(ws, projid)
    set_limits(quota_fs, projid, 2 * MIB, 100)
    data = os.urandom(3 * MIB)
    ext4 = mount_type(quota_fs) == "ext4"
    passed = write_past(ws / "root.bin", data)
    assert passed == ext4, f"root wrote past the limit: {passed}"
    (ws / "root.bin").unlink()
    errors: list[bool] = []
    worker = threading.Thread(target=lambda: errors.append(without_sys_resource(ws, data)))
    worker.start()
    worker.join()
    assert errors == [False], "a thread without CAP_SYS_RESOURCE is held to the limit"
    if ext4:
        assert write_past(ws / "again.bin", data), "the other threads keep theirs"

    os.chown(ws, NOBODY, NOBODY)
    moved = as_nobody(
        "unshare", "--user", "--map-root-user", "/usr/bin/python3", "-c",
        SET_PROJID.format(path=str(ws)),
    )  # fmt: skip
    assert moved.returncode != 0 and "Invalid argument" in moved.stderr, moved
    assert get_project(ws)[1] == projid


def write_past(path: Path, data: bytes) -> bool:
    """Whether `data` was written whole (False: refused with EDQUOT or ENOSPC)."""
    try:
        path.write_bytes(data)
        os.sync()
    except OSError as exc:
        assert exc.errno in OVER, exc
        return False
    return True


def without_sys_resource(ws: Path, data: bytes) -> bool:
    """write_past in this thread after taking CAP_SYS_RESOURCE out of its effective set
    (capabilities are a thread's own: capset changes only the caller's)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    caps = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; two words each
    assert _libc.capget(header, caps) == 0
    caps[0] &= ~(1 << CAP_SYS_RESOURCE)
    assert _libc.capset(header, caps) == 0, ctypes.get_errno()
    return write_past(ws / "thread.bin", data)


def mount_type(point: Path) -> str:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[1] == str(point):
                return fields[2]
    return ""


# -- outside: the VM itself -------------------------------------------------------------------


def vm_processes() -> set[int]:
    """The host processes of User-mode Linux kernels (each VM has several)."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{name}/exe").resolve() == kernel():
                    found.add(int(name))
    return found


def test_the_vm_runs_a_command_and_gives_back_only_its_shares(tmp_path: Path) -> None:
    """A command in the VM: its stdout, stderr and exit status come back, it runs as root on
    this machine's files under a kernel with quota support, a share is written through, and
    what it writes elsewhere (even over the host's own files) stays in the VM."""
    before = vm_processes()
    outside = REPO / "tests" / "kernel_vm.py"
    original = outside.read_bytes()
    script = (
        f"echo out; echo err >&2; id -u; uname -r; grep -c '^quota_v2 ' /proc/modules;"
        f" echo made > {tmp_path}/shared.txt; echo over > {outside}; touch /usr/vm-only;"
        f" test -f {outside} && exit 42"
    )
    done = run_in_vm(["sh", "-c", script], share=[tmp_path], timeout=120)
    assert done.returncode == 42, done
    assert done.stdout.split("\n")[:2] == ["out", "0"] and done.stderr == "err\n", done
    assert done.stdout.split("\n")[3] == "1", "quota_v2 loaded"
    assert (tmp_path / "shared.txt").read_text() == "made\n"
    assert outside.read_bytes() == original and not Path("/usr/vm-only").exists()
    assert vm_processes() <= before, "the VM's processes are gone"


def test_a_vm_past_its_timeout_is_killed(tmp_path: Path) -> None:
    """A command that does not end in time: the VM is killed with all its processes, and the
    error says so with the console's tail."""
    before = vm_processes()
    with pytest.raises(KernelVMError, match=r"did not finish in 5s \(killed\)"):
        run_in_vm(["sleep", "600"], timeout=5)
    assert vm_processes() <= before


# -- outside: start the VM, run the tests above (and the product's) in it ----------------------


def run_pytest_in_vm(
    tmp_path: Path, name: str, args: list[str], env_extra: dict[str, str], timeout: float
) -> dict[str, str]:
    """pytest `args` in the VM; {test id: outcome} from its JUnit report, printed with times."""
    report = tmp_path / f"{name}.xml"
    env = {**default_env(), **env_extra}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
    argv += [f"--junitxml={report}", *args]
    started = time.monotonic()
    done = run_in_vm(argv, env=env, share=[tmp_path], timeout=timeout)
    took = time.monotonic() - started
    assert report.exists(), f"pytest in the VM wrote no report:\n{done.stdout}\n{done.stderr}"
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = kind
        print(f"in the VM: {case.get('name')}: {kind} in {float(case.get('time', 0)):.1f} s")
    print(f"in the VM: {name}: {took:.1f} s with boot")
    assert outcomes, f"no test ran in the VM:\n{done.stdout[-3000:]}"
    bad = {k: v for k, v in outcomes.items() if v != "passed"}
    assert not bad and done.returncode == 0, f"{bad}\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    return outcomes


@pytest.mark.timeout(600)
def test_the_kernel_facts_hold_in_the_vm(tmp_path: Path) -> None:
    """The `inside` tests of this module pass under a kernel with quota support."""
    outcomes = run_pytest_in_vm(tmp_path, "facts", [__file__, "-k", "inside"], {}, timeout=300)
    assert len(outcomes) == 4, outcomes  # (two tests on ext4 and on XFS)


@pytest.mark.e2e
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("fs", ["ext4-project", "xfs"])
def test_project_mode_on_the_filesystem_in_the_vm(tmp_path: Path, fs: str) -> None:
    """tests/test_workspace_quota.py on an ext4 `prjquota` / XFS `pquota` state filesystem
    made in the VM: project mode chosen by `auto`, the quota from the sandbox and through
    uploads, warm adoption, snapshots, retention, a full disk. (Not its 2,000 sessions: ~40 s
    each in the VM, for the store's code that the same module runs on btrfs on the host; an
    ext4 or XFS workspace adds one mkdir, two ioctls and a quotactl, tested here.)"""
    module = REPO / "tests" / "test_workspace_quota.py"
    args = [str(module), "-k", "not two_thousand"]
    outcomes = run_pytest_in_vm(tmp_path, fs, args, {"SRT_QUOTA_FS": fs}, 900)
    assert len(outcomes) >= 5, outcomes
