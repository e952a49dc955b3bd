"""A state directory belongs to one live server: a lock held for the process's life.

Two servers on one SANDBOX_STATE_DIR undo each other: each detaches at its start the mounts it
takes for a dead server's leftovers, removes the other's blank workspaces, warm slots and
kernel directories, and mounts images the other still has mounted (which corrupts them). So a
server that runs sandboxes (roles all and worker; an api replica keeps nothing there that
another could break) takes `flock` on `<state_dir>/server.lock` before anything touches the
state directory, and keeps it until it exits. The kernel drops the lock with the process, so a
killed server's directory is free at once (its leftovers are cleaned at start as before). The
file is opened O_CLOEXEC: no child (sandboxes, kernels, hosted servers, the egress proxy)
inherits it, so none keeps the lock past the server. It records the holder (pid, host name,
start time) for the message a second server gives when it refuses to start.

Within one process the lock is shared (taken again by an in-process build it already holds).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from sandbox_runtime.errors import SandboxRuntimeError

LOCK_FILE = "server.lock"

_held: dict[str, list[int]] = {}  # realpath of a lock file -> [its fd, how many holders]


class StateDirInUseError(SandboxRuntimeError):
    """Another live server holds this state directory."""


@contextlib.contextmanager
def holding(state_dir: Path) -> Iterator[None]:
    """Hold the state directory's lock while the block runs.

    Raises StateDirInUseError (another process holds it), OSError (the directory cannot be
    made or the file opened).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = os.path.realpath(state_dir / LOCK_FILE)
    entry = _held.get(path)
    if entry is None:
        entry = _held[path] = [_take(Path(path), state_dir), 0]
    entry[1] += 1
    try:
        yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _held[path]
            os.close(entry[0])  # (the lock goes with the last descriptor)


def _take(path: Path, state_dir: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0)
        os.close(fd)
        raise StateDirInUseError(in_use(state_dir, holder)) from None
    except BaseException:
        os.close(fd)
        raise
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def in_use(state_dir: Path, holder: bytes) -> str:
    """The one line a server refused the state directory says."""
    try:
        known = json.loads(holder)
        who = f"pid {int(known['pid'])} on host {known['host']}, since {known['since']}"
    except (ValueError, KeyError, TypeError):
        who = "it has not recorded which yet"
    return (
        f"the state directory {state_dir} is in use by another running server ({who}): stop "
        "that server first, or give this one another state directory (SANDBOX_STATE_DIR)"
    )


def needs_lock(role: str) -> bool:
    """Whether a server of `role` holds its state directory (it runs sandboxes there)."""
    return role != "api"
