"""envd's `process.Process` over our executions.

A process is an execution of the sandbox's session, started through the session router (so
it runs on the session's home whichever replica answers, under the same limits and egress
policy, mirrored to Redis, listed by `list_executions` and the console). Its pid is derived
from the execution id; SendInput, CloseStdin and SendSignal reach it through the router's
execution access (forwarded to the replica that runs it). A Start or Connect stream reads the
execution's events; a client that goes away ends the read, never the process (as E2B's).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from sandbox_runtime.domain.models import ExecutionInfo
from sandbox_runtime.e2b.connect import ConnectError, Method
from sandbox_runtime.e2b.paths import HOME, to_e2b, to_workspace
from sandbox_runtime.e2b.sandboxes import E2BSandbox
from sandbox_runtime.errors import (
    ExecutionNotFoundError,
    InvalidRequestError,
    LimitExceededError,
    OwnerUnavailableError,
    PolicyViolationError,
    SandboxRuntimeError,
)

KEEPALIVE_SECONDS = 10.0
# What E2B's sandboxes set (its user is `user`, at home in /home/user: our workspace).
E2B_ENV = {"HOME": HOME, "USER": "user", "LOGNAME": "user", "SHELL": "/bin/bash"}
MIRROR_LAG_SECONDS = 5.0
MAX_STDIN_BYTES = 1024 * 1024
RUN_CHARS = 256 * 1024  # output joined into one data message (well under connect.MAX_FRAME)
SIGNALS = {"SIGNAL_SIGKILL": True, "SIGNAL_SIGTERM": False, 9: True, 15: False}


def pid_of(execution_id: str) -> int:
    """A process id for an execution: stable, from its id (E2B's pids are uint32)."""
    return 1000 + int(hashlib.sha256(execution_id.encode()).hexdigest()[:7], 16)


def connect_error(exc: Exception) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, ExecutionNotFoundError):
        return ConnectError("not_found", str(exc))
    if isinstance(exc, InvalidRequestError | PolicyViolationError):
        return ConnectError("invalid_argument", str(exc))
    if isinstance(exc, LimitExceededError):
        return ConnectError("resource_exhausted", str(exc))
    if isinstance(exc, OwnerUnavailableError):
        return ConnectError("unavailable", str(exc))
    if isinstance(exc, SandboxRuntimeError):
        return ConnectError("internal", str(exc))
    return ConnectError("internal", f"{type(exc).__name__}")


def _end(info: ExecutionInfo) -> dict[str, Any]:
    code = info.exit_code
    exited = code is not None and info.signal is None
    if exited:
        status = f"exit status {code}"
    elif info.signal:
        status = f"signal: {info.signal.lower().removeprefix('sig')}"
    else:
        status = info.status.value
    end: dict[str, Any] = {
        "exitCode": code if exited else -1,
        "exited": exited,
        "status": status,
    }
    if info.error or info.reason:
        end["error"] = info.error or info.reason
    return {"event": {"end": end}}


