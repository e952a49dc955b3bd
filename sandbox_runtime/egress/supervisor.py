"""The server's side of the egress proxy (proxy.py): starts it, opens and closes each
sandbox's socket, hears denials, restarts it when it dies.

A sandbox with egress gets a directory of its own holding one socket, bound read-only into
the sandbox at SOCKET_DIR; its relay (relay.pl) carries the sandbox's connections there. A
proxy that dies takes every sandbox's socket with it and a new one never reopens them: those
sandboxes stay without network (fail closed), later ones get the new proxy.

With secret rules (`secrets`, egress/secrets.py) the proxy gets the deployment CA when it
starts, and each socket the rules its sandbox's grant allows, rendered with their values; a
lease then carries the trust bundle the sandbox binds over its system's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.egress import EgressSettings as EgressSettings
from sandbox_runtime.egress.secrets import SecretsBroker
from sandbox_runtime.errors import SandboxSpawnError, SandboxUnavailableError
from sandbox_runtime.sandbox.egress_port import SOCKET_NAME, DeniedHandler
from sandbox_runtime.supervisor import Supervisor

OPEN_SECONDS = 5.0
RESTART_SECONDS = 1.0


@dataclass
class Lease:
    """One sandbox's socket: `host_dir` is bound at SOCKET_DIR inside it."""

    id: str
    host_dir: Path
    on_denied: DeniedHandler | None
    closed: asyncio.Future[None] | None = None
    # The trust bundle (the host's CAs and the deployment's) bound over the sandbox's, when
    # the proxy may terminate TLS for it; and whose sandbox it is (secrets' audit lines).
    trust_bundle: Path | None = None
    grant: Any = None
    # What it was opened with: the policy's rules and a digest of the secret bindings (a
    # socket opened ahead of need serves only a call with exactly these, `assign`).
    rules: tuple[str, ...] = ()
    bindings: str = ""
    deaths: int = 0  # the proxy's deaths when it was opened (a death since took it along)


