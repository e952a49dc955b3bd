"""The server's side of the spawner (spawner.py): starts it, asks it for bwraps, hears exits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from sandbox_runtime.errors import SandboxSpawnError, SandboxUnavailableError
from sandbox_runtime.fds import exhaustion_message, is_exhaustion
from sandbox_runtime.sandbox.process import kill_if_child

SPAWNER_PROGRAM = Path(__file__).with_name("spawner.py")
READY_SECONDS = 10.0
STOP_SECONDS = 5.0
# After a spawner died, how long before another restart may be tried (a restart blocks).
RESTART_SECONDS = 1.0
# The wait status reported for bwraps whose spawner died under them (as if SIGKILLed).
KILLED_STATUS = signal.SIGKILL


def spawn_failure(what: str, exc: OSError) -> str:
    """The message for a sandbox start that failed with `exc` while doing `what`: out of file
    descriptors is said plainly (the caller can only wait), anything else as it came."""
    return f"{what}: {exhaustion_message(exc) if is_exhaustion(exc) else exc}"


class SpawnerManager:
    """Owns the spawner process. `start()` before use (from the event loop's thread: the
    spawner's parent-death signal is tied to the thread that starts it), `close()` after."""

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next = 0
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._last_start = 0.0
        self._watchers: dict[int, Callable[[int], None]] = {}
        self._exits: dict[int, int] = {}  # exits heard before anyone watched for them
        self._unowned: set[int] = set()  # bwraps nobody waits for: their exits are dropped

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the spawner and wait until it has dropped its privileges.

        Raises SandboxUnavailableError with the reason when it cannot start.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-I", "-S", "-B", str(SPAWNER_PROGRAM), str(theirs.fileno())]
        argv += [str(self.uid), str(self.gid), str(os.getpid())]
        try:
            self._proc = subprocess.Popen(
                argv,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={},
                cwd="/",
                start_new_session=True,  # a terminal's ^C is for the server, not for it
            )
        except OSError as exc:
            ours.close()
            raise SandboxUnavailableError(f"could not start the sandbox spawner: {exc}") from exc
        finally:
            theirs.close()
        ours.settimeout(READY_SECONDS)
        try:
            hello = json.loads(ours.recv(4096) or b"{}")
        except (OSError, ValueError) as exc:
            hello = {"error": f"no answer ({exc})"}
        if hello.get("ready") is not True:
            ours.close()
            self._stop_process()
            reason = hello.get("error") or "it exited at start"
            raise SandboxUnavailableError(f"the sandbox spawner did not start: {reason}")
        ours.setblocking(False)
        self._sock = ours
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(ours.fileno(), self._on_readable)

    def request(
        self,
        argv: list[str],
        options: bytes,
        rlimits: list[tuple[int, int, int]],
        fds: list[int],
        cgroup_procs: list[int],
    ) -> asyncio.Future[int]:
        """Ask for bwrap with `argv`, `rlimits` and `fds` but the last as its fds 0, 1, ... (6 or
        7 of them; fd 5 a pipe it reads `options` from; `fds[-1]` that pipe's write end),
        moved into the cgroups whose cgroup.procs files are `cgroup_procs` before it gets its
        options. Sent at once: the
        caller may close its copies on return (it must close the write end). The future gives
        bwrap's pid once bwrap runs with its limits; it fails if bwrap could not be started
        or confined (it was then killed before it had its options).

        Raises SandboxSpawnError; the future may too.
        """
        if self._sock is None:
            now = time.monotonic()
            if now - self._last_start < RESTART_SECONDS:
                raise SandboxSpawnError("the sandbox spawner died; it is restarted shortly")
            self._last_start = now
            logger.warning("sandbox spawner is gone; starting a new one")
            try:
                self.start()
            except SandboxUnavailableError as exc:
                raise SandboxSpawnError(str(exc)) from exc
        assert self._sock is not None and self._loop is not None
        self._next += 1
        number = self._next
        try:
            memfd = os.memfd_create("srt-argv", os.MFD_CLOEXEC)
        except OSError as exc:  # (EMFILE, ENOMEM: nothing was sent, nothing is left open)
            raise SandboxSpawnError(
                spawn_failure("could not hand bwrap its arguments", exc)
            ) from exc
        try:
            blob = b"".join(a.encode("utf-8", "surrogatepass") + b"\0" for a in argv)
            view = memoryview(blob + options)
            while view:
                view = view[os.write(memfd, view) :]
            header = {"spawn": number, "rlimits": rlimits, "argv_bytes": len(blob),
                      "child_fds": len(fds) - 1}  # fmt: skip
            socket.send_fds(self._sock, [json.dumps(header).encode()], [memfd, *fds, *cgroup_procs])
        except OSError as exc:  # a full queue (BlockingIOError), a dead spawner, no memory
            raise SandboxSpawnError(
                spawn_failure("could not reach the sandbox spawner", exc)
            ) from exc
        finally:
            os.close(memfd)
        future: asyncio.Future[int] = self._loop.create_future()
        self._pending[number] = future
        return future

    def watch(self, pid: int, on_exit: Callable[[int], None]) -> None:
        """Call `on_exit(wait_status)` once bwrap `pid` has ended (now, if it already has)."""
        if pid in self._exits:
            on_exit(self._exits.pop(pid))
        elif self._sock is None:
            on_exit(KILLED_STATUS)
        else:
            self._watchers[pid] = on_exit

    def forget(self, pid: int) -> None:
        """Nobody will watch bwrap `pid` (its start was abandoned): drop its exit when it comes."""
        if self._exits.pop(pid, None) is None and self._sock is not None:
            self._unowned.add(pid)

    async def abandon(self, spawning: asyncio.Future[int]) -> int | None:
        """End the bwrap of a start abandoned before its answer: wait for the answer (until
        then the spawner may still move it into its cgroup), kill it. Its pid, or None if
        nothing runs (the spawner killed it, or died and took it along)."""
        try:
            pid = await spawning
        except SandboxSpawnError:
            return None
        self.forget(pid)
        kill_if_child(pid, self.pid)
        return pid

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(4096)  # no room for fds: the kernel drops any sent
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lost(f"reading from it failed: {exc}")
                return
            if not data:
                self._lost("it exited")
                return
            try:
                self._dispatch(json.loads(data))
            except (ValueError, TypeError, KeyError) as exc:
                logger.error("sandbox spawner sent a bad message: {}", exc)

    def _dispatch(self, doc: dict[str, object]) -> None:
        if "exited" in doc:
            pid, status = int(doc["exited"]), int(doc["status"])  # type: ignore[call-overload]
            watcher = self._watchers.pop(pid, None)
            if watcher is not None:
                watcher(status)
            elif pid in self._unowned:
                self._unowned.discard(pid)
            else:
                self._exits[pid] = status
            return
        number = int(doc["spawned"])  # type: ignore[call-overload]
        future = self._pending.pop(number, None)
        if "pid" in doc:
            pid = int(doc["pid"])  # type: ignore[call-overload]
            if future is not None and not future.done():
                future.set_result(pid)
            else:  # nobody waits for it (requesters do not cancel the future): never run it
                self._unowned.add(pid)
                kill_if_child(pid, self.pid)
            return
        if future is not None and not future.done():
            future.set_exception(SandboxSpawnError(str(doc.get("error", "spawn failed"))))

    def _lost(self, why: str) -> None:
        """The spawner is gone: its bwraps die with it (--die-with-parent)."""
        logger.error("sandbox spawner lost: {}", why)
        self._close_socket()
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(SandboxSpawnError(f"the sandbox spawner died ({why})"))
        watchers, self._watchers = self._watchers, {}
        for on_exit in watchers.values():
            on_exit(KILLED_STATUS)
        self._exits.clear()  # no exit will be reported any more
        self._unowned.clear()
        self._stop_process()

    def _close_socket(self) -> None:
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _stop_process(self, timeout: float = 1.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    async def aclose(self) -> None:
        """Stop the spawner; any bwrap still running dies with it."""
        self._close_socket()  # the spawner exits when it reads the end of its socket
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(SandboxSpawnError("the sandbox spawner was stopped"))
        await asyncio.to_thread(self._stop_process, STOP_SECONDS)
        self._exits.clear()
        self._unowned.clear()
