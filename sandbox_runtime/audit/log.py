"""The audit log's writer: one JSON object a line, to a file rotated by size or to stdout.

A call never waits for the log: `write` puts the line on a bounded queue and returns; one
thread per process writes it out. When the queue is full (the disk slower than the calls;
SANDBOX_AUDIT_LOG_QUEUE_MB) the line is dropped, counted in `srt_audit_dropped_lines_total`,
and the next line written says how many were lost (`{"event": "dropped", "lines": N}`). A
write that fails (a full disk, a removed directory) loses its lines the same way, and the
writer tries again on the next ones; a file moved or removed by someone else is followed by a
new one under its name. One process writes a file: it holds an exclusive lock on `FILE.lock`
while it runs, and a second process naming the same file refuses to start (replicas each
write their own file, or stdout).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import queue
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from loguru import logger
from prometheus_client import CollectorRegistry, Counter

from sandbox_runtime.config import Settings
from sandbox_runtime.errors import InvalidRequestError

STDOUT = "-"
# What the writer takes from the queue at once, at most (it holds that while it writes).
BATCH_BYTES = 64 * 1024
# How often a writer that keeps failing says so in the server's log.
PROBLEM_LOG_SECONDS = 60.0
# How long stopping waits for the queued lines to be written (a hung disk: no longer).
CLOSE_SECONDS = 10.0
_STOP = b""


class AuditLogInUseError(InvalidRequestError):
    """Another process writes the audit log file this one was told to write."""


def now() -> str:
    """The time of an audit line: UTC, milliseconds, ISO 8601."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def rotated(path: Path, backups: int) -> list[Path]:
    """A log's files, oldest first: FILE.N … FILE.1, FILE (those that exist)."""
    names = [path.with_name(f"{path.name}.{n}") for n in range(backups, 0, -1)] + [path]
    return [p for p in names if p.exists()]


