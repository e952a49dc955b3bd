"""One running sandbox: its pipes, its signals, its escalating stop and how it ended."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.sandbox.execution_cgroup import ExecutionCgroup
from sandbox_runtime.supervisor import Supervisor

# bwrap's status is a few short JSON documents; more is not read.
MAX_STATUS_BYTES = 64 * 1024
# How long to wait for the spawner's word on how bwrap ended, when bwrap reported nothing.
OUTER_STATUS_SECONDS = 5.0
# Why a sandbox ended, when something other than its own exit ended it.
REASON_TIMEOUT = "timeout"
REASON_CANCELLED = "cancelled"
REASON_MEMORY = "memory"
REASON_CPU = "cpu"
REASON_FILE_SIZE = "file_size"
REASON_PIDS = "pids"
REASON_SHUTDOWN = "shutdown"


@dataclass
class SandboxOutcome:
    """How a sandboxed process tree ended."""

    exit_code: int
    """The command's exit code; 128+N when signal N ended it (the shell convention)."""
    signal: int | None
    """The signal that ended the command, if one did."""
    reason: str | None
    """The limit or action that ended it: timeout, cancelled, shutdown, memory, cpu, file_size,
    pids; None when the command exited on its own."""
    duration_s: float
    started: bool = True
    """False when the sandbox itself failed to start (stderr says why)."""
    limits_reached: list[str] = field(default_factory=list)
    """Every limit the tree ran into, even those that did not end it (e.g. pids)."""
    cpu_seconds: float | None = None
    memory_peak_bytes: int | None = None

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return str(self.signal)