class EgressProxy:
    """One per server. `start()` before use, `close()` after; `problem` says why it cannot
    serve (then sandboxes that would have egress do not start). The reader of the proxy's
    messages runs under `supervisor` (one of its own when none is given)."""

    def __init__(
        self,
        settings: EgressSettings,
        base_dir: Path,
        uid: int,
        gid: int,
        *,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.settings = settings
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor()
        self.base_dir = base_dir
        self.uid, self.gid = uid, gid
        self.problem: str | None = "egress proxy not started"
        self.on_event: list[Callable[[str, dict[str, Any]], None]] = []  # metrics, logs
        self._proc: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._leases: dict[str, Lease] = {}
        self._pending: dict[str, asyncio.Future[None]] = {}
        self._serial = 0
        self._last_start = 0.0
        self._closing = False
        # How many times the proxy has died: a sandbox started before a death has no network
        # (its socket died), which a pool of sandboxes started ahead must know.
        self.deaths = 0
        # Secret rules, store and CA (set by the owner before start; None: no secrets).
        self.secrets: SecretsBroker | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    async def start(self) -> None:
        """Start the proxy process. Never raises: `problem` says what went wrong."""
        try:
            self.base_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.geteuid() == 0:
                os.chown(self.base_dir, self.uid, self.gid)
            await self._spawn()
            self.problem = None
        except (OSError, SandboxUnavailableError) as exc:
            self.problem = f"the egress proxy did not start: {exc}"
            logger.error("{}", self.problem)

    async def _spawn(self) -> None:
        self._last_start = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        config = {
            "connect_timeout": self.settings.connect_timeout,
            "idle_timeout": self.settings.idle_timeout,
            "max_total": self.settings.max_total,
            "resolvers": self.settings.resolvers,
        }
        argv = [sys.executable, "-B", "-m", "sandbox_runtime.egress.proxy",
                "--control-fd", str(theirs.fileno()), "--settings", json.dumps(config),
                "--user", f"{self.uid}:{self.gid}"]  # fmt: skip
        # Nothing of the server's environment (tokens, secrets) reaches the proxy; the package
        # is imported from where the server imports it.
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": _package_root()}
        try:
            self._proc = subprocess.Popen(
                argv,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                cwd="/",
                start_new_session=True,
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        try:
            hello = json.loads(await asyncio.wait_for(reader.readline(), 15) or b"{}")
        except (TimeoutError, ValueError, OSError) as exc:
            hello = {"error": f"no answer ({exc})"}
        if hello.get("op") != "ready":
            writer.close()
            self._stop_process()
            raise SandboxUnavailableError(hello.get("error") or "it exited at start")
        if self.secrets is not None:
            writer.write(json.dumps(self.secrets.tls_message()).encode() + b"\n")
        self._writer = writer
        self._reader_task = self._supervisor.spawn("egress proxy reader", self._read(reader))
        logger.info("egress proxy started (pid {})", self._proc.pid)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    self._on_message(json.loads(line))
        finally:
            self._on_death()

    def _on_message(self, message: dict[str, Any]) -> None:
        op, sid = message.get("op"), str(message.get("id"))
        if op in ("opened", "error"):
            future = self._pending.pop(sid, None)
            if future is not None and not future.done():
                if op == "opened":
                    future.set_result(None)
                else:
                    future.set_exception(SandboxSpawnError(f"egress: {message.get('error')}"))
            return
        lease = self._leases.get(sid)
        if op == "closed" and lease is not None:
            if lease.closed is not None and not lease.closed.done():
                lease.closed.set_result(None)
        elif op == "secret" and self.secrets is not None:
            self.secrets.used(lease.grant if lease is not None else None, message)
        elif op == "denied" and lease is not None and lease.on_denied is not None:
            host, port = str(message.get("host", "")), int(message.get("port") or 0)
            lease.on_denied(host, port, str(message.get("reason")))
        for hook in self.on_event:  # (metrics: denials, connections, a sandbox's bytes)
            hook(str(op), message)

    def _on_death(self) -> None:
        """The proxy is gone: its sockets with it. Open leases stay dead (fail closed)."""
        self._writer = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(SandboxSpawnError("the egress proxy stopped"))
        self._pending.clear()
        for lease in self._leases.values():
            if lease.closed is not None and not lease.closed.done():
                lease.closed.set_result(None)
        self.deaths += 1
        if not self._closing:
            code = self._proc.poll() if self._proc is not None else None
            logger.error("egress proxy stopped (exit {}); sandboxes using it have no network", code)

    async def _ensure_running(self) -> asyncio.StreamWriter:
        if self._writer is not None:
            return self._writer
        if self._closing:
            raise SandboxSpawnError("the server is shutting down")
        wait = RESTART_SECONDS - (time.monotonic() - self._last_start)
        if wait > 0:
            await asyncio.sleep(wait)
        if self._writer is None:
            self._stop_process()
            try:
                await self._spawn()
                self.problem = None
            except (OSError, SandboxUnavailableError) as exc:
                self.problem = f"the egress proxy did not restart: {exc}"
                raise SandboxSpawnError(self.problem) from exc
        assert self._writer is not None
        return self._writer

    async def open(self, policy: EgressPolicy, on_denied: DeniedHandler | None) -> Lease:
        """A socket for one sandbox under `policy`. Raises SandboxSpawnError, PolicyViolationError
        (its grant narrows to names outside its rules)."""
        writer = await self._ensure_running()
        # (Before anything is made: a caller's narrowing outside its rules raises here.)
        grant = getattr(policy, "grant", None)
        bindings = self.secrets.bindings(grant) if self.secrets is not None else []
        self._serial += 1
        sid = f"s{self._serial}"
        host_dir = self.base_dir / sid
        host_dir.mkdir(mode=0o700)
        if os.geteuid() == 0:
            os.chown(host_dir, self.uid, self.gid)
        bundle = self.secrets.bundle if self.secrets is not None else None
        rules = _rules(policy)
        lease = Lease(sid, host_dir, on_denied, trust_bundle=bundle, grant=grant, rules=rules,
                      bindings=_digest(bindings), deaths=self.deaths)  # fmt: skip
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[sid] = future
        self._leases[sid] = lease
        allow, deny, cidrs, *exact = rules
        writer.write(
            json.dumps(
                {
                    "op": "open",
                    "id": sid,
                    "path": str(host_dir / SOCKET_NAME),
                    "allow": allow,
                    "deny": deny,
                    "cidrs": cidrs,
                    "exact": exact,
                    "max_bytes": self.settings.max_bytes,
                    "max_connections": self.settings.max_connections,
                    "secrets": bindings,
                }
            ).encode()
            + b"\n"
        )
        try:
            await asyncio.wait_for(asyncio.shield(future), OPEN_SECONDS)
        except BaseException:
            self._pending.pop(sid, None)
            await self.close_lease(lease)
            raise
        return lease

    def assign(self, lease: Lease, policy: EgressPolicy, on_denied: DeniedHandler | None) -> bool:
        """Give a socket opened ahead of need (a pooled sandbox's) to a call under `policy`:
        only when it is open on the running proxy and was opened with exactly that policy's
        rules, for the same principal, with the same secret bindings (rendered now: a secret
        set or rule changed since is a mismatch). Then its denials and secret uses are the
        call's. False: the caller gets a sandbox (and socket) of its own."""
        if self._leases.get(lease.id) is not lease or lease.closed is not None:
            return False
        if lease.deaths != self.deaths:
            return False
        if self._writer is None or _rules(policy) != lease.rules:
            return False
        grant = getattr(policy, "grant", None)
        if getattr(grant, "principal", None) != getattr(lease.grant, "principal", None):
            return False
        try:
            bindings = self.secrets.bindings(grant) if self.secrets is not None else []
        except Exception:  # (its own spawn raises it for the call)
            return False
        if _digest(bindings) != lease.bindings:
            return False
        lease.on_denied, lease.grant = on_denied, grant
        return True

    async def close_lease(self, lease: Lease) -> None:
        """Stop one sandbox's socket and cut its connections (its counters are then final)."""
        if self._leases.pop(lease.id, None) is None:
            return
        writer = self._writer
        if writer is not None and not writer.is_closing():
            lease.closed = asyncio.get_running_loop().create_future()
            self._leases[lease.id] = lease  # (until the proxy's answer)
            writer.write(json.dumps({"op": "close", "id": lease.id}).encode() + b"\n")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(lease.closed), OPEN_SECONDS)
            self._leases.pop(lease.id, None)
        shutil.rmtree(lease.host_dir, ignore_errors=True)

    async def aclose(self) -> None:
        self._closing = True
        for lease in list(self._leases.values()):
            await self.close_lease(lease)
        if self._writer is not None:
            self._writer.close()
        self._stop_process()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        if self._own_supervisor:
            await self._supervisor.aclose()
        shutil.rmtree(self.base_dir, ignore_errors=True)
        self.problem = "egress proxy closed"

    def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _rules(policy: EgressPolicy) -> tuple[str, ...]:
    """A policy as the proxy gets it: allow, deny, CIDRs, then the exact addresses."""
    return (
        ",".join(map(str, policy.allow_rules)),
        ",".join(map(str, policy.deny_rules)),
        ",".join(map(str, policy.allow_cidrs)),
        *sorted(map(str, policy.exact)),
    )


def _digest(bindings: list[dict[str, Any]]) -> str:
    """The secret bindings a socket got, as a digest (their values are not kept)."""
    return hashlib.sha256(json.dumps(bindings, sort_keys=True).encode()).hexdigest()


def _package_root() -> str:
    """The directory `sandbox_runtime` is imported from (the proxy imports it there too)."""
    return str(Path(__file__).resolve().parents[2])
