"""Per-execution cgroups on cgroup v2, v1 and hybrid hosts: limits, accounting, killing.

This module holds the layout (CgroupLayout: where this server's groups live, which limits it
can enforce there, the pool of idle groups for reuse, removing what stopped servers left).
Apart: one execution's group (execution_cgroup.py), the limit and counter arithmetic
(cgroup_limits.py), the cgroup filesystem (cgroup_fs.py) and whose parent group is whose
(cgroup_instances.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.fds import limit as fd_limit
from sandbox_runtime.sandbox.cgroup_fs import (
    V1_CONTROLLERS,
    V2_CONTROLLERS,
    ensure_favordynmods,
    mounts,
    own_paths,
    read,
    write,
)
from sandbox_runtime.sandbox.cgroup_instances import instance_name, owner_gone, remove_stale_tree
from sandbox_runtime.sandbox.cgroup_limits import CgroupStats
from sandbox_runtime.sandbox.execution_cgroup import ExecutionCgroup

__all__ = ["CgroupLayout", "CgroupStats", "ExecutionCgroup"]

POOL_FD_SHARE = 4  # pooled groups hold at most 1/4 of the descriptor limit


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
            unified_mount, v1_mounts = mounts()
            unified_own, v1_own = own_paths()
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
            available = set(read(own / "cgroup.controllers").split())
            wanted = [c for c in V2_CONTROLLERS if c in available]
            enabled = set(read(own / "cgroup.subtree_control").split())
            if set(wanted) - enabled:
                try:
                    write(own / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    # "No internal processes": move this server into a leaf of its own first.
                    leaf = own / f"{group_name}-server"
                    leaf.mkdir(exist_ok=True)
                    write(leaf / "cgroup.procs", str(os.getpid()))
                    write(own / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            base.mkdir(exist_ok=True)
            if wanted:
                write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            self.v2_base = base
            self.v2_controllers = frozenset(
                set(read(base / "cgroup.subtree_control").split()) & set(V2_CONTROLLERS)
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
                        write(base / "memory.use_hierarchy", "1")
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

    async def release_when_empty(self, group: ExecutionCgroup, what: str) -> None:
        """`release` the group of `what` once its processes are gone (killed if they linger;
        given up on, logged, after a few seconds)."""
        for delay in (0.0, 0.02, 0.1, 0.5, 2.0):
            await asyncio.sleep(delay)
            if self.release(group):
                return
            group.kill()
        logger.warning("cgroup of {} could not be removed", what)

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
                if remove_stale_tree(parent / name):
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
