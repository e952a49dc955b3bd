"""The relay inside an environment build's RUN step with egress (environments/run.py): its init
(pid 1), the proxy's port on loopback. Executions' sandboxes run relay.pl, the same in Perl
(its start is ~2 ms where this one's is ~12: a sandbox with egress pays it on every start).

Run by bubblewrap (`--as-pid-1`) as `python3 -I -S relay.py SOCKET PORT COMMAND...`, standard
library only, inside the sandbox. It binds PORT on 127.0.0.1 and ::1 before the command
exists, then starts the command and carries every connection to PORT over to SOCKET (the
host proxy's socket for this sandbox), byte for byte; it decides nothing itself.

The command cannot replace it: as the pid namespace's init it ignores every signal it has no
handler for (SIGKILL included) when it comes from inside; it is not dumpable, so its memory
is not the command's to write; the port is bound without SO_REUSEPORT. If the command ends,
so does the relay, with the command's status (128+N for signal N), and the kernel ends the
rest of the sandbox. The relay writes nothing to the command's stdout or stderr.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import signal
import socket
import sys

CHUNK = 256 * 1024
ENV_NAME = "__srt_env"  # the caller's variables as JSON (sandbox/argv.py RELAY_ENV)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip


class Pair:
    """One connection: the program's TCP socket and the proxy's unix socket."""

    def __init__(self, relay: Relay, client: socket.socket, upstream: socket.socket) -> None:
        self.relay = relay
        self.ends = (client, upstream)
        self.pending: dict[socket.socket, bytearray] = {client: bytearray(), upstream: bytearray()}
        self.eof: set[socket.socket] = set()  # ends that will send nothing more
        for end in self.ends:
            end.setblocking(False)
        self.update()

    def other(self, end: socket.socket) -> socket.socket:
        return self.ends[1] if end is self.ends[0] else self.ends[0]

    def update(self) -> None:
        """Watch each end for what it can do now: read (if its peer's buffer has room and it
        has not ended) and write (if bytes wait for it)."""
        for end in self.ends:
            events = 0
            if end not in self.eof and len(self.pending[self.other(end)]) < CHUNK:
                events |= selectors.EVENT_READ
            if self.pending[end]:
                events |= selectors.EVENT_WRITE
            self.relay.watch(end, events, self)

    def on_event(self, end: socket.socket, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            try:
                data: bytes | None = end.recv(CHUNK)
            except BlockingIOError:
                data = None
            except OSError:  # reset: the end of what it sends, and it takes nothing more
                data = b""
                self.broken(end)
            if data:
                self.pending[self.other(end)] += data
            elif data is not None:
                self.eof.add(end)
        for side in self.ends:
            buffer = self.pending[side]
            if buffer:
                try:
                    del buffer[: side.send(buffer)]
                except BlockingIOError:
                    pass
                except OSError:
                    self.broken(side)
            if not buffer and self.other(side) in self.eof:
                with contextlib.suppress(OSError):
                    side.shutdown(socket.SHUT_WR)
        if len(self.eof) == 2 and not any(self.pending.values()):
            self.close()
            return
        self.update()

    def broken(self, end: socket.socket) -> None:
        """`end` takes no more bytes (reset, broken pipe): drop what waits for it and stop
        reading its peer, whose bytes have nowhere to go. What `end` sent before still goes
        on: a proxy that answers and closes without reading the request (a refusal) is
        heard."""
        self.pending[end].clear()
        self.eof.add(self.other(end))

    def close(self) -> None:
        for end in self.ends:
            self.relay.watch(end, 0, self)
            end.close()


class Relay:
    def __init__(self, path: str, port: int) -> None:
        self.path = path
        self.selector = selectors.DefaultSelector()
        self.listeners: list[socket.socket] = []
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue
            try:
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((host, port))
                sock.listen(128)
            except OSError:
                sock.close()
                if family == socket.AF_INET:
                    raise
                continue  # no IPv6 loopback in this namespace
            sock.setblocking(False)
            self.listeners.append(sock)
            self.selector.register(sock, selectors.EVENT_READ, None)
        self.watched: set[socket.socket] = set()
        self.spare: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def watch(self, sock: socket.socket, events: int, pair: Pair) -> None:
        if sock.fileno() < 0:
            return
        if not events:
            if sock in self.watched:
                self.selector.unregister(sock)
                self.watched.discard(sock)
        elif sock in self.watched:
            self.selector.modify(sock, events, pair)
        else:
            self.selector.register(sock, events, pair)
            self.watched.add(sock)

    def accept(self, listener: socket.socket) -> None:
        for _ in range(64):
            try:
                client, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._shed(listener)  # out of fds: refuse one, or the loop would spin
                    return
                raise
            try:
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError:
                _reset(client)
                return
            try:
                upstream.connect(self.path)
            except OSError:
                # The proxy is gone (or refuses): no way out. The program sees a reset.
                upstream.close()
                _reset(client)
                continue
            Pair(self, client, upstream)

    def _shed(self, listener: socket.socket) -> None:
        """With every fd taken, accept one waiting connection on the spare fd and reset it:
        the program hears a refusal instead of waiting, and the listener stops being ready."""
        if self.spare is None:
            return
        os.close(self.spare)
        self.spare = None
        try:
            client, _ = listener.accept()
            _reset(client)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self.spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)


def _reset(client: socket.socket) -> None:
    with contextlib.suppress(OSError):
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
    client.close()


def _no_dump() -> None:
    """PR_SET_DUMPABLE 0: /proc/1/mem and friends are closed to the command (same uid)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        os.write(2, b"relay: usage: relay.py SOCKET PORT COMMAND...\n")
        return 2
    path, port, command = argv[0], int(argv[1]), argv[2:]
    relay = Relay(path, port)
    _no_dump()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler: the wakeup fd hears it)
    extra = os.environ.pop(ENV_NAME, None)  # the caller's variables: the command's alone
    pid = os.fork()
    if pid == 0:
        for sig in (signal.SIGCHLD, *FORWARDED):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        try:
            if extra:
                import json

                os.environ.update(json.loads(extra))
            os.execvp(command[0], command)  # noqa: S606  # (the sandbox's command)
        except OSError as exc:
            os.write(2, f"bwrap: execvp {command[0]}: {exc.strerror}\n".encode())
        os._exit(1)
    for sig in FORWARDED:  # passed on to the command (the server signals it directly too)
        signal.signal(sig, lambda sig, _frame: _forward(pid, sig))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the command's streams end when the command's processes close them
        os.dup2(null, fd)
    os.close(null)
    relay.selector.register(wake_r, selectors.EVENT_READ, "wake")
    while True:
        for key, mask in relay.selector.select():
            if key.data == "wake":
                with contextlib.suppress(OSError):
                    os.read(wake_r, 4096)
                status = _reap(pid)
                if status is not None:
                    return status
            elif key.data is None:
                relay.accept(key.fileobj)  # type: ignore[arg-type]
            else:
                key.data.on_event(key.fileobj, mask)


def _forward(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def _reap(command: int) -> int | None:
    """Reap every child that has ended; the command's exit status once it has."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        if pid == command:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))