class ProcessService:
    def __init__(self, services: Any) -> None:
        self.services = services

    def methods(self) -> dict[str, Method]:
        p = "/process.Process/"
        return {
            p + "Start": Method("server", self.start),
            p + "Connect": Method("server", self.connect),
            p + "List": Method("unary", self.list),
            p + "SendInput": Method("unary", self.send_input),
            p + "StreamInput": Method("client", self.stream_input),
            p + "SendSignal": Method("unary", self.send_signal),
            p + "CloseStdin": Method("unary", self.close_stdin),
            p + "Update": Method("unary", self.update),
        }

    async def start(
        self, message: dict[str, Any], sandbox: E2BSandbox, request: Request
    ) -> AsyncIterator[dict[str, Any]]:
        process = message.get("process")
        if not isinstance(process, dict) or not isinstance(process.get("cmd"), str):
            raise ConnectError("invalid_argument", "process.cmd (a string) is required")
        if message.get("pty"):
            raise ConnectError("unimplemented", "PTY (sandbox.pty) is not supported by this server")
        args = process.get("args") or []
        envs = process.get("envs") or {}
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConnectError("invalid_argument", "process.args must be a list of strings")
        if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
            raise ConnectError("invalid_argument", "process.envs must map names to strings")
        try:
            cwd = process.get("cwd")
            if not (isinstance(cwd, str) and (cwd == "/tmp" or cwd.startswith("/tmp/"))):
                cwd = to_workspace(cwd, HOME)  # (the sandbox's /tmp is its own: allowed too)
            result = await self.services.router.run(
                sandbox.owner,
                "execute",
                {
                    "request": {
                        "command": [process["cmd"], *args],
                        "interactive": bool(message.get("stdin")),
                        "working_directory": cwd,
                        "environment": {**E2B_ENV, **sandbox.env_vars, **envs},
                        "timeout_seconds": self.services.settings.max_timeout,
                        "sandbox_config": sandbox.sandbox_config(),
                    }
                },
            )
        except Exception as exc:
            raise connect_error(exc) from None
        execution_id = result["execution_id"]
        yield {"event": {"start": {"pid": pid_of(execution_id)}}}
        async for event in self._follow(sandbox, execution_id, 0):
            yield event

    async def connect(
        self, message: dict[str, Any], sandbox: E2BSandbox, request: Request
    ) -> AsyncIterator[dict[str, Any]]:
        info = await self._find(sandbox, message)
        yield {"event": {"start": {"pid": pid_of(info.execution_id)}}}
        async for event in self._follow(sandbox, info.execution_id, info.last_seq):
            yield event

    async def _follow(
        self, sandbox: E2BSandbox, execution_id: str, after: int
    ) -> AsyncIterator[dict[str, Any]]:
        """The execution's output from `after` on as envd's events, then its end; a keepalive
        whenever nothing came for KEEPALIVE_SECONDS."""
        executions = self.services.router.executions
        wait = min(KEEPALIVE_SECONDS, self.services.settings.max_wait)
        # An execution started on another replica (the session's home) reaches this one's
        # view through the Redis mirror a few ms after its start was answered.
        unseen_until = time.monotonic() + MIRROR_LAG_SECONDS
        while True:
            try:
                page = await executions.read_output(sandbox.owner, execution_id, after, 1000, wait)
            except ExecutionNotFoundError:
                if time.monotonic() > unseen_until:
                    raise ConnectError("not_found", f"process {execution_id} not found") from None
                await asyncio.sleep(0.02)
                continue
            except Exception as exc:
                raise connect_error(exc) from None
            for kind, text in _runs(page.events):
                data = base64.b64encode(text.encode()).decode()
                yield {"event": {"data": {kind: data}}}
            after = max(after, page.next_cursor)
            if page.info.status.finished and not page.has_more:
                yield _end(page.info)
                return
            if not page.events:
                yield {"event": {"keepalive": {}}}

    async def _find(self, sandbox: E2BSandbox, message: dict[str, Any]) -> ExecutionInfo:
        """The running execution a ProcessSelector names. Raises ConnectError."""
        selector = message.get("process")
        pid = selector.get("pid") if isinstance(selector, dict) else None
        if not isinstance(pid, int) or isinstance(pid, bool):
            if isinstance(selector, dict) and "tag" in selector:
                raise ConnectError("not_found", f"no process with tag {selector['tag']!r}")
            raise ConnectError("invalid_argument", "process.pid (a number) is required")
        for info in await self._running(sandbox):
            if pid_of(info.execution_id) == pid:
                return info
        raise ConnectError("not_found", f"process with pid {pid} not found")

    async def _running(self, sandbox: E2BSandbox) -> list[ExecutionInfo]:
        try:
            infos, _ = await self.services.router.executions.list(sandbox.owner, "running", 1000)
        except Exception as exc:
            raise connect_error(exc) from None
        return [i for i in infos if i.language is None]

    async def list(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        processes = []
        for info in await self._running(sandbox):
            argv = (
                info.command if isinstance(info.command, list) else ["/bin/sh", "-c", info.command]
            )
            processes.append(
                {
                    "config": {
                        "cmd": argv[0] if argv else "",
                        "args": argv[1:],
                        "envs": {},
                        "cwd": to_e2b(info.working_directory),
                    },
                    "pid": pid_of(info.execution_id),
                }
            )
        return {"processes": processes}

    async def _stdin(
        self, sandbox: E2BSandbox, message: dict[str, Any], data: str, close: bool
    ) -> None:
        info = await self._find(sandbox, message)
        try:
            await self.services.router.executions.send_stdin(
                sandbox.owner, info.execution_id, data, close
            )
        except Exception as exc:
            raise connect_error(exc) from None

    async def send_input(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        await self._stdin(sandbox, message, _input(message.get("input")), False)
        return {}

    async def stream_input(
        self, messages: AsyncIterator[dict[str, Any]], sandbox: E2BSandbox
    ) -> dict[str, Any]:
        target: dict[str, Any] | None = None
        async for message in messages:
            if "start" in message:
                target = message["start"] or {}
            elif "data" in message:
                if target is None:
                    raise ConnectError("failed_precondition", "send a start event first")
                await self._stdin(
                    sandbox, target, _input((message["data"] or {}).get("input")), False
                )
        return {}

    async def close_stdin(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        await self._stdin(sandbox, message, "", True)
        return {}

    async def send_signal(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        signal = message.get("signal")
        if signal not in SIGNALS:
            raise ConnectError(
                "invalid_argument", "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL"
            )
        info = await self._find(sandbox, message)
        try:
            await self.services.router.executions.cancel(
                sandbox.owner, info.execution_id, SIGNALS[signal]
            )
        except Exception as exc:
            raise connect_error(exc) from None
        return {}

    async def update(self, message: dict[str, Any], sandbox: E2BSandbox) -> dict[str, Any]:
        if message.get("pty"):
            raise ConnectError("unimplemented", "PTY (sandbox.pty) is not supported by this server")
        await self._find(sandbox, message)
        return {}


def _runs(events: list[Any]) -> list[tuple[str, str]]:
    """The page's output as runs of one stream each (consecutive events joined, up to
    RUN_CHARS a message): one frame for many small writes."""
    runs: list[tuple[str, str]] = []
    for event in events:
        if event.type not in ("stdout", "stderr") or not event.data:
            continue
        if runs and runs[-1][0] == event.type and len(runs[-1][1]) + len(event.data) <= RUN_CHARS:
            runs[-1] = (event.type, runs[-1][1] + event.data)
        else:
            runs.append((event.type, event.data))
    return runs


def _input(value: object) -> str:
    """The text of a ProcessInput (`stdin`, base64). Raises ConnectError."""
    if not isinstance(value, dict) or not isinstance(value.get("stdin"), str):
        if isinstance(value, dict) and "pty" in value:
            raise ConnectError("unimplemented", "PTY input is not supported by this server")
        raise ConnectError("invalid_argument", "input.stdin (base64) is required")
    encoded = value["stdin"]
    if len(encoded) > MAX_STDIN_BYTES * 4 // 3 + 4:
        raise ConnectError(
            "resource_exhausted", f"stdin over {MAX_STDIN_BYTES} bytes in one message"
        )
    try:
        return base64.b64decode(encoded, validate=True).decode("utf-8", errors="replace")
    except ValueError:
        raise ConnectError("invalid_argument", "input.stdin is not base64") from None
