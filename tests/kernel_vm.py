"""Run a command under another Linux kernel: Debian's User-mode Linux (issue 41).

The machines CI runs on have a kernel without quota support (no CONFIG_QFMT_V2, no
CONFIG_XFS_QUOTA), so ext4 `prjquota` and XFS `pquota` cannot be mounted there. The tests of
project-quota workspaces run under Debian's User-mode Linux kernel instead (6.1, with both):
a Linux kernel that runs as an ordinary process, so it needs no /dev/kvm. (These hosts' /dev/kvm
is a software hypervisor, KVM_PVM, that runs only PVM-built guest kernels: a stock kernel under
qemu -enable-kvm takes ~20 s to clear its BSS, then stops on an instruction it cannot emulate.)

scripts/_setup.sh unpacks the `user-mode-linux` and `busybox-static` .debs into .kernel-vm/
(nothing is installed on the host). The VM's root is this machine's own root filesystem seen
through hostfs, read-only, under an overlay whose upper layer is a tmpfs of the VM: the venv,
bwrap, python and the repository are at the same paths, everything is writable, nothing reaches
the host — but the host directories passed as `share` (mounted writable at their own paths) and
a private result directory, through which a command's stdout, stderr and exit status come
back. The VM's console goes to a log whose tail is in every error.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SRT_KERNEL_VM_DIR") or REPO / ".kernel-vm")
# Set in the VM: the tests meant for it run there and skip elsewhere, saying so.
INSIDE_ENV = "SRT_INSIDE_KERNEL_VM"
SETUP_HINT = (
    "run ./scripts/test once as root (it unpacks Debian's user-mode-linux and busybox-static"
    " into .kernel-vm/)"
)
# Modules the VM loads (with their dependencies from modules.dep); the rest is built in.
MODULES = ("loop", "overlay", "quota_v2")

INIT = """#!/bin/sh
# The VM's init (pid 1): a writable overlay over the host's root, then the command in it.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
BB={busybox}
R={result}
fail() {{ echo "kernel-vm: $*"; $BB poweroff -f; }}
mount -t proc proc /proc || fail "mount proc"
mountpoint -q /dev || mount -t devtmpfs dev /dev || fail "mount devtmpfs"
for ko in {modules}; do $BB insmod "$ko" || fail "insmod $ko"; done
mount -t tmpfs -o mode=0755 rw /mnt || fail "mount tmpfs"
mkdir -p /mnt/upper /mnt/work /mnt/root
mount -t overlay -o lowerdir=/,upperdir=/mnt/upper,workdir=/mnt/work overlay /mnt/root \\
    || fail "mount overlay"
N=/mnt/root
mount -t proc proc $N/proc
mount -t sysfs sys $N/sys
mount -t devtmpfs dev $N/dev
mkdir -p $N/dev/pts $N/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts $N/dev/pts
mount -t tmpfs -o mode=1777 shm $N/dev/shm
mount -t cgroup2 cgroup2 $N/sys/fs/cgroup || fail "mount cgroup2"
for d in tmp var/tmp; do mount -t tmpfs -o mode=1777 tmp "$N/$d"; done
mount -t tmpfs -o mode=0755 run $N/run
for path in $R {shares}; do
    mkdir -p "$N$path" && mount -t hostfs -o "$path" host "$N$path" || fail "mount share $path"
done
$BB ip link set lo up
$BB hostname kernel-vm
# (pivot_root, not chroot: a chrooted process may not make a user namespace, and bwrap does.)
mkdir -p $N/.vm-old
cd $N && $BB pivot_root . .vm-old || fail "pivot_root"
cd /
umount -l /.vm-old
echo KERNEL-VM-READY
/bin/sh $R/run.sh > $R/stdout 2> $R/stderr
echo $? > $R/rc.tmp
sync
mv $R/rc.tmp $R/rc
sync
echo KERNEL-VM-DONE
$BB poweroff -f
"""


class KernelVMError(RuntimeError):
    """The VM could not run the command: what failed and the console's tail."""


class Runner(Protocol):
    def __call__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 300,
        share: Sequence[str | os.PathLike[str]] = (),
        cwd: str | os.PathLike[str] = REPO,
    ) -> subprocess.CompletedProcess[str]: ...


# -- what scripts/_setup.sh unpacked -----------------------------------------------------------


def kernel() -> Path:
    path = CACHE / "uml" / "usr" / "bin" / "linux.uml"
    if not path.is_file():
        raise KernelVMError(f"no User-mode Linux kernel at {path}: {SETUP_HINT}")
    return path


def busybox() -> Path:
    path = CACHE / "busybox" / "bin" / "busybox"
    if not path.is_file():
        raise KernelVMError(f"no static busybox at {path}: {SETUP_HINT}")
    return path


