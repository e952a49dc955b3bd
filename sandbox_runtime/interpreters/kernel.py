"""One Jupyter kernel inside a sandbox, and the host's side of the messaging protocol.

The host runs no ZeroMQ against the kernel: the sandbox's first process is a small relay
(runtime_files/srt_kernel_pipe.py) that starts the kernel, is its only client (over `ipc`
files in a per-kernel directory, or loopback TCP inside the sandbox for a kernel that only
speaks TCP) and passes whole messages to and from the host as length-prefixed records on its
stdin and stdout. Whatever a flood makes ZeroMQ buffer is then buffered inside the sandbox,
under its memory limit; the host reads records with its own bounds (MESSAGE_MAX_BYTES,
QUEUED_MAX_BYTES) and drops what answers nothing it waits for without parsing it. No host
port ever listens. The sandbox is an execution sandbox like any other (namespaces, the sandbox
uid, seccomp, a cgroup for its whole life, the session's workspace), except that its empty
network namespace may carry loopback TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jupyter_client.session import Session
from loguru import logger

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.egress.supervisor import DeniedHandler
from sandbox_runtime.errors import SandboxSpawnError
from sandbox_runtime.interpreters.runtime import KernelSpec
from sandbox_runtime.sandbox import BubblewrapBackend, SandboxLimits, SandboxProcess, SandboxSpec
from sandbox_runtime.sandbox.host import KERNEL_DIR, RUNTIME

START_TIMEOUT = 60.0
CONNECTION_FILE = f"{KERNEL_DIR}/connection.json"
STDERR_KEPT = 4096
FLUSH_SECONDS = 1.0  # longest a trailing-output kernel's flush may take
IDLE_AFTER_REPLY = 5.0  # longest a call waits for its idle status once its reply is in
PIPE = Path(__file__).with_name("runtime_files") / "srt_kernel_pipe.py"
CHANNELS = ("iopub", "shell", "stdin", "control")  # (the relay's record channel numbers)
DROPPED = 255  # a record saying the relay dropped a message over MESSAGE_MAX_BYTES
MAX_PARTS = 64  # parts of one message (a Jupyter message has 6 and its buffers)
# What a kernel (code the server does not trust) can make the server hold. Everything it sends
# is read at once, for the kernel's whole life; what answers no request that is waiting
# (output of a cell that has returned, messages with a made-up parent) is dropped unparsed.
MESSAGE_MAX_BYTES = 8 * 1024 * 1024  # one message; a larger one is dropped (the relay says so)
NOTE_MAX_BYTES = 1024  # the relay's note of a dropped message
RECORD_COST = 256  # bytes each record is charged at least (empty records are no free lunch)
WRITE_MAX_BYTES = 4 * 1024 * 1024  # requests the relay has not read yet
DELIM = b"<IDS|MSG>"
SIZE = "srt_size"  # (a taken message's cost, in the dict _next returns)
QUEUED_MAX_BYTES = 16 * 1024 * 1024  # messages of waiting requests not yet taken, all channels
# A kernel that sends more than this outside its calls within the window is stopped: reading
# and dropping it costs the server CPU, and no program needs it.
UNSOLICITED_MAX_BYTES = 64 * 1024 * 1024
UNSOLICITED_WINDOW = 10.0
FLOODED = (
    f"the interpreter was stopped: it sent more than {UNSOLICITED_MAX_BYTES // 2**20} MiB of "
    f"messages outside its calls within {UNSOLICITED_WINDOW:g} s; its state is lost"
)
KERNEL_ENV = {
    "IPYTHONDIR": "/tmp/.ipython",
    "FONTCONFIG_FILE": f"{RUNTIME}/share/srt/fonts.conf",
    "MPLCONFIGDIR": "/tmp/.matplotlib",
    "JPY_PARENT_PID": "",
    "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    "SRT_USER_SITE": "1",  # (the runtime's srt_site: ~/.local's site-packages found late)
}

OnMessage = Callable[[str, dict[str, Any]], None]  # (msg_type, content)
OnDropped = Callable[[str, int], None]  # (unsolicited | over_bound, bytes)
Queued = tuple[list[bytes], int, str]  # a waiting message: its frames, its cost, its parent


class KernelDiedError(Exception):
    """The kernel process ended (crashed, killed, out of memory) during an operation."""


class SandboxedKernel:
    """A kernel process in its own sandbox plus a client connected to it. One call at a time."""

    def __init__(
        self,
        backend: BubblewrapBackend,
        spec: KernelSpec,
        workspace: Path,
        limits: SandboxLimits,
        kernels_root: Path,
        env: dict[str, str] | None = None,
        egress: EgressPolicy | None = None,
        on_dropped: OnDropped | None = None,
    ) -> None:
        self.backend = backend
        self.on_dropped = on_dropped
        self.egress = egress
        # Who hears the egress proxy's denials (the interpreter's current call); settable, as
        # a pooled kernel gets its owner after it started.
        self.on_denied: DeniedHandler | None = None
        self.egress_deaths = 0  # the proxy's death count when this kernel got its socket
        self.spec = spec
        self.workspace = workspace
        self.limits = limits
        self.kernels_root = kernels_root
        self.env = dict(env or {})
        self.directory: Path | None = None
        self.process: SandboxProcess | None = None
        self.session: Session | None = None  # signs requests, checks and decodes messages
        self.started_at = 0.0
        self._stderr = bytearray()
        self._drains: list[asyncio.Task[None]] = []
        self._died = asyncio.Event()
        # Messages (with their size) answering requests in `_wanted`, per channel.
        self._queues: dict[str, asyncio.Queue[Queued]] = {
            name: asyncio.Queue() for name in ("iopub", "shell", "stdin")
        }
        self._wanted: set[str] = set()  # ids of the requests whose answers are awaited
        self._queued_bytes = 0
        self.dropped_bytes = 0  # answers dropped because the queues were full (QUEUED_MAX_BYTES)
        self._window_start = 0.0
        self._window_bytes = 0
        # Why the server stopped this kernel itself (None: it did not); says so to the caller.
        self.end_reason: str | None = None
        self._stopping: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.running and not self._died.is_set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the sandbox and wait until the kernel answers.

        Raises SandboxSpawnError (and the sandbox's own errors) with the kernel's stderr.
        """
        self.kernels_root.mkdir(mode=0o711, parents=True, exist_ok=True)
        directory = self.kernels_root / f"k-{secrets.token_hex(8)}"
        directory.mkdir(mode=0o700)
        self.directory = directory
        info = {
            "transport": "ipc",
            "ip": f"{KERNEL_DIR}/k",
            "shell_port": 1,
            "iopub_port": 2,
            "stdin_port": 3,
            "control_port": 4,
            "hb_port": 5,
            "key": secrets.token_hex(32),
            "signature_scheme": "hmac-sha256",
            "kernel_name": self.spec.kernel,
        }
        connection = directory / "connection.json"
        connection.write_text(json.dumps(info))
        if os.geteuid() == 0:
            uid, gid = self.backend.sandbox_uid, self.backend.sandbox_gid
            os.chown(directory, uid, gid)
            os.chown(connection, uid, gid)
        os.chmod(connection, 0o600)
        shutil.copyfile(PIPE, directory / PIPE.name)  # (the server's own, whatever the runtime)
        kernel_argv = list(self.spec.argv)
        if kernel_argv and "/" not in kernel_argv[0]:
            kernel_argv[0] = f"{RUNTIME}/bin/{kernel_argv[0]}"
        argv = [
            f"{RUNTIME}/bin/python", "-I", f"{KERNEL_DIR}/{PIPE.name}", CONNECTION_FILE,
            str(MESSAGE_MAX_BYTES), "tcp" if self.spec.tcp else "ipc", "--", *kernel_argv,
        ]  # fmt: skip
        env = {**KERNEL_ENV, **self.spec.env, **self.env}
        self.started_at = time.monotonic()
        self.process = await self.backend.spawn(
            SandboxSpec(
                argv=argv,
                workspace=self.workspace,
                limits=self.limits,
                env={k: v for k, v in env.items() if v},
                kernel_dir=directory,
                loopback_inet=True,
                interactive=True,  # (stdin: the requests' pipe)
                egress=self.egress,
                on_denied=self._denied,
            )
        )
        if self.backend.egress is not None:
            self.egress_deaths = self.backend.egress.deaths
        self.session = Session(
            key=str(info["key"]).encode(), signature_scheme="hmac-sha256", username="srt"
        )
        loop = asyncio.get_running_loop()
        self._drains = [
            loop.create_task(self._read(self.process.stdout)),
            loop.create_task(self._drain(self.process.stderr)),
            loop.create_task(self._watch(self.process)),
        ]
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self) -> None:
        """Until the kernel answers a kernel_info request on shell AND its iopub status for it
        arrives: a SUB socket misses what is published before its subscription reaches the
        publisher (slower through the relay), so output would be lost otherwise."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            msg_id = self._send("shell", "kernel_info_request", {})
            self._wanted.add(msg_id)
            try:
                await self._await_reply("shell", msg_id, deadline)
                await self._await_reply("iopub", msg_id, min(deadline, time.monotonic() + 0.25))
                return
            except TimeoutError:
                pass
            finally:
                self._release(msg_id)
            if time.monotonic() >= deadline:
                raise SandboxSpawnError(
                    f"the {self.spec.language} interpreter did not answer within "
                    f"{START_TIMEOUT:g} s: {self.stderr_tail()}"
                )

    async def _await_reply(self, channel: str, msg_id: str, deadline: float) -> dict[str, Any]:
        """The next message on a channel whose parent is `msg_id` (others are dropped: they
        answer requests nobody waits for any more); TimeoutError at the deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            msg = await self._next(channel, left)
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg

    async def _next(self, channel: str, wait: float | None) -> dict[str, Any]:
        """The next message from a channel's queue, decoded now (a queue holds raw frames:
        bounded in bytes, where decoded JSON may be twenty times larger). Raises
        TimeoutError, KernelDiedError."""
        queue = self._queues[channel]
        while True:
            if not queue.empty():  # (most messages: no futures, no wait)
                item = queue.get_nowait()
            else:
                if not self.alive:
                    raise KernelDiedError(self.end_reason or self.stderr_tail())
                item = await self._wait_item(queue, wait)
            frames, size, _ = item
            self._queued_bytes -= size
            msg = self._decode(frames, size)
            if msg is not None:
                msg[SIZE] = size  # (what it cost: a message its taker drops is counted so)
                return msg

    async def _wait_item(self, queue: asyncio.Queue[Queued], wait: float | None) -> Queued:
        get = asyncio.ensure_future(queue.get())
        died = asyncio.ensure_future(self._died.wait())
        try:
            done, _ = await asyncio.wait(
                {get, died}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:  # (cancelled: a message the get took already is dropped)
            died.cancel()
            if get.done() and not get.cancelled() and get.exception() is None:
                self._queued_bytes -= get.result()[1]
            get.cancel()
            raise
        died.cancel()
        if not get.done():
            get.cancel()  # a queue get: cancelling it loses nothing
        if get in done:
            return get.result()
        if died in done:
            raise KernelDiedError(self.end_reason or self.stderr_tail())
        raise TimeoutError

    def _decode(self, frames: list[bytes], size: int) -> dict[str, Any] | None:
        """A queued message checked and decoded; None (and counted) when it is not a
        well-formed message: its signature, its header, parent header and content dicts.
        Raises KernelDiedError (stopped meanwhile)."""
        session = self.session
        if session is None:
            raise KernelDiedError(self.end_reason or self.stderr_tail())
        try:
            msg = session.deserialize(frames)
        except Exception:  # a message it could not check (bad signature) or decode
            msg = None
        if msg is None or not all(
            isinstance(msg.get(k), dict) for k in ("header", "parent_header", "content")
        ):
            self._unsolicited(size)
            return None
        return msg

    def _send(self, channel: str, msg_type: str, content: dict[str, Any]) -> str:
        """Sign and send a request to the kernel through the relay; its msg_id.

        Raises KernelDiedError when the kernel is gone (or its relay stopped reading)."""
        process, session = self.process, self.session
        if process is None or process.stdin is None or session is None or not self.alive:
            raise KernelDiedError(self.end_reason or self.stderr_tail())
        if process.stdin.transport.get_write_buffer_size() > WRITE_MAX_BYTES:
            self._end("the interpreter was stopped: its relay stopped reading requests")
            raise KernelDiedError(self.end_reason or "")
        msg = session.msg(msg_type, content)
        parts = session.serialize(msg)
        record = [struct.pack(">BI", CHANNELS.index(channel), len(parts))]
        for part in parts:
            record += (struct.pack(">I", len(part)), part)
        process.stdin.write(b"".join(record))
        return str(msg["header"]["msg_id"])

    async def _read(self, stream: asyncio.StreamReader) -> None:
        """Take the relay's records as they come, for the kernel's whole life: answers to
        awaited requests are queued raw (within QUEUED_MAX_BYTES); the rest is dropped
        unparsed. The relay is as untrusted as the kernel: every record is charged at least
        RECORD_COST bytes, nothing it says is held past the bounds, and a record that is not
        what the relay sends ends the kernel."""
        session = self.session
        assert session is not None
        try:
            while True:
                channel, count = struct.unpack(">BI", await stream.readexactly(5))
                if channel == DROPPED:  # (the relay's note of a message too big to copy)
                    if count != 1:
                        raise ValueError(f"a drop note of {count} parts")
                    part = (await self._parts(stream, 1, NOTE_MAX_BYTES))[0]
                    parent, size = _note(part)
                    self._unsolicited(RECORD_COST + len(part))  # (the note itself)
                    if parent is not None and parent in self._wanted:
                        self._over_bound(size)
                    else:
                        self._unsolicited(size)
                    continue
                if channel >= len(CHANNELS) or not 5 <= count <= MAX_PARTS:
                    raise ValueError(f"a record of channel {channel} with {count} parts")
                parts = await self._parts(stream, count, MESSAGE_MAX_BYTES)
                size = RECORD_COST + sum(map(len, parts))
                if DELIM not in parts or len(parts) - parts.index(DELIM) < 6:
                    raise ValueError("a record that is no message")
                frames = parts[parts.index(DELIM) + 1 :]
                queue = self._queues.get(CHANNELS[channel])
                parent = _msg_id(session, frames[2])
                if queue is None or parent is None or parent not in self._wanted:
                    self._unsolicited(size)
                    continue
                if self._queued_bytes + size > QUEUED_MAX_BYTES:
                    self._over_bound(size)
                    continue
                self._queued_bytes += size
                queue.put_nowait((frames, size, parent))
        except asyncio.IncompleteReadError:  # the relay ended: so did the kernel
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # (whatever it was: the kernel is not heard any more)
            self._end(f"the interpreter was stopped: its relay broke the protocol ({exc})")

    def _release(self, *msg_ids: str | None) -> None:
        """Requests no longer awaited: their answers still queued are dropped (they would
        hold the queue bound against the next request's)."""
        self._wanted.difference_update(msg_ids)
        queued = 0
        for queue in self._queues.values():
            kept = []
            while not queue.empty():
                item = queue.get_nowait()
                if item[2] in self._wanted:
                    kept.append(item)
                    queued += item[1]
            for item in kept:
                queue.put_nowait(item)
        self._queued_bytes = queued

    async def _parts(self, stream: asyncio.StreamReader, count: int, most: int) -> list[bytes]:
        """The `count` parts of one record, at most `most` bytes in all (ValueError)."""
        parts: list[bytes] = []
        total = 0
        for _ in range(count):
            (length,) = struct.unpack(">I", await stream.readexactly(4))
            total += length
            if total > most:
                raise ValueError(f"a message over {most} bytes")
            parts.append(await stream.readexactly(length))
        return parts

    def _over_bound(self, size: int) -> None:
        self.dropped_bytes += size  # (the call reading them says so)
        if self.on_dropped is not None:
            self.on_dropped("over_bound", size)

    def _unsolicited(self, size: int) -> None:
        """Count a dropped message that answered nothing awaited; stop a kernel that floods."""
        if self.on_dropped is not None:
            self.on_dropped("unsolicited", size)
        now = time.monotonic()
        if now - self._window_start > UNSOLICITED_WINDOW:
            self._window_start, self._window_bytes = now, 0
        self._window_bytes += size
        if self._window_bytes > UNSOLICITED_MAX_BYTES and self.end_reason is None:
            logger.warning(
                "stopping a {} interpreter: {} bytes of messages outside its calls in {:.1f} s",
                self.spec.language, self._window_bytes, now - self._window_start,
            )  # fmt: skip
            self._end(FLOODED)

    def _end(self, reason: str) -> None:
        """The server stops this kernel itself: callers are told `reason`."""
        if self.end_reason is None:
            self.end_reason = reason
        self._died.set()
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self.stop())

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        """Read the kernel's stdout/stderr (it must never block on a full pipe); keep a tail."""
        while chunk := await stream.read(65536):
            self._stderr += chunk
            del self._stderr[:-STDERR_KEPT]

    async def _watch(self, process: SandboxProcess) -> None:
        await process.wait()
        self._died.set()

    def stderr_tail(self) -> str:
        text = self._stderr.decode("utf-8", "replace").strip()
        return text[-1000:] if text else "no output"

    async def stop(self) -> None:
        """Kill the sandbox and everything in it; remove the kernel's directory. Idempotent."""
        self._died.set()
        self.session = None
        for queue in self._queues.values():  # (what waited for a call is not held on)
            while not queue.empty():
                queue.get_nowait()
        self._queued_bytes = 0
        if self.process is not None:
            process, self.process = self.process, None
            process.kill("cancelled")
            await process.aclose()
        for task in self._drains:
            task.cancel()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    # -- protocol ----------------------------------------------------------------------------

    async def execute(
        self, code: str, on_message: OnMessage, allow_stdin: bool = True
    ) -> dict[str, Any]:
        """Run `code`; every output message goes to `on_message` as it arrives (and
        ("dropped", {"bytes": N}) for messages of it dropped past QUEUED_MAX_BYTES or
        MESSAGE_MAX_BYTES). The kernel's execute_reply content (status ok, error or aborted).

        Raises KernelDiedError (the state is gone).
        """
        content = {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": allow_stdin, "stop_on_error": False,
        }  # fmt: skip
        msg_id = self._send("shell", "execute_request", content)
        self._wanted.add(msg_id)
        reported = self.dropped_bytes

        def report_drops() -> None:  # (messages of this call dropped since last said)
            nonlocal reported
            if self.dropped_bytes > reported:
                on_message("dropped", {"bytes": self.dropped_bytes - reported})
                reported = self.dropped_bytes

        reply: dict[str, Any] | None = None
        replied_at = 0.0
        idle = False
        iopub = asyncio.ensure_future(self._next("iopub", None))
        shell = asyncio.ensure_future(self._next("shell", None))
        stdin = asyncio.ensure_future(self._next("stdin", None))
        pending = {iopub, shell, stdin}
        # A kernel whose output may trail the cell's idle status (spec.linger) is flushed: a
        # kernel_info request after the cell, whose own idle status comes after everything
        # the kernel queued on iopub before it, and at least `linger` seconds.
        barrier: str | None = None
        flushed = False
        linger_until = deadline = 0.0
        try:
            while True:
                report_drops()
                if reply is not None and not idle:
                    # (the idle status may have been dropped with output past the bounds)
                    if time.monotonic() - replied_at >= IDLE_AFTER_REPLY:
                        break
                if reply is not None and idle:
                    if not self.spec.linger:
                        break
                    now = time.monotonic()
                    if barrier is None:
                        barrier = self._send("shell", "kernel_info_request", {})
                        self._wanted.add(barrier)
                        linger_until, deadline = now + self.spec.linger, now + FLUSH_SECONDS
                    elif (flushed and now >= linger_until) or now >= deadline:
                        break
                wait = None
                if barrier is not None:
                    until = linger_until if flushed else deadline
                    wait = max(0.0, until - time.monotonic())
                elif reply is not None:
                    wait = max(0.0, replied_at + IDLE_AFTER_REPLY - time.monotonic())
                done, _ = await asyncio.wait(
                    pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    pending.discard(task)
                    msg = task.result()  # KernelDiedError propagates
                    if task is iopub:
                        iopub = asyncio.ensure_future(self._next("iopub", None))
                        pending.add(iopub)
                        parent = msg["parent_header"].get("msg_id")
                        if parent == barrier and msg["msg_type"] == "status":
                            flushed = flushed or msg["content"].get("execution_state") == "idle"
                        if parent != msg_id:
                            continue
                        if reply is not None:  # (its output goes on: wait on for its idle)
                            replied_at = time.monotonic()
                        kind = msg["msg_type"]
                        if kind == "status":
                            idle = idle or msg["content"].get("execution_state") == "idle"
                        elif kind != "execute_input":
                            on_message(kind, msg["content"])
                    elif task is shell:
                        # (read on after the reply too: what follows it is dropped, not held)
                        shell = asyncio.ensure_future(self._next("shell", None))
                        pending.add(shell)
                        if reply is None and msg["parent_header"].get("msg_id") == msg_id:
                            reply = dict(msg["content"])
                            replied_at = time.monotonic()
                        else:  # (a second "reply", or an answer to nothing of this call's)
                            self._unsolicited(msg[SIZE])
                    elif task is stdin:
                        stdin = asyncio.ensure_future(self._next("stdin", None))
                        pending.add(stdin)
                        if msg["msg_type"] == "input_request":
                            on_message("input_request", msg["content"])
        finally:
            self._release(msg_id, barrier)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        report_drops()
        assert reply is not None
        return reply

    def input_reply(self, value: str) -> None:
        """Raises KernelDiedError."""
        self._send("stdin", "input_reply", {"value": value})

    @property
    def egress_lost(self) -> bool:
        """True when this kernel was to have egress and the proxy died since it started: its
        socket is dead (it fails closed) and it should not be handed to anyone."""
        proxy = self.backend.egress
        return self.egress is not None and proxy is not None and proxy.deaths != self.egress_deaths

    def _denied(self, host: str, port: int, reason: str) -> None:
        if self.on_denied is not None:
            self.on_denied(host, port, reason)

    def interrupt(self) -> None:
        """Ask the kernel to interrupt what it runs (its own mechanism: interrupt_request)."""
        with contextlib.suppress(KernelDiedError):
            self._send("control", "interrupt_request", {})
            logger.debug("interrupt sent to the {} kernel", self.spec.language)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _note(part: bytes) -> tuple[str | None, int]:
    """The relay's note of a dropped message: (its parent's msg_id, its size); the size is
    taken for at least MESSAGE_MAX_BYTES (what the relay drops) and at most 2**40."""
    try:
        note = json.loads(part)
    except ValueError:
        return None, MESSAGE_MAX_BYTES
    if not isinstance(note, dict):
        return None, MESSAGE_MAX_BYTES
    parent, size = note.get("parent"), note.get("bytes")
    size = size if isinstance(size, int) else 0
    return (parent if isinstance(parent, str) else None), min(max(size, MESSAGE_MAX_BYTES), 2**40)


def _msg_id(session: Session, frame: bytes) -> str | None:
    """The msg_id in a message's serialized parent header (None: none, or not a string)."""
    try:
        parent = session.unpack(frame)
    except Exception:  # not JSON: not a message of the kernel's
        return None
    msg_id = parent.get("msg_id") if isinstance(parent, dict) else None
    return msg_id if isinstance(msg_id, str) else None