class SandboxProcess:
    """A sandboxed process tree. Create with `BubblewrapBackend.spawn`; always `await aclose()`."""

    def __init__(
        self,
        *,
        pid: int,
        pidfd: int | None,
        stdin: asyncio.StreamWriter | None,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
        status_fd: int,
        cgroup: ExecutionCgroup | None,
        limits: SandboxLimits,
        timeout: float | None,
        on_exit: Callable[[SandboxProcess], None],
        supervisor: Supervisor,
    ) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.limits = limits
        self.child_pid: int | None = None
        # Signals go through a pidfd: after the outer bwrap reaped the child, its pid could be
        # reused by an unrelated process, and this server runs as root.
        self._child_pidfd: int | None = None
        self._cgroup = cgroup
        self._started_at = time.monotonic()
        self._reason: str | None = None
        self._exited = asyncio.Event()
        self._status_done = asyncio.Event()
        self._outer_status: int | None = None
        self._inner_exit: int | None = None
        self._outcome: SandboxOutcome | None = None
        self._on_exit = on_exit
        self._supervisor = supervisor  # (its closers and a stop in the background run under it)
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._closing: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        # bwrap is the spawner's child, not ours. Its pidfd tells us at once when it ends and
        # signals it without any risk of pid reuse; the spawner, which reaps it, reports its
        # wait status (`on_outer_status`). No pidfd: bwrap ended (and was reaped) before the
        # server could open one, and the spawner's report is the end.
        self._pidfd: int | None = pidfd
        self._outer_status_known = asyncio.Event()
        if pidfd is not None:
            self._loop.add_reader(pidfd, self._on_outer_exit)
        # bwrap's JSON status (child pid, exit code), read straight off the pipe.
        self._status_fd: int | None = status_fd
        self._status_data = b""
        os.set_blocking(status_fd, False)
        self._loop.add_reader(status_fd, self._on_status_readable)
        self._timer = (
            self._loop.call_later(timeout, self._on_timeout) if timeout is not None else None
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def begin(self, timeout: float | None) -> None:
        """A sandbox started ahead of need has been handed its command: its duration, CPU
        time and wall-clock timeout count from now."""
        self._started_at = time.monotonic()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = (
            self._loop.call_later(timeout, self._on_timeout)
            if timeout is not None and self.running
            else None
        )
        if self._cgroup is not None:
            with contextlib.suppress(OSError, ValueError):  # (counters are advisory)
                self._cgroup.rebase()

    @property
    def returncode(self) -> int | None:
        return None if self._outcome is None else self._outcome.exit_code

    @property
    def running(self) -> bool:
        return not self._exited.is_set()

    async def ended(self) -> None:
        """Until the tree has ended (not waiting for its status and cleanup, as `wait` does)."""
        await self._exited.wait()

    def add_closer(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run `closer` once the tree has ended, before `wait` returns to anyone (the egress
        socket is closed there: the proxy's last word on the sandbox comes before its end)."""
        self._closers.append(closer)

    async def _close_all(self) -> None:
        for closer in self._closers:
            try:
                await closer()
            except Exception:
                logger.exception("closing sandbox {} failed", self.pid)

    async def wait(self) -> SandboxOutcome:
        """Wait for the whole tree to end and return how it ended."""
        await self._exited.wait()
        if self._closers:
            if self._closing is None:
                self._closing = self._supervisor.spawn(
                    f"sandbox {self.pid} closers", self._close_all()
                )
            await asyncio.shield(self._closing)
        await self._status_done.wait()
        if self._inner_exit is None and self._outcome is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outer_status_known.wait(), OUTER_STATUS_SECONDS)
        if self._outcome is None:
            self._outcome = self._finish()
        return self._outcome

    def send_signal(self, sig: int) -> int:
        """Send `sig` to every process inside the sandbox; returns how many got it."""
        if not self.running:
            return 0
        count = 0
        for pid in self._sandbox_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                count += 1
        return count

    def kill(self, reason: str = REASON_CANCELLED) -> None:
        """SIGKILL the whole tree now."""
        if self._reason is None:
            self._reason = reason
        if not self.running:
            return
        # Killing the pid namespace's init makes the kernel kill everything inside it.
        self._kill_child()
        if self._cgroup is not None:
            self._cgroup.kill()
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def terminate(self, grace: float = 2.0, reason: str = REASON_CANCELLED) -> None:
        """Stop politely, then by force: SIGTERM to every process, `grace` seconds, SIGKILL."""
        if self._reason is None:
            self._reason = reason
        if not self.running:
            return
        if grace > 0 and self.send_signal(signal.SIGTERM) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exited.wait(), grace)
        self.kill(reason)
        await self._exited.wait()

    def stop_in_background(self, grace: float, reason: str) -> None:
        """Start `terminate` without waiting for it (idempotent)."""
        if self._stop_task is None and self.running:
            self._stop_task = self._supervisor.spawn(
                f"sandbox {self.pid} stop", self.terminate(grace, reason)
            )

    async def aclose(self) -> None:
        """Kill what is left, wait for it and release every resource. Safe to call twice."""
        if self.running:
            self.kill(self._reason or REASON_CANCELLED)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self.wait())
        # A read pipe's transport outlives its EOF under uvloop (the protocol asks to keep it
        # open) until it is garbage collected: its descriptor would be held until then.
        close_streams(self.stdin, self.stdout, self.stderr)

    # -- internals ---------------------------------------------------------------------------

    def _on_timeout(self) -> None:
        logger.debug("sandbox {} hit its wall-clock timeout", self.pid)
        self.stop_in_background(grace=1.0, reason=REASON_TIMEOUT)

    def _kill_child(self) -> None:
        if self._child_pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._child_pidfd, signal.SIGKILL)

    def _sandbox_pids(self) -> list[int]:
        """Every process inside the sandbox except its init (which ignores signals)."""
        if self._cgroup is not None:
            return [p for p in self._cgroup.pids() if p not in (self.pid, self.child_pid)]
        if self.child_pid is None:
            return []
        return _descendants(self.child_pid)

    def on_outer_status(self, status: int) -> None:
        """bwrap has ended with wait status `status` (the spawner's report)."""
        self._outer_status = status
        self._outer_status_known.set()
        self._on_outer_exit()  # (bwrap's pidfd has normally told us already)

    def _on_outer_exit(self) -> None:
        if not self.running:
            return
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._timer is not None:
            self._timer.cancel()
        # The tree ends with its outer bwrap (--die-with-parent); make sure of it.
        self._kill_child()
        if self._child_pidfd is not None:
            os.close(self._child_pidfd)
            self._child_pidfd = None
        if self._cgroup is not None:
            self._cgroup.kill()
        self._exited.set()
        self._on_exit(self)

    def _on_status_readable(self) -> None:
        assert self._status_fd is not None
        try:
            chunk = os.read(self._status_fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            if len(self._status_data) < MAX_STATUS_BYTES:
                self._status_data += chunk
                try:
                    self._parse_status(self._status_data)
                except (ValueError, TypeError, OverflowError):  # advisory: never fatal
                    logger.warning("sandbox {}: unreadable bwrap status", self.pid)
            return
        self._loop.remove_reader(self._status_fd)
        os.close(self._status_fd)
        self._status_fd = None
        self._status_done.set()

    def _parse_status(self, data: bytes) -> None:
        decoder = json.JSONDecoder()
        text = data.decode("utf-8", "replace")
        i = 0
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            if i >= len(text):
                return
            try:
                doc, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return
            if isinstance(doc, dict):
                if "child-pid" in doc and self.child_pid is None:
                    self.child_pid = int(doc["child-pid"])
                    self._child_pidfd = pidfd_of_child(self.child_pid, self.pid)
                if "exit-code" in doc:
                    self._inner_exit = int(doc["exit-code"])

    def _finish(self) -> SandboxOutcome:
        duration = time.monotonic() - self._started_at
        stats = self._cgroup.stats() if self._cgroup is not None else None
        started = self.child_pid is not None
        if self._inner_exit is not None:
            exit_code = self._inner_exit
            sig = exit_code - 128 if 128 < exit_code < 128 + 65 else None
        else:
            # No word from the spawner either (it died): bwrap was killed with it.
            status = signal.SIGKILL if self._outer_status is None else self._outer_status
            code = os.waitstatus_to_exitcode(status)
            if code < 0:
                sig, exit_code = -code, 128 - code
            elif self._reason is not None and started:
                # bwrap was killed before it could report: the command died with it.
                sig, exit_code = signal.SIGKILL, 128 + signal.SIGKILL
            else:
                sig, exit_code = None, code
        reached: list[str] = []
        if stats is not None and stats.oom_kills:
            reached.append(REASON_MEMORY)
        if sig == signal.SIGXCPU or (
            sig == signal.SIGKILL
            and stats is not None
            and self._reason is None
            and stats.cpu_usage_ns >= self.limits.cpu_time_seconds * 1e9
        ):
            reached.append(REASON_CPU)
        if sig == signal.SIGXFSZ:
            reached.append(REASON_FILE_SIZE)
        if stats is not None and stats.pids_limit_hits:
            reached.append(REASON_PIDS)
        reason = self._reason
        if reason is None:
            reason = next((r for r in reached if r != REASON_PIDS), None)
        return SandboxOutcome(
            exit_code=exit_code,
            signal=sig,
            reason=reason,
            duration_s=duration,
            started=started,
            limits_reached=reached,
            cpu_seconds=stats.cpu_usage_ns / 1e9 if stats and stats.cpu_usage_ns else None,
            memory_peak_bytes=stats.memory_peak_bytes if stats else None,
        )


def close_streams(*streams: asyncio.StreamReader | asyncio.StreamWriter | None) -> None:
    """Close the transports under `streams` (and with them their pipes' descriptors)."""
    for stream in streams:
        if isinstance(stream, asyncio.StreamWriter):
            stream.close()
        elif stream is not None and (transport := getattr(stream, "_transport", None)):
            transport.close()


def pidfd_of_child(pid: int, parent: int | None) -> int | None:
    """A pidfd for `pid` if it is still `parent`'s child, else None (it exited and its pid may
    have been reused: nothing must ever be signalled through such a pidfd)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        ppid = -1
    if ppid != parent:
        os.close(pidfd)
        return None
    return pidfd


def kill_if_child(pid: int, parent: int | None) -> None:
    """SIGKILL `pid` if it is still `parent`'s child (never a process that reused its pid)."""
    pidfd = pidfd_of_child(pid, parent)
    if pidfd is not None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)


def _descendants(root: int) -> list[int]:
    """Every descendant of `root`, by walking /proc's children lists."""
    found: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            with contextlib.suppress(OSError):
                for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
                    found.append(int(child))
                    stack.append(int(child))
    return found
