"""The arithmetic of an execution's cgroup (pure: nothing here touches a cgroup): the limit
files to write for a sandbox's limits, in an order the kernel accepts, and its counters
relative to when the group was handed out."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sandbox_runtime.domain.limits import MIB, SandboxLimits

CPU_PERIOD_US = 100_000
V1_MEMORY = "memory/memory.limit_in_bytes"
V1_MEMSW = "memory/memory.memsw.limit_in_bytes?"


def limit_values(
    version: str, controllers: Collection[str], limits: SandboxLimits
) -> dict[str, str]:
    """Every limit file to write under `limits` on a `version` ("v2", "v1") hierarchy with
    `controllers` enabled, keyed "ctl/file" ("v2/..." on v2; a trailing "?": the kernel may
    lack the file)."""
    memory = str(limits.memory_mb * MIB)
    quota = str(max(1000, int(limits.cpu_cores * CPU_PERIOD_US)))
    values: dict[str, str] = {}
    if version == "v2":
        if "memory" in controllers:
            values["v2/memory.max"] = memory
            values["v2/memory.swap.max?"] = "0"
            values["v2/memory.oom.group?"] = "1"
        if "pids" in controllers:
            values["v2/pids.max"] = str(limits.pids)
        if "cpu" in controllers:
            values["v2/cpu.max"] = f"{quota} {CPU_PERIOD_US}"
    elif version == "v1":
        if "memory" in controllers:
            values[V1_MEMORY] = memory
            values[V1_MEMSW] = memory  # with swap accounting
        if "pids" in controllers:
            values["pids/pids.max"] = str(limits.pids)
        if "cpu" in controllers:
            values["cpu/cpu.cfs_period_us"] = str(CPU_PERIOD_US)
            values["cpu/cpu.cfs_quota_us"] = quota
    return values


def limit_writes(values: dict[str, str], written: dict[str, str]) -> list[tuple[str, str]]:
    """The writes that give a group with files `written` (as last written) the limit files
    `values`, in order: what is already so is skipped; v1 keeps memory <= memory+swap, so
    when both rise the second goes first."""
    if V1_MEMSW in written and int(values[V1_MEMORY]) > int(written.get(V1_MEMORY, "0")):
        values = {V1_MEMSW: values[V1_MEMSW], **values}
    return [(key, value) for key, value in values.items() if written.get(key) != value]


@dataclass
class CgroupStats:
    oom_kills: int = 0
    pids_limit_hits: int = 0
    cpu_usage_ns: int = 0
    memory_peak_bytes: int = 0

    def since(self, base: CgroupStats) -> CgroupStats:
        """These cumulative counters counted from `base` (peak memory is already since its
        last reset)."""
        return CgroupStats(
            oom_kills=self.oom_kills - base.oom_kills,
            pids_limit_hits=self.pids_limit_hits - base.pids_limit_hits,
            cpu_usage_ns=self.cpu_usage_ns - base.cpu_usage_ns,
            memory_peak_bytes=self.memory_peak_bytes,
        )
