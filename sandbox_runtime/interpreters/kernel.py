"""One Jupyter kernel inside a sandbox, and the host's side of the messaging protocol.

The kernel's sockets are `ipc` files in a per-kernel directory bound into its sandbox (no
host port ever listens); a kernel that only speaks TCP runs behind the runtime's relay, on the
sandbox's own loopback. The sandbox is an execution sandbox like any other (namespaces, the
sandbox uid, seccomp, a cgroup for its whole life, the session's workspace), except that its
empty network namespace may carry loopback TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jupyter_client.asynchronous import AsyncKernelClient
from loguru import logger

from sandbox_runtime.egress.policy import EgressPolicy
from sandbox_runtime.egress.supervisor import DeniedHandler
from sandbox_runtime.errors import SandboxSpawnError
from sandbox_runtime.interpreters.runtime import KernelSpec
from sandbox_runtime.sandbox import BubblewrapBackend, SandboxLimits, SandboxProcess, SandboxSpec
from sandbox_runtime.sandbox.host import KERNEL_DIR, RUNTIME

START_TIMEOUT = 60.0
CONNECTION_FILE = f"{KERNEL_DIR}/connection.json"
STDERR_KEPT = 4096
MAX_QUEUED = 10_000  # messages of one channel waiting to be read
FLUSH_SECONDS = 1.0  # longest a trailing-output kernel's flush may take
KERNEL_ENV = {
    "IPYTHONDIR": "/tmp/.ipython",
    "FONTCONFIG_FILE": f"{RUNTIME}/share/srt/fonts.conf",
    "MPLCONFIGDIR": "/tmp/.matplotlib",
    "JPY_PARENT_PID": "",
    "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    "SRT_USER_SITE": "1",  # (the runtime's srt_site: ~/.local's site-packages found late)
}

OnMessage = Callable[[str, dict[str, Any]], None]  # (msg_type, content)


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
    ) -> None:
        self.backend = backend
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
        self.client: AsyncKernelClient | None = None
        self.started_at = 0.0
        self._stderr = bytearray()
        self._drains: list[asyncio.Task[None]] = []
        self._died = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {
            name: asyncio.Queue() for name in ("iopub", "shell", "stdin")
        }

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
        argv = [a.replace("{connection_file}", CONNECTION_FILE) for a in self.spec.argv]
        if self.spec.tcp:
            inner = [
                a.replace("{connection_file}", "{tcp_connection_file}") for a in self.spec.argv
            ]
            argv = ["python", "-m", "srt_kernel_relay", CONNECTION_FILE, "--", *inner]
        if argv and "/" not in argv[0]:
            argv[0] = f"{RUNTIME}/bin/{argv[0]}"
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
                egress=self.egress,
                on_denied=self._denied,
            )
        )
        if self.backend.egress is not None:
            self.egress_deaths = self.backend.egress.deaths
        loop = asyncio.get_running_loop()
        self._drains = [
            loop.create_task(self._drain(self.process.stdout)),
            loop.create_task(self._drain(self.process.stderr)),
            loop.create_task(self._watch(self.process)),
        ]
        client = AsyncKernelClient()
        client.load_connection_info(dict(info, ip=str(directory / "k")))  # type: ignore[arg-type]
        client.start_channels(hb=False)
        self.client = client
        self._drains += [
            loop.create_task(self._read(channel)) for channel in ("iopub", "shell", "stdin")
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
            assert self.client is not None
            msg_id = self.client.kernel_info()
            try:
                await self._await_reply("shell", msg_id, deadline)
                await self._await_reply("iopub", msg_id, min(deadline, time.monotonic() + 0.25))
                return
            except TimeoutError:
                pass
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
        """The next message from a channel's queue. Raises TimeoutError, KernelDiedError."""
        queue = self._queues[channel]
        if not queue.empty():  # (most messages: no futures, no wait)
            return queue.get_nowait()
        if not self.alive:
            raise KernelDiedError(self.stderr_tail())
        get = asyncio.ensure_future(queue.get())
        died = asyncio.ensure_future(self._died.wait())
        try:
            done, _ = await asyncio.wait(
                {get, died}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            died.cancel()
            if not get.done():
                get.cancel()  # a queue get: cancelling it loses nothing
        if get in done:
            return get.result()
        if died in done:
            raise KernelDiedError(self.stderr_tail())
        raise TimeoutError

    async def _read(self, channel: str) -> None:
        """Move one channel's messages into its queue, for the kernel's whole life: the only
        reader of that socket, so no message is ever taken by a reader nobody awaits."""
        assert self.client is not None
        # The channel's own get_msg, without its poll before each receive (a future and a
        # reader registration per message): receive, check the signature, decode.
        socket = getattr(self.client, f"{channel}_channel").socket
        session = self.client.session
        queue = self._queues[channel]
        while True:
            try:
                _, frames = session.feed_identities(await socket.recv_multipart())
                msg = session.deserialize(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # a message it could not parse (bad signature), a closed socket
                if self._died.is_set() or socket.closed:
                    return
                continue
            queue.put_nowait(msg)
            if queue.qsize() > MAX_QUEUED:  # nobody reads this channel: keep the newest
                queue.get_nowait()

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
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.stop_channels()
            self.client = None
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
        """Run `code`; every output message goes to `on_message` as it arrives. The kernel's
        execute_reply content (status ok, error or aborted).

        Raises KernelDiedError (the state is gone).
        """
        client = self.client
        if client is None or not self.alive:
            raise KernelDiedError(self.stderr_tail())
        msg_id = client.execute(
            code, silent=False, store_history=True, allow_stdin=allow_stdin, stop_on_error=False
        )
        reply: dict[str, Any] | None = None
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
                if reply is not None and idle:
                    if not self.spec.linger:
                        break
                    now = time.monotonic()
                    if barrier is None:
                        barrier = client.kernel_info()
                        linger_until, deadline = now + self.spec.linger, now + FLUSH_SECONDS
                    elif (flushed and now >= linger_until) or now >= deadline:
                        break
                wait = None
                if barrier is not None:
                    until = linger_until if flushed else deadline
                    wait = max(0.0, until - time.monotonic())
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
                        kind = msg["msg_type"]
                        if kind == "status":
                            idle = idle or msg["content"].get("execution_state") == "idle"
                        elif kind != "execute_input":
                            on_message(kind, msg["content"])
                    elif task is shell:
                        if msg["parent_header"].get("msg_id") == msg_id:
                            reply = dict(msg["content"])
                        else:
                            shell = asyncio.ensure_future(self._next("shell", None))
                            pending.add(shell)
                    elif task is stdin:
                        stdin = asyncio.ensure_future(self._next("stdin", None))
                        pending.add(stdin)
                        if msg["msg_type"] == "input_request":
                            on_message("input_request", msg["content"])
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        assert reply is not None
        return reply

    def input_reply(self, value: str) -> None:
        if self.client is not None:
            self.client.input(value)

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
        if self.client is not None and self.alive:
            msg = self.client.session.msg("interrupt_request", {})
            self.client.control_channel.send(msg)
            logger.debug("interrupt sent to the {} kernel", self.spec.language)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
