"""Whose a parent group is: each server names its parent group for its own process
(`<group name>.<pid>.<start time>.<pid namespace>`), so two servers on one host (even with one
replica id) never share one, and a group whose process is gone can be told from a live
server's and removed (`remove_stale_tree`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

from sandbox_runtime.sandbox.cgroup_fs import read, try_write

INSTANCE_NAME = re.compile(r"srt[A-Za-z0-9_.-]*?\.(\d+)\.(\d+)\.(\d+)(?:-server)?")
STALE_KILL_SECONDS = 2.0


def start_time_of(stat: str) -> int | None:
    """The start time (clock ticks since boot) in /proc/PID/stat text `stat`."""
    try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        return int(stat.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None if there is no such process."""
    try:
        text = read(Path(f"/proc/{pid}/stat"))
    except OSError:
        return None
    return start_time_of(text)


def pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def instance_name(group_name: str) -> str:
    """This process's parent group name for `group_name` (see INSTANCE_NAME)."""
    pid = os.getpid()
    return f"{group_name}.{pid}.{start_time(pid) or 0}.{pid_namespace()}"


def owner_gone(name: str) -> bool:
    """Whether `name` is a server's parent group (or server leaf) whose process has ended.
    A group of another pid namespace is never taken for gone: its pid means nothing here."""
    match = INSTANCE_NAME.fullmatch(name)
    if match is None:
        return False
    pid, start, namespace = map(int, match.groups())
    if namespace != pid_namespace():
        return False
    return start_time(pid) != start


def remove_stale_tree(group: Path) -> bool:
    """Kill what is left in `group` and its descendants, remove them all; whether it is gone."""
    with os.scandir(group) as entries:
        children = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    for child in children:
        remove_stale_tree(child)
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
                killed = try_write(group / "cgroup.kill", "1")
        else:  # v1, or v2 before Linux 5.14: each round kills all it sees
            with contextlib.suppress(OSError, ValueError):
                for pid in map(int, read(group / "cgroup.procs").split()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