class AuditLog:
    """Where audit lines go. `target`: a path, `-` for stdout, "" for nowhere (then `write`
    does nothing and `enabled` is False)."""

    def __init__(
        self,
        target: str,
        max_bytes: int = 100 * 2**20,
        backups: int = 10,
        registry: CollectorRegistry | None = None,
        queue_bytes: int = 4 * 2**20,
    ) -> None:
        self.target = target
        self.enabled = bool(target)
        self.max_bytes = max_bytes
        self.backups = backups
        self.dropped = Counter(
            "srt_audit_dropped_lines_total",
            "Audit lines lost: the writer's queue was full (a slow disk) or a write failed.",
            registry=registry,
        )
        # Lines waiting for the writer, at most `queue_bytes` of them (a flood against a slow
        # disk holds that much, whatever the number of calls).
        self._queue: queue.Queue[bytes] = queue.Queue()
        self.queue_bytes = queue_bytes
        self._queued = 0
        self._unsaid = 0  # dropped lines the log has not said yet
        self._count_lock = threading.Lock()
        self._lock_file: BinaryIO | None = None
        self._out: BinaryIO | None = None
        self._size = 0
        self._thread: threading.Thread | None = None
        self._last_problem = 0.0

    @classmethod
    def of(cls, settings: Settings, registry: CollectorRegistry) -> AuditLog:
        """The log SANDBOX_AUDIT_LOG names (not started)."""
        max_bytes = settings.audit_log_max_mb * 2**20
        waiting = int(settings.audit_log_queue_mb * 2**20)
        return cls(settings.audit_log, max_bytes, settings.audit_log_backups, registry, waiting)

    def start(self) -> None:
        """Take the file (its lock; AuditLogInUseError if another process has it) and start the
        writer thread."""
        if not self.enabled or self._thread is not None:
            return
        if self.target != STDOUT:
            path = Path(self.target)
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path.with_name(path.name + ".lock"), "ab")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                raise AuditLogInUseError(
                    f"the audit log {path} is written by another process: give each replica "
                    "its own file (SANDBOX_AUDIT_LOG), or `-` for stdout"
                ) from None
            self._lock_file = lock
        self._thread = threading.Thread(target=self._run, name="audit log", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        """Queue one line (never blocks: a full queue drops it, counted)."""
        if not self.enabled:
            return
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
        line = text.encode("utf-8", "replace") + b"\n"
        with self._count_lock:
            if self._queued + len(line) > self.queue_bytes:
                self.dropped.inc()
                self._unsaid += 1
                return
            self._queued += len(line)
        self._queue.put_nowait(line)

    def _lost(self, lines: int) -> None:
        self.dropped.inc(lines)
        with self._count_lock:
            self._unsaid += lines

    async def aclose(self) -> None:
        """Write what is queued, then stop the writer and let go of the file."""
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        self._queue.put_nowait(_STOP)  # (behind every queued line)
        deadline = time.monotonic() + CLOSE_SECONDS
        while thread.is_alive() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            taken = len(batch[0])
            with contextlib.suppress(queue.Empty):
                while taken < BATCH_BYTES and batch[-1] != _STOP:
                    batch.append(self._queue.get_nowait())
                    taken += len(batch[-1])
            with self._count_lock:
                self._queued -= taken
            stop = _STOP in batch
            lines = [line for line in batch if line != _STOP]
            self._write(lines)
            if stop:
                break
        if self._out is not None and self._out is not sys.stdout.buffer:
            with contextlib.suppress(OSError):
                self._out.close()
        self._out = None

    def _write(self, lines: list[bytes]) -> None:
        with self._count_lock:
            unsaid, self._unsaid = self._unsaid, 0
        if unsaid:
            said = {"time": now(), "event": "dropped", "lines": unsaid}
            lines.insert(0, json.dumps(said, separators=(",", ":")).encode() + b"\n")
        if not lines:
            return
        try:
            self._put(lines)
        except (OSError, ValueError) as exc:
            self._lost(len(lines) - (1 if unsaid else 0))
            if unsaid:  # (the count goes back: said next time)
                with self._count_lock:
                    self._unsaid += unsaid
            self._close_out()
            if time.monotonic() - self._last_problem > PROBLEM_LOG_SECONDS:
                self._last_problem = time.monotonic()
                logger.error("the audit log {} cannot be written: {}", self.target, exc)

    def _put(self, lines: list[bytes]) -> None:
        """Write the lines, rotating before one that would take the file past its size."""
        out = self._open()
        chunk = bytearray()
        for line in lines:
            full = self._size + len(chunk) + len(line) > self.max_bytes
            if full and self.target != STDOUT and self._size + len(chunk) > 0:
                out.write(chunk)
                out.flush()
                chunk.clear()
                self._rotate()
                out = self._open()
            chunk += line
        out.write(chunk)
        out.flush()
        self._size += len(chunk)

    def _open(self) -> BinaryIO:
        if self._out is not None and self.target != STDOUT and self._moved(self._out):
            self._close_out()  # (moved or removed by someone else: write where it is named)
        if self._out is None:
            if self.target == STDOUT:
                self._out = sys.stdout.buffer
            else:
                self._out = open(self.target, "ab")
                self._size = os.fstat(self._out.fileno()).st_size
        return self._out

    def _moved(self, out: BinaryIO) -> bool:
        try:
            named = os.stat(self.target)
        except OSError:
            return True
        held = os.fstat(out.fileno())
        return (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino)

    def _close_out(self) -> None:
        out, self._out = self._out, None
        if out is not None and out is not sys.stdout.buffer:
            with contextlib.suppress(OSError):
                out.close()

    def _rotate(self) -> None:
        """FILE → FILE.1 → … → FILE.N (the oldest beyond N removed); a new FILE next."""
        self._close_out()
        self._size = 0
        path = Path(self.target)
        if self.backups == 0:
            path.unlink(missing_ok=True)
            return
        oldest = path.with_name(f"{path.name}.{self.backups}")
        oldest.unlink(missing_ok=True)
        for n in range(self.backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            if older.exists():
                older.rename(path.with_name(f"{path.name}.{n + 1}"))
        path.rename(path.with_name(f"{path.name}.1"))
