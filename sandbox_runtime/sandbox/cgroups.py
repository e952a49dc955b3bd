"""Per-execution cgroups on cgroup v2, v1 and hybrid hosts: limits, accounting, killing."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from sandbox_runtime.sandbox.policy import MIB, SandboxLimits

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
MS_REMOUNT = 32


def _read(path: Path) -> str:
    return path.read_text()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> tuple[Path | None, dict[str, Path]]:
    """The cgroup2 mount point and the v1 mount point of each v1 controller."""
    unified: Path | None = None
    v1: dict[str, Path] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
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


def _cgroup_mounts_with_options() -> list[tuple[Path, str, list[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, *rest = right.split()
            if fstype in ("cgroup", "cgroup2"):
                options = rest[0].split(",") if rest else []
                found.append((Path(left.split()[4]), fstype, options))
    return found


def ensure_favordynmods(enable: bool) -> str:
    """Make task migrations between cgroups cheap (kernel >= 6.0 `favordynmods`).

    Without it, moving a process into a cgroup waits for an RCU grace period (~7 ms here) on
    every sandbox start. The option is global to the kernel; fork/exit get slightly dearer.
    Returns "on", or "off (why)".
    """
    try:
        mounts = _cgroup_mounts_with_options()
    except OSError as exc:
        return f"off (cannot read mounts: {exc})"
    if any("favordynmods" in options for _, _, options in mounts):
        return "on"
    if not enable:
        return "off (SANDBOX_CGROUP_FAVORDYNMODS=false)"
    if os.geteuid() != 0:
        return "off (needs root)"
    # Prefer the cgroup2 mount; a remount must repeat its current options or it drops them.
    mounts.sort(key=lambda m: m[1] != "cgroup2")
    libc = ctypes.CDLL(None, use_errno=True)
    for mount_point, fstype, options in mounts:
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


def _own_paths() -> tuple[str | None, dict[str, str]]:
    """This process's cgroup path in the unified hierarchy and per v1 controller."""
    unified: str | None = None
    v1: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            hier, controllers, path = line.rstrip("\n").split(":", 2)
            if hier == "0" and controllers == "":
                unified = path
            for c in controllers.split(","):
                if c in V1_CONTROLLERS:
                    v1[c] = path
    return unified, v1


