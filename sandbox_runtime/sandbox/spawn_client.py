"""The server's side of the spawner (spawner.py): starts it, asks it for bwraps, hears exits."""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from sandbox_runtime.errors import SandboxSpawnError, SandboxUnavailableError

SPAWNER_PROGRAM = Path(__file__).with_name("spawner.py")
READY_SECONDS = 10.0
STOP_SECONDS = 5.0
# The wait status reported for bwraps whose spawner died under them (as if SIGKILLed).
KILLED_STATUS = signal.SIGKILL


class SpawnerManager:
    """Owns the spawner process. `start()` before use (from the event loop's thread: the
    spawner's parent-death signal is tied to the thread that starts it), `close()` after."""

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next = 0
        self._pending: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self._watchers: dict[int, Callable[[int], None]] = {}
        self._exits: dict[int, int] = {}  # exits heard before anyone watched for them
        self._unowned: set[int] = set()  # bwraps whose spawn() was cancelled: killed on arrival

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._sock is not None

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
        options: list[str],
        rlimits: list[tuple[int, int, int]],
        fds: list[int],
    ) -> asyncio.Future[tuple[int, int]]:
        """Ask for bwrap with `argv`, `rlimits` and `fds` (the options pipe's write end, then
        bwrap's fds 0..6, the last its options pipe's read end). Sent at once: the caller may
        close its copies on return. The future gives (pid, pidfd); if it is cancelled, what
        the spawner started is killed when its answer comes.

        Raises SandboxSpawnError; the future may too.
        """
        if self._sock is None:
            logger.warning("sandbox spawner is gone; starting a new one")
            try:
                self.start()
            except SandboxUnavailableError as exc:
                raise SandboxSpawnError(str(exc)) from exc
        assert self._sock is not None and self._loop is not None
        self._next += 1
        number = self._next
        memfd = os.memfd_create("srt-argv", os.MFD_CLOEXEC)
        try:
            blob = b"".join(a.encode("utf-8", "surrogatepass") + b"\0" for a in argv + options)
            view = memoryview(blob)
            while view:
                view = view[os.write(memfd, view) :]
            header = {"spawn": number, "argc": len(argv), "rlimits": rlimits}
            rights = array.array("i", [memfd, *fds])
            try:
                self._sock.sendmsg(
                    [json.dumps(header).encode()],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)],
                )
            except OSError as exc:  # a full queue (BlockingIOError) or a dead spawner
                raise SandboxSpawnError(f"could not reach the sandbox spawner: {exc}") from exc
        finally:
            os.close(memfd)
        future: asyncio.Future[tuple[int, int]] = self._loop.create_future()
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

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, ancdata, _, _ = self._sock.recvmsg(
                    4096, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lost(f"reading from it failed: {exc}")
                return
            fds: list[int] = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", payload[: len(payload) - len(payload) % 4]).tolist()
            if not data:
                self._lost("it exited")
                return
            try:
                self._dispatch(json.loads(data), fds)
            except (ValueError, TypeError, KeyError) as exc:
                for fd in fds:
                    os.close(fd)
                logger.error("sandbox spawner sent a bad message: {}", exc)

    def _dispatch(self, doc: dict[str, object], fds: list[int]) -> None:
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
        if "pid" in doc and fds:
            result = (int(doc["pid"]), fds[0])  # type: ignore[call-overload]
            for fd in fds[1:]:
                os.close(fd)
            if future is not None and not future.done():
                future.set_result(result)
            else:  # its requester gave up before the answer came
                self._unowned.add(result[0])
                _kill_pidfd(result[1])
            return
        for fd in fds:
            os.close(fd)
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

    async def close(self) -> None:
        """Stop the spawner; any bwrap still running dies with it."""
        self._close_socket()  # the spawner exits when it reads the end of its socket
        await asyncio.to_thread(self._stop_process, STOP_SECONDS)
        self._exits.clear()
        self._unowned.clear()


def _kill_pidfd(pidfd: int) -> None:
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    os.close(pidfd)
