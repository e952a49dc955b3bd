"""The cgroup filesystem as this server finds it: where the hierarchies are mounted, where
this process sits in them, the `favordynmods` mount option, and reading and writing the
files in a group (one syscall each: no Python file objects). Parsing is kept apart from the
reading so it can be checked without a cgroup hierarchy."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterable
from pathlib import Path

from loguru import logger

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")
MS_REMOUNT = 32


def read(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def write(path: Path | str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def try_write(path: Path, value: str) -> bool:
    try:
        write(path, value)
        return True
    except OSError:
        return False


def keyed(text: str) -> dict[str, int]:
    """`key value` lines, as cgroup counter files have them."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value.strip())
    return out


def parse_mounts(mountinfo: Iterable[str]) -> tuple[Path | None, dict[str, Path]]:
    """The cgroup2 mount point and the v1 mount point of each v1 controller, from the lines
    of /proc/self/mountinfo."""
    unified: Path | None = None
    v1: dict[str, Path] = {}
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        parts = left.split()
        fstype, _source, *opts = right.split()
        mount_point = Path(parts[4])
        if fstype == "cgroup2" and unified is None:
            unified = mount_point
        elif fstype == "cgroup":
            for opt in ",".join(opts).split(","):
                if opt in V1_CONTROLLERS and opt not in v1:
                    v1[opt] = mount_point
    return unified, v1


def mounts() -> tuple[Path | None, dict[str, Path]]:
    """parse_mounts of this process's mounts. Raises OSError."""
    with open("/proc/self/mountinfo") as f:
        return parse_mounts(f)


def parse_mount_options(mountinfo: Iterable[str]) -> list[tuple[Path, str, list[str]]]:
    """(mount point, fstype, super options) of every cgroup mount in mountinfo's lines."""
    found = []
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        fstype, _source, *rest = right.split()
        if fstype in ("cgroup", "cgroup2"):
            options = rest[0].split(",") if rest else []
            found.append((Path(left.split()[4]), fstype, options))
    return found


def parse_own_paths(proc_cgroup: Iterable[str]) -> tuple[str | None, dict[str, str]]:
    """A process's cgroup path in the unified hierarchy and per v1 controller, from the
    lines of /proc/PID/cgroup."""
    unified: str | None = None
    v1: dict[str, str] = {}
    for line in proc_cgroup:
        hier, controllers, path = line.rstrip("\n").split(":", 2)
        if hier == "0" and controllers == "":
            unified = path
        for c in controllers.split(","):
            if c in V1_CONTROLLERS:
                v1[c] = path
    return unified, v1


def own_paths() -> tuple[str | None, dict[str, str]]:
    """parse_own_paths of this process. Raises OSError."""
    with open("/proc/self/cgroup") as f:
        return parse_own_paths(f)


def ensure_favordynmods(enable: bool) -> str:
    """Make task migrations between cgroups cheap (kernel >= 6.0 `favordynmods`).

    Without it, moving a process into a cgroup waits for an RCU grace period (~7 ms here) on
    every sandbox start. The option is global to the kernel; fork/exit get slightly dearer.
    Returns "on", or "off (why)".
    """
    try:
        with open("/proc/self/mountinfo") as f:
            found = parse_mount_options(f)
    except OSError as exc:
        return f"off (cannot read mounts: {exc})"
    if any("favordynmods" in options for _, _, options in found):
        return "on"
    if not enable:
        return "off (SANDBOX_CGROUP_FAVORDYNMODS=false)"
    if os.geteuid() != 0:
        return "off (needs root)"
    # Prefer the cgroup2 mount; a remount must repeat its current options or it drops them.
    found.sort(key=lambda m: m[1] != "cgroup2")
    libc = ctypes.CDLL(None, use_errno=True)
    for mount_point, fstype, options in found:
        data = ",".join([o for o in options if o not in ("rw", "ro")] + ["favordynmods"])
        rc = libc.mount(None, str(mount_point).encode(), fstype.encode(), MS_REMOUNT, data.encode())
        if rc == 0:
            logger.info(
                "cgroups: enabled favordynmods on {} (fast per-execution cgroups; "
                "SANDBOX_CGROUP_FAVORDYNMODS=false leaves the host as it is)",
                mount_point,
            )
            return "on"
        logger.debug("favordynmods on {}: errno {}", mount_point, ctypes.get_errno())
    return "off (the kernel refused: needs Linux >= 6.0)"
