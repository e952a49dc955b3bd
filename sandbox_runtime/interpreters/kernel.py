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

Here: the kernel's life (its sandbox, its readers, its stop) and its requests. Beside it:
kernel_wire (the records' framing), kernel_inbox (what the host holds of what the kernel
sends: bounds, drops, floods) and kernel_execute (one cell's run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from jupyter_client.session import Session
from loguru import logger

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.egress.supervisor import DeniedHandler
from sandbox_runtime.errors import SandboxSpawnError
from sandbox_runtime.execution.code_mode import (
    BRIDGE_ENV,
    Bridges,
    OpenBridge,
    open_bridge,
    write_library,
)
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.interpreters import kernel_dirs, kernel_execute
from sandbox_runtime.interpreters.env_kernels import pipe_argv
from sandbox_runtime.interpreters.kernel_execute import OnMessage
from sandbox_runtime.interpreters.kernel_inbox import FLOODED, SIZE, Inbox, OnDropped
from sandbox_runtime.interpreters.kernel_wire import (
    MESSAGE_MAX_BYTES,
    DropNote,
    encode_request,
    parent_msg_id,
    read_record,
)
from sandbox_runtime.interpreters.runtime import KernelSpec
from sandbox_runtime.sandbox import BubblewrapBackend, SandboxLimits, SandboxProcess, SandboxSpec
from sandbox_runtime.sandbox.host import KERNEL_DIR, RUNTIME
from sandbox_runtime.supervisor import Supervisor

START_TIMEOUT = 60.0
CONNECTION_FILE = f"{KERNEL_DIR}/connection.json"
STDERR_KEPT = 4096
PIPE = Path(__file__).with_name("runtime_files") / "srt_kernel_pipe.py"
WRITE_MAX_BYTES = 4 * 1024 * 1024  # requests the relay has not read yet
KERNEL_ENV = {
    "IPYTHONDIR": "/tmp/.ipython",
    "FONTCONFIG_FILE": f"{RUNTIME}/share/srt/fonts.conf",
    "MPLCONFIGDIR": "/tmp/.matplotlib",
    "JPY_PARENT_PID": "",
    "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    "SRT_USER_SITE": "1",  # (the runtime's srt_site: ~/.local's site-packages found late)
}


CELL_WATCH = {
    "code": "import mcp_servers", "silent": True, "store_history": False,
    "user_expressions": {}, "allow_stdin": False, "stop_on_error": False,
}  # fmt: skip


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
        supervisor: Supervisor | None = None,
    ) -> None:
        self.backend = backend
        # Runs the kernel's readers and its own stop; a kernel built alone makes its own.
        self.supervisor = supervisor or Supervisor()
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
        self.bridge_dir: Path | None = None
        self.bridge: OpenBridge | None = None
        self.process: SandboxProcess | None = None
        self.session: Session | None = None  # signs requests, checks and decodes messages
        self.started_at = 0.0
        self._stderr = bytearray()
        self._drains: list[asyncio.Task[None]] = []
        self._died = asyncio.Event()
        self.inbox = Inbox(on_dropped, self._flooded)
        # Why the server stopped this kernel itself (None: it did not); says so to the caller.
        self.end_reason: str | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def use_bridge(
        self, makers: list[Bridges], owner: Owner, servers: list[str] | None, execution: Execution
    ) -> None:
        """This call's bridge (servers=[...]) in place of the last one's; none if it names
        none. It answers only its cell's code (cell_sent), not what an earlier cell left
        running. Raises InvalidRequestError."""
        if self.bridge is not None:
            bridge, self.bridge = self.bridge, None
            await bridge.aclose()
        self.bridge = await open_bridge(makers, owner, servers, execution, self.bridge_dir)
        if self.bridge is not None:
            self.bridge.cell = ""  # (no cell's yet: before any request can be read)

    def cell_sent(self, msg_id: str) -> None:
        """The cell's execute request went: its bridge answers that cell's requests."""
        if self.bridge is not None:
            self.bridge.cell = msg_id

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
        uid, gid = self.backend.sandbox_uid, self.backend.sandbox_gid
        self.directory = directory  # (set first: stop removes it, made or half made)
        await asyncio.to_thread(kernel_dirs.make, directory, uid, gid)  # (bounded: kernel_dirs)
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
            os.chown(directory, uid, gid)
            os.chown(connection, uid, gid)
        os.chmod(connection, 0o600)
        shutil.copyfile(PIPE, directory / PIPE.name)  # (the server's own, whatever the runtime)
        kernel_argv = list(self.spec.argv)
        pipe = [f"{RUNTIME}/bin/python", "-I", f"{KERNEL_DIR}/{PIPE.name}"]
        if self.spec.image is not None:  # (an environment's kernel: its PATH finds it)
            assert self.backend.images is not None
            relay_python = self.backend.images.relay_python
            pipe = pipe_argv(relay_python, self.backend.config.runtime_dir, pipe[-1])
        elif kernel_argv and "/" not in kernel_argv[0]:
            kernel_argv[0] = f"{RUNTIME}/bin/{kernel_argv[0]}"
        argv = [*pipe, CONNECTION_FILE, str(MESSAGE_MAX_BYTES), "tcp" if self.spec.tcp else "ipc",
                "--", *kernel_argv]  # fmt: skip
        # Code mode: a directory bound read-only at /run/srt-bridge with the mcp_servers library;
        # a run_code call naming servers opens its bridge's socket there (use_bridge).
        self.bridge_dir = self.kernels_root / f"b-{secrets.token_hex(8)}"
        write_library(self.bridge_dir, [])
        env = {**(KERNEL_ENV if self.spec.image is None else {}), **BRIDGE_ENV,
               **self.spec.env, **self.env}  # fmt: skip
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
                bridge_dir=self.bridge_dir,
                image=self.spec.image,
            )
        )
        if self.backend.egress is not None:
            self.egress_deaths = self.backend.egress.deaths
        self.session = Session(
            key=str(info["key"]).encode(), signature_scheme="hmac-sha256", username="srt"
        )
        language, spawn = self.spec.language, self.supervisor.spawn
        self._drains = [  # (for the kernel's whole life: cancelled by stop)
            spawn(f"{language} kernel reader", self._read(self.process.stdout)),
            spawn(f"{language} kernel stderr", self._drain(self.process.stderr)),
            spawn(f"{language} kernel watch", self._watch(self.process)),
        ]
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise
        if self.spec.language == "python":
            # The library follows cells from the start (mcp_servers.py): a thread started by
            # any cell carries it, even one started before the cell's code imported it.
            # (Silent: no history, no count; its answers, wanted by nobody, are dropped.)
            with contextlib.suppress(KernelDiedError):
                self.send("shell", "execute_request", CELL_WATCH)

    async def _wait_ready(self) -> None:
        """Until the kernel answers a kernel_info request on shell AND its iopub status for it
        arrives: a SUB socket misses what is published before its subscription reaches the
        publisher (slower through the relay), so output would be lost otherwise."""
        try:
            await self._handshake()
        except KernelDiedError as exc:
            raise SandboxSpawnError(
                f"the {self.spec.language} interpreter ended while starting: {exc}"
            ) from exc

    async def _handshake(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            msg_id = self.send("shell", "kernel_info_request", {})
            self.inbox.want(msg_id)
            try:
                await self._await_reply("shell", msg_id, deadline)
                await self._await_reply("iopub", msg_id, min(deadline, time.monotonic() + 0.25))
                return
            except TimeoutError:
                pass
            finally:
                self.inbox.release(msg_id)
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
            msg = await self.next_message(channel, left)
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg

    async def next_message(self, channel: str, wait: float | None) -> dict[str, Any]:
        """The next message from a channel's queue, decoded now (a queue holds raw frames:
        bounded in bytes, where decoded JSON may be twenty times larger). Raises
        TimeoutError, KernelDiedError."""
        while True:
            item = await self.inbox.take(channel, wait, lambda: self.alive, self._died)
            if item is None:
                raise KernelDiedError(self.end_reason or self.stderr_tail())
            frames, size, _ = item
            msg = self._decode(frames, size)
            if msg is not None:
                msg[SIZE] = size  # (what it cost: a message its taker drops is counted so)
                return msg

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
            self.inbox.unsolicited(size)
            return None
        return msg

    def send(self, channel: str, msg_type: str, content: dict[str, Any]) -> str:
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
        process.stdin.write(encode_request(channel, parts))
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
                record = await read_record(stream)
                if isinstance(record, DropNote):
                    self.inbox.noted(record)
                else:
                    self.inbox.offer(record, parent_msg_id(session, record.frames[2]))
        except asyncio.IncompleteReadError:  # the relay ended: so did the kernel
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # (whatever it was: the kernel is not heard any more)
            self._end(f"the interpreter was stopped: its relay broke the protocol ({exc})")

    def _flooded(self, size: int, seconds: float) -> None:
        """The inbox's report of a flood (messages outside calls past the bound): stop it."""
        if self.end_reason is None:
            logger.warning(
                "stopping a {} interpreter: {} bytes of messages outside its calls in {:.1f} s",
                self.spec.language, size, seconds,
            )  # fmt: skip
            self._end(FLOODED)

    def _end(self, reason: str) -> None:
        """The server stops this kernel itself: callers are told `reason`."""
        if self.end_reason is None:
            self.end_reason = reason
        self._died.set()
        if self._stopping is None:
            name = f"stop a {self.spec.language} kernel"
            self._stopping = self.supervisor.spawn(name, self.stop())

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
        self.inbox.clear()  # (what waited for a call is not held on)
        if self.process is not None:
            process, self.process = self.process, None
            process.kill("cancelled")
            await process.aclose()
        for task in self._drains:
            task.cancel()
        if self.bridge is not None:
            bridge, self.bridge = self.bridge, None
            await bridge.aclose()
        if self.directory is not None:
            kernel_dirs.remove(self.directory)
            self.directory = None
        if self.bridge_dir is not None:
            shutil.rmtree(self.bridge_dir, ignore_errors=True)
            self.bridge_dir = None

    # -- protocol ----------------------------------------------------------------------------

    async def execute(
        self, code: str, on_message: OnMessage, allow_stdin: bool = True
    ) -> dict[str, Any]:
        """Run `code` (kernel_execute.execute): every output message goes to `on_message`;
        the kernel's execute_reply content. Raises KernelDiedError (the state is gone)."""
        return await kernel_execute.execute(self, code, on_message, allow_stdin)

    def input_reply(self, value: str) -> None:
        """Raises KernelDiedError."""
        self.send("stdin", "input_reply", {"value": value})

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
            self.send("control", "interrupt_request", {})
            logger.debug("interrupt sent to the {} kernel", self.spec.language)
