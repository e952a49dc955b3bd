"""One execution's cgroup, in every hierarchy in use: its limits written, its processes
joined, signalled and killed, its counters read, and readied for reuse by another execution
(CgroupLayout, in cgroups.py, makes, pools and removes them)."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox_runtime.domain.limits import MIB, SandboxLimits
from sandbox_runtime.sandbox.cgroup_fs import keyed, read, try_write, write
from sandbox_runtime.sandbox.cgroup_limits import CgroupStats, limit_values, limit_writes

if TYPE_CHECKING:
    from sandbox_runtime.sandbox.cgroups import CgroupLayout

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
        values = limit_values(self.layout.version, self.layout.controllers, limits)
        for key, value in limit_writes(values, self.written):
            if key.endswith("?"):
                try_write(self._file(key), value)
            else:
                write(self._file(key), value)
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
        return "" if d is None else read(d / "cgroup.procs")

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
                write(self.v2_dir / "cgroup.kill", "1")
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
        return keyed(self._stat(key))

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
        """What happened in the group since it was handed out."""
        return self._counters().since(self.baseline)

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
                write(self.v1_dirs["memory"] / "memory.max_usage_in_bytes", "0")
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
