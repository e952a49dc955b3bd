"""Per-execution cgroups on cgroup v2, v1 and hybrid hosts: limits, accounting, killing."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from sandbox_runtime.domain.limits import MIB, SandboxLimits
from sandbox_runtime.fds import limit as fd_limit

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
MS_REMOUNT = 32
# A server's parent group is named `<group name>.<pid>.<start time>.<pid namespace>`: unique
# to the running process, so two servers on one host (even with one replica id) never share
# one, and a group whose process is gone can be told from a live server's.
INSTANCE_NAME = re.compile(r"srt[A-Za-z0-9_.-]*?\.(\d+)\.(\d+)\.(\d+)(?:-server)?")
STALE_KILL_SECONDS = 2.0
POOL_FD_SHARE = 4  # pooled groups hold at most 1/4 of the descriptor limit


def _read(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


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


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None if there is no such process."""
    try:
        text = _read(Path(f"/proc/{pid}/stat"))
    except OSError:
        return None
    try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        return int(text.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def instance_name(group_name: str) -> str:
    """This process's parent group name for `group_name` (see INSTANCE_NAME)."""
    pid = os.getpid()
    return f"{group_name}.{pid}.{_start_time(pid) or 0}.{_pid_namespace()}"


def owner_gone(name: str) -> bool:
    """Whether `name` is a server's parent group (or server leaf) whose process has ended.
    A group of another pid namespace is never taken for gone: its pid means nothing here."""
    match = INSTANCE_NAME.fullmatch(name)
    if match is None:
        return False
    pid, start, namespace = map(int, match.groups())
    if namespace != _pid_namespace():
        return False
    return _start_time(pid) != start


def _remove_stale_tree(group: Path) -> bool:
    """Kill what is left in `group` and its descendants, remove them all; whether it is gone."""
    with os.scandir(group) as entries:
        children = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    for child in children:
        _remove_stale_tree(child)
    deadline = time.monotonic() + STALE_KILL_SECONDS
    killed = False
    while True:
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        if (group / "cgroup.kill").exists():
            if not killed:
                killed = _try_write(group / "cgroup.kill", "1")
        else:  # v1, or v2 before Linux 5.14: each round kills all it sees
            with contextlib.suppress(OSError, ValueError):
                for pid in map(int, _read(group / "cgroup.procs").split()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


@dataclass
class CgroupLayout:
    """Where this server creates execution cgroups, and which limits it can enforce there."""

    version: str = "none"  # "v2", "v1" or "none": which hierarchy enforces limits
    name: str = ""  # this server's parent group in each hierarchy (see instance_name)
    legacy_name: str = ""  # what servers before per-process names called it
    v2_base: Path | None = None
    v2_controllers: frozenset[str] = frozenset()
    v2_kill: bool = False
    v1_bases: dict[str, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    favordynmods: str = "off"
    pool_size: int = 0  # how many idle groups to keep for reuse
    _idle: list[ExecutionCgroup] = field(default_factory=list)

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
        """Find the hierarchies and create this server's parent group in each: named for
        `group_name` and this process (instance_name), so no other server uses it."""
        layout = cls(name=instance_name(group_name), legacy_name=group_name)
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
            layout._setup_v2(unified_mount / unified_own.lstrip("/"), layout.name)
        if not layout.v2_controllers >= {"memory", "pids"}:
            layout._setup_v1(v1_mounts, v1_own, layout.name)
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
            if controller == "cpuacct" and self.v2_base is not None:
                continue  # hybrid: the unified group's cpu.stat counts CPU time, one join fewer
            base = mounts[controller] / own[controller].lstrip("/") / group_name
            try:
                base.mkdir(exist_ok=True)
                if controller == "memory":
                    with contextlib.suppress(OSError):
                        _write(base / "memory.use_hierarchy", "1")
                self.v1_bases[controller] = base
            except OSError as exc:
                self.problems.append(f"cgroup v1 {controller} at {base} not usable: {exc}")

    def acquire(self, limits: SandboxLimits) -> ExecutionCgroup:
        """A group for one execution with `limits` in force: an idle one from the pool when
        there is one (making and removing cgroups costs more than the rest of the cgroup
        work of a sandbox start together), else a new one. Raises OSError."""
        while self._idle:
            group = self._idle.pop()
            try:
                group.apply(limits)
                return group
            except OSError as exc:
                logger.debug("cgroups: idle group unusable ({}); removing it", exc)
                group.remove()
        group = self.create(f"x-{uuid.uuid4().hex}")
        try:
            group.apply(limits)
        except OSError:
            group.remove()
            raise
        return group

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def release(self, group: ExecutionCgroup) -> bool:
        """Take back the group of an execution that has ended: pooled if it is empty and clean,
        else removed. False while processes are still leaving it (call again later)."""
        if any(g is group for g in self._idle):  # (released twice: never hand it out twice)
            logger.error("cgroups: a group was released twice; kept once")
            return True
        if group.busy():
            return False
        if group.removing:  # (partly removed already: finish that, never hand it out again)
            return group.remove()
        if len(self._idle) < self.pool_size and group.make_reusable():
            # Pooled groups keep their files open: at most a share of the descriptor limit,
            # else a burst leaves the server too few for anything else once it is over.
            held = sum(g.fd_count for g in self._idle) + group.fd_count
            if held <= fd_limit() // POOL_FD_SHARE:
                self._idle.append(group)
                return True
        return group.remove()

    def trim_idle(self) -> int:
        """Remove every pooled group (the process is out of descriptors, and each pooled
        group holds a few); returns how many went."""
        idle, self._idle = self._idle, []
        for group in idle:
            group.remove()
        if idle:
            logger.info("cgroups: {} pooled groups removed to free descriptors", len(idle))
        return len(idle)

    def create(self, name: str) -> ExecutionCgroup:
        """A new, empty group in every hierarchy in use (no limits yet). Raises OSError."""
        group = ExecutionCgroup(self)
        try:
            if self.v2_base is not None:
                d = self.v2_base / name
                d.mkdir()
                group.v2_dir = d
            if self.version == "v1":
                made: dict[Path, Path] = {}
                for controller, base in self.v1_bases.items():
                    if base not in made:  # co-mounted controllers (cpu,cpuacct) share one
                        made[base] = base / name
                        made[base].mkdir()
                    group.v1_dirs[controller] = made[base]
        except OSError:
            group.remove()
            raise
        return group

    @property
    def bases(self) -> set[Path]:
        """This server's parent group in each hierarchy in use."""
        return {*self.v1_bases.values(), *([self.v2_base] if self.v2_base else [])}

    def close(self) -> None:
        """Remove every pooled group, then this server's parent groups if they are empty."""
        idle, self._idle = self._idle, []
        for group in idle:
            group.remove()
        for base in self.bases:
            with contextlib.suppress(OSError):
                base.rmdir()

    def cleanup_stale(self) -> int:
        """Remove the parent groups (and server leaves) that servers which have ended left
        beside ours, killing what is still in them; live servers' groups, whatever their
        replica id, are left alone. Returns how many were removed."""
        removed = 0
        for parent in {base.parent for base in self.bases}:
            try:
                with os.scandir(parent) as entries:
                    names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for name in names:
                if name == self.name or not owner_gone(name):
                    continue
                if _remove_stale_tree(parent / name):
                    removed += 1
                    logger.info("cgroups: removed {}, left by a server that has ended", name)
                else:
                    logger.warning("cgroups: could not remove {} (a stopped server's)", name)
            # An older version's group (no owner in its name): its empty groups, as it did.
            legacy = parent / self.legacy_name
            if self.legacy_name and legacy.is_dir() and not legacy.is_symlink():
                for child in legacy.iterdir():
                    with contextlib.suppress(OSError):
                        child.rmdir()
                with contextlib.suppress(OSError):
                    legacy.rmdir()
        return removed


def _write(path: Path | str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _try_write(path: Path, value: str) -> bool:
    try:
        _write(path, value)
        return True
    except OSError:
        return False


def _limit_values(layout: CgroupLayout, limits: SandboxLimits) -> dict[str, str]:
    """Every limit file to write, relative to the controller's directory, keyed "ctl/file"."""
    memory = str(limits.memory_mb * MIB)
    quota = str(max(1000, int(limits.cpu_cores * CPU_PERIOD_US)))
    values: dict[str, str] = {}
    if layout.version == "v2":
        controllers = layout.v2_controllers
        if "memory" in controllers:
            values["v2/memory.max"] = memory
            values["v2/memory.swap.max?"] = "0"  # "?": the kernel may lack the file
            values["v2/memory.oom.group?"] = "1"
        if "pids" in controllers:
            values["v2/pids.max"] = str(limits.pids)
        if "cpu" in controllers:
            values["v2/cpu.max"] = f"{quota} {CPU_PERIOD_US}"
    elif layout.version == "v1":
        if "memory" in layout.v1_bases:
            values["memory/memory.limit_in_bytes"] = memory
            values["memory/memory.memsw.limit_in_bytes?"] = memory  # with swap accounting
        if "pids" in layout.v1_bases:
            values["pids/pids.max"] = str(limits.pids)
        if "cpu" in layout.v1_bases:
            values["cpu/cpu.cfs_period_us"] = str(CPU_PERIOD_US)
            values["cpu/cpu.cfs_quota_us"] = quota
    return values


@dataclass
class CgroupStats:
    oom_kills: int = 0
    pids_limit_hits: int = 0
    cpu_usage_ns: int = 0
    memory_peak_bytes: int = 0


# Pooled groups must come back this empty: what a finished execution left charged (page
# cache of its files) would count against the next one's memory limit.
REUSE_MAX_CHARGED_BYTES = 4 * MIB


@dataclass
class ExecutionCgroup:
    """One execution's group in every hierarchy in use."""

    layout: CgroupLayout
    v2_dir: Path | None = None
    v1_dirs: dict[str, Path] = field(default_factory=dict)
    written: dict[str, str] = field(default_factory=dict)  # limit files as last written
    # Counters are cumulative over the group's life; a pooled group reports what happened
    # since it was last handed out.
    baseline: CgroupStats = field(default_factory=CgroupStats)
    _peak_fd: int | None = None  # v2: memory.peak, reset for this fd when handed out
    removing: bool = False  # remove() was called: some of its directories may be gone
    _procs_fds: list[int] = field(default_factory=list)
    # Counter files stay open while the group lives (a pooled one is read twice per execution
    # and opening a cgroup file costs several times reading it); cgroup.procs cannot be
    # re-read this way: an open cgroup.procs keeps showing what it showed first.
    _stat_fds: dict[str, int] = field(default_factory=dict)  # by "ctl/file", as _file()

    @property
    def fd_count(self) -> int:
        """Descriptors this group holds open."""
        return len(self._procs_fds) + len(self._stat_fds) + (self._peak_fd is not None)

    def _file(self, key: str) -> Path:
        controller, _, name = key.rstrip("?").partition("/")
        directory = self.v2_dir if controller == "v2" else self.v1_dirs[controller]
        assert directory is not None
        return directory / name

    def apply(self, limits: SandboxLimits) -> None:
        """Write the limit files that differ from what the group has. Raises OSError."""
        values = _limit_values(self.layout, limits)
        memory, memsw = "memory/memory.limit_in_bytes", "memory/memory.memsw.limit_in_bytes?"
        if memsw in self.written and int(values[memory]) > int(self.written.get(memory, "0")):
            # v1 keeps memory <= memory+swap: raising both, the second must go first.
            values = {memsw: values.pop(memsw), **values}
        for key, value in values.items():
            if self.written.get(key) == value:
                continue
            if key.endswith("?"):
                _try_write(self._file(key), value)
            else:
                _write(self._file(key), value)
            self.written[key] = value

    @property
    def procs_files(self) -> list[str]:
        """The cgroup.procs files a new process must join."""
        files = [str(d / "cgroup.procs") for d in dict.fromkeys(self.v1_dirs.values())]
        if self.v2_dir is not None:
            files.append(str(self.v2_dir / "cgroup.procs"))
        return files

    def procs_fds(self) -> list[int]:
        """The group's cgroup.procs files, open for writing (kept open while the group lives:
        a pooled one is joined often). Writing a pid to each moves that process into the
        group; the kernel checks such a write against the credentials of this opener, so
        whoever is handed these fds can join its own processes. Raises OSError."""
        if not self._procs_fds:
            opened: list[int] = []
            try:
                for procs in self.procs_files:
                    opened.append(os.open(procs, os.O_WRONLY | os.O_CLOEXEC))
            except OSError:
                for fd in opened:  # all or none: a group never joins only some hierarchies
                    os.close(fd)
                raise
            self._procs_fds = opened
        return self._procs_fds

    def _procs(self) -> str:
        """The group's cgroup.procs (one hierarchy holds them all). Raises OSError."""
        d = self.v2_dir or self.v1_dirs.get("pids") or next(iter(self.v1_dirs.values()), None)
        return "" if d is None else _read(d / "cgroup.procs")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._procs().split()]
        except OSError:
            return []

    def busy(self) -> bool:
        """Whether processes are (or may be: unreadable) still in the group."""
        try:
            # pids.current (tasks not yet reaped) reads through a kept fd; cgroup.procs cannot.
            if "pids" in self.v1_dirs:
                return int(self._stat("pids/pids.current")) > 0
            if self.layout.version == "v2" and "pids" in self.layout.v2_controllers:
                return int(self._stat("v2/pids.current")) > 0
            return bool(self._procs().strip())
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            return True

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
        if not self.busy():  # (the common case at a sandbox's end: one read, no write)
            return
        if self.v2_dir is not None and self.layout.v2_kill:
            with contextlib.suppress(OSError):
                _write(self.v2_dir / "cgroup.kill", "1")
                return
        for _ in range(1000):  # each round kills all it sees; forks are bounded by pids.max
            if self.signal_all(signal.SIGKILL) == 0:
                return

    def _stat(self, key: str) -> str:
        """The current text of counter file `key` ("ctl/file"), through an fd kept open.
        Raises OSError."""
        fd = self._stat_fds.get(key)
        if fd is None:
            fd = self._stat_fds[key] = os.open(self._file(key), os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, 65536, 0).decode()

    def _keyed(self, key: str) -> dict[str, int]:
        return _keyed(self._stat(key))

    def _cpu_usage_ns(self) -> int:
        """CPU time the group's processes used. Raises OSError, ValueError."""
        if self.v2_dir is not None:  # cpu.stat is there even with no controller enabled
            return self._keyed("v2/cpu.stat").get("usage_usec", 0) * 1000
        if "cpuacct" in self.v1_dirs:
            return int(self._stat("cpuacct/cpuacct.usage"))
        return 0

    def _counters(self) -> CgroupStats:
        """The group's cumulative counters (peak memory: since the last reset)."""
        s = CgroupStats()
        with contextlib.suppress(OSError, ValueError):
            s.cpu_usage_ns = self._cpu_usage_ns()
            if self.layout.version == "v2" and self.v2_dir is not None:
                s.oom_kills = self._keyed("v2/memory.events").get("oom_kill", 0)
                s.pids_limit_hits = self._keyed("v2/pids.events").get("max", 0)
                if self._peak_fd is not None:
                    s.memory_peak_bytes = int(os.pread(self._peak_fd, 64, 0))
                elif (self.v2_dir / "memory.peak").exists():
                    s.memory_peak_bytes = int(self._stat("v2/memory.peak"))
            elif self.layout.version == "v1":
                if "memory" in self.v1_dirs:
                    s.oom_kills = self._keyed("memory/memory.oom_control").get("oom_kill", 0)
                    s.memory_peak_bytes = int(self._stat("memory/memory.max_usage_in_bytes"))
                if "pids" in self.v1_dirs:
                    s.pids_limit_hits = self._keyed("pids/pids.events").get("max", 0)
        return s

    def rebase(self) -> None:
        """Count CPU time from now on (a sandbox started ahead of need begins its execution:
        what its stub used is not the execution's; the stub hits no limit). Raises OSError,
        ValueError."""
        self.baseline.cpu_usage_ns = self._cpu_usage_ns()

    def stats(self) -> CgroupStats:
        now, base = self._counters(), self.baseline
        return CgroupStats(
            oom_kills=now.oom_kills - base.oom_kills,
            pids_limit_hits=now.pids_limit_hits - base.pids_limit_hits,
            cpu_usage_ns=now.cpu_usage_ns - base.cpu_usage_ns,
            memory_peak_bytes=now.memory_peak_bytes,
        )

    def make_reusable(self) -> bool:
        """Ready an empty group for another execution: reset its peak memory, take its
        counters as the new baseline. False if it still has memory charged to it or its
        peak cannot be reset."""
        try:
            # (Reclaiming the rest would block the event loop for as long as it takes; a
            # group left with more is removed instead, the kernel moves its charges up.)
            if self.layout.version == "v1" and "memory" in self.v1_dirs:
                if int(self._stat("memory/memory.usage_in_bytes")) > REUSE_MAX_CHARGED_BYTES:
                    return False
                _write(self.v1_dirs["memory"] / "memory.max_usage_in_bytes", "0")
            elif self.layout.version == "v2" and self.v2_dir is not None:
                if "memory" in self.layout.v2_controllers:
                    if int(self._stat("v2/memory.current")) > REUSE_MAX_CHARGED_BYTES:
                        return False
                    self._reset_peak_v2()
        except (OSError, ValueError):
            return False
        self.baseline = self._counters()
        self.baseline.memory_peak_bytes = 0
        return True

    def _reset_peak_v2(self) -> None:
        """memory.peak is reset per open file (Linux >= 6.12). Raises OSError without it."""
        assert self.v2_dir is not None
        self._close_peak()
        fd = os.open(self.v2_dir / "memory.peak", os.O_RDWR | os.O_CLOEXEC)
        try:
            os.write(fd, b"reset\n")
        except OSError:
            os.close(fd)
            raise
        self._peak_fd = fd

    def _close_peak(self) -> None:
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None

    def remove(self) -> bool:
        """Remove the group's directories; False while processes are still in it."""
        self.removing = True
        self._close_peak()
        fds, self._procs_fds = self._procs_fds, []
        fds += self._stat_fds.values()
        self._stat_fds = {}
        for fd in fds:
            os.close(fd)
        ok = True
        dirs = [*dict.fromkeys(self.v1_dirs.values()), *([self.v2_dir] if self.v2_dir else [])]
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                ok = False  # EBUSY while the last processes finish exiting: retried
        return ok


def _keyed(text: str) -> dict[str, int]:
    """`key value` lines, as cgroup counter files have them."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value.strip())
    return out