def module_files() -> list[Path]:
    """The modules' files, each after what it depends on (from the kernel's modules.dep)."""
    found = sorted((CACHE / "uml" / "usr" / "lib" / "uml" / "modules").glob("*/modules.dep"))
    if not found:
        raise KernelVMError(f"no User-mode Linux modules in {CACHE / 'uml'}: {SETUP_HINT}")
    base = found[-1].parent
    deps: dict[str, list[str]] = {}
    files: dict[str, Path] = {}
    for line in found[-1].read_text().splitlines():
        name, _, rest = line.partition(":")
        stem = Path(name).name.removesuffix(".ko")
        files[stem] = base / name
        deps[stem] = [Path(d).name.removesuffix(".ko") for d in rest.split()]
    order: list[Path] = []

    def visit(stem: str) -> None:
        if stem not in files:
            raise KernelVMError(f"module {stem} is not in {found[-1]}")
        if files[stem] in order:
            return
        for dep in deps[stem]:
            visit(dep)
        order.append(files[stem])

    for stem in MODULES:
        visit(stem)
    return order


# -- running -----------------------------------------------------------------------------------


def default_env() -> dict[str, str]:
    """A root shell's plain environment, plus what the test setup passes down (SRT_*)."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
        INSIDE_ENV: "1",
    }
    env.update({k: v for k, v in os.environ.items() if k.startswith("SRT_")})
    env.pop("SRT_TEST_TMP", None)  # (the VM's own /tmp)
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def memory_dir() -> str:
    """Where the VM's memory file goes: a tmpfs if there is one (a disk file is slow)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no console log)"
    return "\n".join(text.replace("\r", "").splitlines()[-lines:]) or "(empty)"


def run_in_vm(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    share: Sequence[str | os.PathLike[str]] = (),
    cwd: str | os.PathLike[str] = REPO,
    memory_mib: int = 2048,
) -> subprocess.CompletedProcess[str]:
    """Run argv as root in a fresh VM; its stdout, stderr and exit status as CompletedProcess.

    `env` replaces the default environment (`default_env()`); `share` lists host directories
    mounted writable at their own paths (everything else is the host's root read-only under
    a tmpfs overlay). Raises KernelVMError when the VM does not boot or does not finish in
    `timeout` seconds (then it is killed, with every process it started), with the console's
    tail.
    """
    linux, bb, modules = kernel(), busybox(), module_files()
    with tempfile.TemporaryDirectory(prefix="srt-kernel-vm-") as tmp:
        result = Path(tmp) / "result"
        result.mkdir()
        console = Path(tmp) / "console.log"
        shares = [str(Path(s).resolve()) for s in share]
        for path in (bb, *modules, *map(Path, shares)):
            if " " in str(path):
                raise KernelVMError(f"the VM cannot take a path with a space: {path}")
        init = result / "init"
        init.write_text(
            INIT.format(
                busybox=bb,
                result=result,
                modules=" ".join(map(str, modules)),
                shares=" ".join(shares),
            )
        )
        init.chmod(0o755)
        env = default_env() if env is None else env
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        (result / "run.sh").write_text(
            f"cd {shlex.quote(os.fspath(cwd))} || exit 125\n"
            f"exec env -i {assignments} {shlex.join(argv)}\n"
        )
        cmd = [
            str(linux),
            f"mem={memory_mib}M",
            "root=/dev/root",
            "rootfstype=hostfs",
            "rootflags=/",
            "ro",
            f"init={init}",
            "con=null",
            "con0=null,fd:1",
            "quiet",
            f"uml_dir={tmp}",
        ]
        # (The VM's memory is a file in $TMPDIR, unlinked at once: sparse, gone at its exit.)
        started = time.monotonic()
        with open(console, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={
                    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                    "TMPDIR": memory_dir(),
                    "HOME": tmp,
                },
            )
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise KernelVMError(
                    f"the VM did not finish in {timeout:.0f}s (killed); console tail:\n"
                    f"{_tail(console)}"
                ) from None
            finally:
                _kill(proc)
        elapsed = time.monotonic() - started
        rc_file = result / "rc"
        if not rc_file.exists():
            raise KernelVMError(
                f"the VM stopped without running the command to its end (exit"
                f" {proc.returncode} after {elapsed:.1f}s); console tail:\n{_tail(console)}"
            )
        return subprocess.CompletedProcess(
            list(argv),
            int(rc_file.read_text().strip()),
            (result / "stdout").read_text(errors="replace"),
            (result / "stderr").read_text(errors="replace"),
        )


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the VM's process group (the kernel and a host process per VM address space) and
    wait until it is empty (the others are reaped by the host's init)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@pytest.fixture
def kernel_vm() -> Iterator[Runner]:
    """run_in_vm, for tests that need a kernel with quota support."""
    yield run_in_vm


def inside_vm() -> bool:
    return os.environ.get(INSIDE_ENV) == "1"


needs_vm_kernel = pytest.mark.skipif(
    not inside_vm(),
    reason=f"runs inside the kernel VM only ({INSIDE_ENV}=1): its outer test runs it there",
)