@dataclass
class CgroupLayout:
    """Where this server creates execution cgroups, and which limits it can enforce there."""

    version: str = "none"  # "v2", "v1" or "none": which hierarchy enforces limits
    v2_base: Path | None = None
    v2_controllers: frozenset[str] = frozenset()
    v2_kill: bool = False
    v1_bases: dict[str, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    favordynmods: str = "off"

    @property
    def controllers(self) -> frozenset[str]:
        if self.version == "v2":
            return self.v2_controllers
        if self.version == "v1":
            return frozenset(self.v1_bases) - {"cpuacct"}
        return frozenset()

    def describe(self) -> str:
        kill = "cgroup.kill" if self.v2_kill else "signal loop"
        if self.version == "none":
            return "no usable cgroup hierarchy"
        return (
            f"{self.version} controllers={','.join(sorted(self.controllers)) or '-'} "
            f"kill={kill} favordynmods={self.favordynmods.split(' ')[0]}"
        )

    @classmethod
    def setup(cls, group_name: str, favordynmods: bool = True) -> CgroupLayout:
        """Find the hierarchies and create this server's parent group `group_name` in each."""
        layout = cls()
        layout.favordynmods = ensure_favordynmods(favordynmods)
        if os.geteuid() != 0:
            layout.problems.append("not running as root: per-execution cgroups need root")
            return layout
        try:
            unified_mount, v1_mounts = _mounts()
            unified_own, v1_own = _own_paths()
        except OSError as exc:
            layout.problems.append(f"cannot read cgroup mounts: {exc}")
            return layout
        if unified_mount is not None and unified_own is not None:
            layout._setup_v2(unified_mount / unified_own.lstrip("/"), group_name)
        if not layout.v2_controllers >= {"memory", "pids"}:
            layout._setup_v1(v1_mounts, v1_own, group_name)
        if layout.v2_controllers >= {"memory", "pids"}:
            layout.version = "v2"
        elif {"memory", "pids"} <= set(layout.v1_bases):
            layout.version = "v1"
        else:
            layout.problems.append(
                "no memory+pids cgroup controllers usable; limits fall back to rlimits only"
            )
        return layout

    def _setup_v2(self, own: Path, group_name: str) -> None:
        base = own / group_name
        try:
            available = set(_read(own / "cgroup.controllers").split())
            wanted = [c for c in V2_CONTROLLERS if c in available]
            enabled = set(_read(own / "cgroup.subtree_control").split())
            if set(wanted) - enabled:
                try:
                    _write(own / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    # "No internal processes": move this server into a leaf of its own first.
                    leaf = own / f"{group_name}-server"
                    leaf.mkdir(exist_ok=True)
                    _write(leaf / "cgroup.procs", str(os.getpid()))
                    _write(own / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            base.mkdir(exist_ok=True)
            if wanted:
                _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            self.v2_base = base
            self.v2_controllers = frozenset(
                set(_read(base / "cgroup.subtree_control").split()) & set(V2_CONTROLLERS)
            )
            self.v2_kill = (base / "cgroup.kill").exists()
        except OSError as exc:
            self.problems.append(f"cgroup v2 at {own} not usable: {exc}")

    def _setup_v1(self, mounts: dict[str, Path], own: dict[str, str], group_name: str) -> None:
        for controller in V1_CONTROLLERS:
            if controller not in mounts or controller not in own:
                continue
            base = mounts[controller] / own[controller].lstrip("/") / group_name
            try:
                base.mkdir(exist_ok=True)
                if controller == "memory":
                    with contextlib.suppress(OSError):
                        _write(base / "memory.use_hierarchy", "1")
                self.v1_bases[controller] = base
            except OSError as exc:
                self.problems.append(f"cgroup v1 {controller} at {base} not usable: {exc}")

    def create(self, name: str, limits: SandboxLimits) -> ExecutionCgroup:
        """A new group for one execution with `limits` written. Raises OSError on failure."""
        group = ExecutionCgroup(self)
        try:
            if self.v2_base is not None:
                d = self.v2_base / name
                d.mkdir()
                group.v2_dir = d
                if self.version == "v2":
                    _write_v2_limits(d, limits, self.v2_controllers)
            if self.version == "v1":
                for controller, base in self.v1_bases.items():
                    d = base / name
                    d.mkdir()
                    group.v1_dirs[controller] = d
                    _write_v1_limits(controller, d, limits)
        except OSError:
            group.remove()
            raise
        return group

    def cleanup_stale(self) -> None:
        """Remove empty execution groups a previous run of this server left behind."""
        bases = [*self.v1_bases.values(), *([self.v2_base] if self.v2_base else [])]
        for base in bases:
            for child in base.iterdir():
                if child.is_dir():
                    with contextlib.suppress(OSError):
                        child.rmdir()


def _write_v2_limits(d: Path, limits: SandboxLimits, controllers: frozenset[str]) -> None:
    if "memory" in controllers:
        _write(d / "memory.max", str(limits.memory_mb * MIB))
        with contextlib.suppress(OSError):
            _write(d / "memory.swap.max", "0")
        with contextlib.suppress(OSError):
            _write(d / "memory.oom.group", "1")
    if "pids" in controllers:
        _write(d / "pids.max", str(limits.pids))
    if "cpu" in controllers:
        _write(d / "cpu.max", f"{max(1000, int(limits.cpu_cores * CPU_PERIOD_US))} {CPU_PERIOD_US}")


def _write_v1_limits(controller: str, d: Path, limits: SandboxLimits) -> None:
    if controller == "memory":
        _write(d / "memory.limit_in_bytes", str(limits.memory_mb * MIB))
        with contextlib.suppress(OSError):  # only when swap accounting is on
            _write(d / "memory.memsw.limit_in_bytes", str(limits.memory_mb * MIB))
    elif controller == "pids":
        _write(d / "pids.max", str(limits.pids))
    elif controller == "cpu":
        _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(d / "cpu.cfs_quota_us", str(max(1000, int(limits.cpu_cores * CPU_PERIOD_US))))


@dataclass
class CgroupStats:
    oom_kills: int = 0
    pids_limit_hits: int = 0
    cpu_usage_ns: int = 0
    memory_peak_bytes: int = 0


@dataclass
class ExecutionCgroup:
    """One execution's group in every hierarchy in use."""

    layout: CgroupLayout
    v2_dir: Path | None = None
    v1_dirs: dict[str, Path] = field(default_factory=dict)

    @property
    def procs_files(self) -> list[str]:
        """The cgroup.procs files a new process must join."""
        files = [str(d / "cgroup.procs") for d in self.v1_dirs.values()]
        if self.v2_dir is not None:
            files.append(str(self.v2_dir / "cgroup.procs"))
        return files

    def pids(self) -> list[int]:
        d = self.v2_dir or self.v1_dirs.get("pids") or next(iter(self.v1_dirs.values()), None)
        if d is None:
            return []
        try:
            return [int(p) for p in _read(d / "cgroup.procs").split()]
        except OSError:
            return []

    def signal_all(self, sig: int) -> int:
        """Send `sig` to every process in the group; returns how many were signalled."""
        count = 0
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                count += 1
        return count

    def kill(self) -> None:
        """SIGKILL everything in the group, including processes forked while we kill."""
        if self.v2_dir is not None and self.layout.v2_kill:
            with contextlib.suppress(OSError):
                _write(self.v2_dir / "cgroup.kill", "1")
                return
        for _ in range(1000):  # each round kills all it sees; forks are bounded by pids.max
            if self.signal_all(signal.SIGKILL) == 0:
                return

    def stats(self) -> CgroupStats:
        s = CgroupStats()
        with contextlib.suppress(OSError, ValueError):
            if self.layout.version == "v2" and self.v2_dir is not None:
                s.oom_kills = _keyed(self.v2_dir / "memory.events").get("oom_kill", 0)
                s.pids_limit_hits = _keyed(self.v2_dir / "pids.events").get("max", 0)
                s.cpu_usage_ns = _keyed(self.v2_dir / "cpu.stat").get("usage_usec", 0) * 1000
                if (self.v2_dir / "memory.peak").exists():
                    s.memory_peak_bytes = int(_read(self.v2_dir / "memory.peak"))
            elif self.layout.version == "v1":
                if "memory" in self.v1_dirs:
                    m = self.v1_dirs["memory"]
                    s.oom_kills = _keyed(m / "memory.oom_control").get("oom_kill", 0)
                    s.memory_peak_bytes = int(_read(m / "memory.max_usage_in_bytes"))
                if "pids" in self.v1_dirs:
                    s.pids_limit_hits = _keyed(self.v1_dirs["pids"] / "pids.events").get("max", 0)
                if "cpuacct" in self.v1_dirs:
                    s.cpu_usage_ns = int(_read(self.v1_dirs["cpuacct"] / "cpuacct.usage"))
        return s

    def remove(self) -> bool:
        """Remove the group's directories; False while processes are still in it."""
        ok = True
        dirs = [*self.v1_dirs.values(), *([self.v2_dir] if self.v2_dir else [])]
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                ok = False  # EBUSY while the last processes finish exiting: retried
        return ok


def _keyed(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value.strip())
    return out
