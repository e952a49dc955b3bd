"""The hosted servers of this replica: instances started on first use (or kept warm),
stopped when idle, restarted after a crash with backoff, bounded in number, each in its own
sandbox with its own workspace as its state directory.

An instance's state belongs to an owner like a session's does (the Router homes it):
`srv:STATE` of the principal (scope "principal"), `srv:STATE:SESSION` (scope "session"), or
`srv:STATE` of no principal (scope "shared"), where STATE is the entry's `state` or its name.
Its workspace is that owner's, so its state persists across the instance's restarts and is
nobody else's (entries naming one `state` share it: a git server and a filesystem server on
one repository). What its instances said (tool lists, crashes, errors) is kept by owner too
(servers/learned.py), and the caps count the starts in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import (
    InvalidRequestError,
    LimitExceededError,
    PolicyViolationError,
    SandboxRuntimeError,
)
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.sandbox.spec import SandboxSpec
from sandbox_runtime.servers import launch
from sandbox_runtime.servers.catalog import Catalog, CatalogError, Entry
from sandbox_runtime.servers.catalog_file import CatalogFile
from sandbox_runtime.servers.instance import Instance, InstanceError, RemoteError
from sandbox_runtime.servers.keyed_locks import KeyedLocks
from sandbox_runtime.servers.launch import environment, instance_limits, program, stored_secrets
from sandbox_runtime.servers.learned import CRASH_WINDOW, SHARED, Key, Learned, sees
from sandbox_runtime.servers.log_sink import LogSink
from sandbox_runtime.servers.remote import RemoteInstance
from sandbox_runtime.servers.warm import WarmStarts
from sandbox_runtime.supervisor import Supervisor

SWEEP_SECONDS = 5.0
BACKOFF_WAIT = 5.0  # a call waits out a backoff this short; a longer one refuses it
MAX_TOOL_LABELS = 64  # distinct tool labels per server in the metrics (then "other")

Progress = Callable[[int, str], Awaitable[None]]


@dataclass
class ServerState:
    """What the metrics keep of one server on this replica (every principal's)."""

    starts: int = 0
    tools: set[str] = field(default_factory=set)  # labels used in the metrics


class ServerHost:
    """Hosted servers' instances on this replica."""

    def __init__(
        self,
        settings: Settings,
        manager: ExecutionManager,
        metrics: Metrics,
        supervisor: Supervisor,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.metrics = metrics
        self.supervisor = supervisor
        self.servers_dir = settings.servers_dir()
        self.max_instances = settings.max_server_instances
        self.max_per_principal = settings.max_server_instances_per_principal
        self.catalog_file = CatalogFile(settings.servers_path())
        self._instances: dict[Key, Instance | RemoteInstance] = {}
        self._entries: dict[Key, Entry] = {}  # the entry each instance was started from
        self._locks = KeyedLocks[Key]()
        self._states: dict[str, ServerState] = {}
        self.learned = Learned()  # tool lists, crashes and errors, by instance
        self._starting: set[Key] = set()  # starts in flight: counted against the caps
        self._closed = False
        self.warm = WarmStarts(supervisor, self._instance, self._wants_warm, self._backoff_left)

    # -- the catalog -------------------------------------------------------------------------

    def catalog(self) -> Catalog:
        """The catalog file as it is now (see servers/catalog_file.py)."""
        return self.catalog_file.current()

    def entry_for(self, name: str, principal: str) -> Entry:
        """The entry `principal` may use. Raises InvalidRequestError (the same words for an
        unknown server and one this principal may not use)."""
        entry = self.catalog().get(name)
        if entry is None or not entry.allows_principal(principal):
            raise InvalidRequestError(f"no hosted server named {name!r} is available to you")
        return entry

    def catalog_problem_for(self, principal: str) -> str | None:
        return self.catalog_file.problem_for(principal)

    def state(self, name: str) -> ServerState:
        return self._states.setdefault(name, ServerState())

    def known_tools(self, owner: Owner, entry: Entry) -> list[Any] | None:
        """The last tool list the owner's instance of `entry` gave on this replica (None: it
        has not listed here): another owner's instance's list is never this one's."""
        return self.learned.tools((owner, entry.name), entry)

    # -- requests (run on the instance owner's home replica) ---------------------------------

    async def request(
        self,
        owner: Owner,
        name: str,
        method: str,
        params: dict[str, Any],
        progress: Progress | None,
    ) -> dict[str, Any]:
        """Send one request to the owner's instance (started if needed): {"result": ...} or
        {"error": {code, message}}. Notifications for the caller (progress, logging) go to
        `progress` as (n, JSON text)."""
        entry = self.catalog().get(name)
        if entry is None:
            return _error(-32601, f"hosted server {name!r} was removed from the catalog")
        tool = str(params.get("name", "?")) if method == "tools/call" else method
        if method == "tools/call" and not entry.allows_tool(tool):
            return _error(-32602, f"tool {tool!r} is not available on server {name!r}")
        label = "other"  # (until the server shows it has the tool: a caller names any)
        started = time.perf_counter()
        outcome = "ok"
        sent = 0

        async def listener(message: dict[str, Any]) -> None:
            nonlocal sent
            if progress is not None:
                sent += 1
                await progress(sent, json.dumps(message, separators=(",", ":")))

        try:
            instance = await self._instance(entry, owner)
            result = await instance.request(
                method,
                params,
                listener=listener if progress is not None else None,
                within=entry.call_timeout,
            )
            label = self._label(name, tool)
            if method == "tools/list":
                result = entry.filter_tools(result)
                if not params.get("cursor"):  # (discovery: search, stubs)
                    tools = result.get("tools")
                    kept = tools if isinstance(tools, list) else []
                    self.learned.keep_tools((owner, name), entry, kept)
            elif method == "tools/call" and result.get("isError"):
                outcome = "error"
            return {"result": result}
        except RemoteError as exc:
            outcome = "error"
            return {"error": exc.error}
        except (InstanceError, LimitExceededError, CatalogError, PolicyViolationError) as exc:
            outcome = "failed" if isinstance(exc, InstanceError) else "refused"
            return _error(-32603, str(exc))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.server_calls.labels(name, label, outcome).inc()
            self.metrics.server_call_seconds.labels(name, label).observe(elapsed)
            who = owner.principal or "(shared)"
            logger.info(
                "hosted {} {} for {}: {} in {:.1f} ms", name, label, who, outcome, elapsed * 1000
            )

    def _label(self, name: str, tool: str) -> str:
        tools = self.state(name).tools
        if tool in tools or len(tools) < MAX_TOOL_LABELS:
            tools.add(tool[:64])
            return tool[:64]
        return "other"

    # -- instances ---------------------------------------------------------------------------

    async def _instance(self, entry: Entry, owner: Owner) -> Instance | RemoteInstance:
        key = (owner, entry.name)
        instance = self._instances.get(key)
        if instance is not None and instance.alive and self._entries.get(key) == entry:
            return instance
        async with self._locks.hold(key):
            instance = self._instances.get(key)
            if instance is not None and instance.alive and self._entries.get(key) == entry:
                return instance
            if instance is not None:  # dead, or its entry changed: replaced
                await self._stop(key, "replaced" if instance.alive else None)
            await self._backoff(key)
            return await self._start(entry, owner)

    async def _backoff(self, key: Key) -> None:
        """Wait before a start soon after this instance's crashes (1 s after the first,
        doubling to 30 s); past BACKOFF_WAIT, refuse the call instead of holding it. Its
        owner's alone: another principal's crashes never hold this one back (a shared
        instance's are everyone's)."""
        history = self.learned.peek(key)
        wait = self._backoff_left(key)
        if history is None or wait <= 0:
            return
        if wait <= BACKOFF_WAIT:
            await asyncio.sleep(wait)
            return
        raise InstanceError(
            f"server {key[1]} crashed {len(history.crashes)} times in the last "
            f"{CRASH_WINDOW:.0f} s ({history.last_error}); it may start again in {wait:.0f} s"
        )

    def _backoff_left(self, key: Key) -> float:
        history = self.learned.peek(key)
        return history.backoff(time.monotonic()) if history is not None else 0.0

    async def _start(self, entry: Entry, owner: Owner) -> Instance | RemoteInstance:
        if self._closed:
            raise InstanceError("the server is shutting down")
        key = (owner, entry.name)
        victim = self._reserve(key)
        try:
            if victim is not None:
                await self._close(victim, "stopped to make room")
            return await self._start_counted(entry, owner)
        finally:
            self._starting.discard(key)

    async def _start_counted(self, entry: Entry, owner: Owner) -> Instance | RemoteInstance:
        state = self.state(entry.name)
        key = (owner, entry.name)
        started = time.perf_counter()
        try:
            instance = await self._spawn(entry, owner)
            try:
                await instance.initialize()
                if self._closed:  # (it stopped every instance meanwhile: not this one)
                    raise InstanceError("the server is shutting down")
            except BaseException:
                # Off this (perhaps cancelled) call's path: the process must end regardless.
                self.supervisor.spawn(f"server {entry.name} stop", instance.aclose(grace=0.2))
                raise
        except (RemoteError, InstanceError, SandboxRuntimeError, OSError) as exc:
            # What the server said stays with this caller (a shared instance's words may be
            # about another principal); the status every principal sees says only what failed.
            if isinstance(exc, RemoteError):
                code = exc.error.get("code")
                reason = f"its initialize failed (JSON-RPC error {code})"
                told = f"{reason}: {str(exc)[:300]}" if entry.scope != "shared" else reason
            else:
                reason = told = str(exc)
            self.learned.history(key).crashes.append(time.monotonic())  # (backs off too)
            self._failed(key, f"could not start: {reason}")
            self.metrics.server_starts.labels(entry.name, "failed").inc()
            if isinstance(exc, InstanceError | RemoteError):
                raise InstanceError(f"server {entry.name} could not start: {told}") from None
            raise
        state.starts += 1
        self.metrics.server_starts.labels(entry.name, "ok").inc()
        self.metrics.server_start_seconds.labels(entry.name).observe(time.perf_counter() - started)
        self._instances[(owner, entry.name)] = instance
        self._entries[(owner, entry.name)] = entry
        self.metrics.server_instances.labels(entry.name).inc()
        self.supervisor.spawn(
            f"server {entry.name} watch", self._watch((owner, entry.name), instance)
        )
        who, took = owner.principal or "(shared)", (time.perf_counter() - started) * 1000
        instance.log.note(f"started for {who}")
        logger.info("hosted server {} started for {} in {:.0f} ms", entry.name, who, took)
        return instance

    async def _spawn(self, entry: Entry, owner: Owner) -> Instance | RemoteInstance:
        if entry.kind == "remote":
            try:
                return RemoteInstance(
                    entry, LogSink.of_server(self.servers_dir, entry.name), self.supervisor
                )
            except CatalogError as exc:
                raise CatalogError(f"server {entry.name}: {exc}") from None
        argv, server_dir = program(entry, self.servers_dir)
        limits = instance_limits(entry, self.manager.limits)
        env = environment(entry, stored_secrets(self.manager.egress, owner.principal, entry))
        workspace, _ = await self.manager.workspaces.ensure(
            workspace_name(owner), owner.principal or None
        )
        image = await launch.entry_image(self.manager.images, entry)
        egress = self.manager.egress_of(limits, owner)
        spec = SandboxSpec(argv, workspace, limits, env, interactive=True, egress=egress,
                           server_dir=server_dir, image=image)  # fmt: skip
        process = await self.manager.backend.spawn(spec)
        return Instance(
            entry.name,
            process,
            max_message=entry.max_message_kb * 1024,
            call_timeout=entry.call_timeout,
            log=LogSink.of_server(self.servers_dir, entry.name),
            supervisor=self.supervisor,
            logs_to_callers=entry.scope != "shared",
        )

    async def _watch(self, key: Key, instance: Instance | RemoteInstance) -> None:
        """When an instance dies unasked: counted as a crash (the backoff), reported."""
        why = await instance.exited()
        if self._instances.get(key) is instance:
            del self._instances[key]
            self._entries.pop(key, None)
            self.metrics.server_instances.labels(instance.name).dec()
            if why != "stopped":
                self.learned.history(key).crashes.append(time.monotonic())
                self._failed(key, f"crashed: {why}")
                instance.log.note(f"crashed: {why}")
            await instance.aclose(grace=0.1)
            if (entry := self.catalog().get(key[1])) is not None:
                self.warm.fill([entry])  # (a warm one: again, once its backoff has passed)

    def _failed(self, key: Key, text: str) -> None:
        history = self.learned.history(key)
        # (Shown to the principals of this instance: never its output, which stays with the
        # caller it was for.)
        public = text.split("; its last output on stderr")[0][:300]
        history.last_error, history.last_error_at = public, time.time()
        logger.warning("hosted server {} of {}: {}", key[1], key[0].principal or "(shared)", text)

    def _reserve(self, key: Key) -> Instance | RemoteInstance | None:
        """Count the start of `key` against the caps from now, with the other starts in
        flight: at the replica's cap, or the principal's (a shared instance is no one's),
        the least recently used idle instance in that scope is taken out to make room (and
        returned, to be stopped), or the start is refused. No await between counting and
        reserving: concurrent starts see each other and never pick the same victim."""
        principal = key[0].principal
        running, starting = list(self._instances), len(self._starting)
        mine = [k for k in running if principal and k[0].principal == principal]
        mine_starting = sum(1 for k in self._starting if principal and k[0].principal == principal)
        if principal and len(mine) + mine_starting >= self.max_per_principal:
            scope, cap = mine, "SANDBOX_MAX_SERVER_INSTANCES_PER_PRINCIPAL"
            count = len(mine) + mine_starting
        elif len(running) + starting >= self.max_instances:
            scope, cap, count = running, "SANDBOX_MAX_SERVER_INSTANCES", len(running) + starting
        else:
            self._starting.add(key)
            return None
        idle = [(self._instances[k].last_used, k) for k in scope if self._instances[k].busy == 0]
        if not idle:
            raise LimitExceededError(
                f"{count} hosted server instances are running or starting, all busy ({cap}); "
                "retry shortly"
            )
        self._starting.add(key)
        return self._detach(min(idle)[1])

    def _detach(self, key: Key) -> Instance | RemoteInstance | None:
        """Take the instance out of those running (no longer anyone's to use or choose)."""
        instance = self._instances.pop(key, None)
        self._entries.pop(key, None)
        if instance is not None:
            self.metrics.server_instances.labels(instance.name).dec()
        return instance

    async def _stop(self, key: Key, why: str | None) -> None:
        instance = self._detach(key)
        if instance is not None:
            await self._close(instance, why)

    async def _close(self, instance: Instance | RemoteInstance, why: str | None) -> None:
        if why:
            instance.log.note(why)
        # A task of its own: a caller cancelled meanwhile must not leave the process running.
        await asyncio.shield(
            self.supervisor.spawn(f"server {instance.name} stop", instance.aclose())
        )

    async def stop_owner(self, owner: Owner, why: str) -> int:
        """Stop every instance that keeps `owner`'s state here (its session moved to another
        replica); how many."""
        keys = [key for key in self._instances if key[0] == owner]
        await asyncio.gather(*(self._stop(key, why) for key in keys), return_exceptions=True)
        return len(keys)

    # -- background: idle stop, warm starts ----------------------------------------------------

    def start(self) -> None:
        self.warm.fill(self.catalog().entries.values())  # (at once: not at the first sweep)
        self.supervisor.every("hosted servers", SWEEP_SECONDS, self.sweep)

    async def sweep(self) -> None:
        """Stop instances idle past their idle timeout (not warm ones), and those whose entry
        changed or went; start warm ones (servers/warm.py)."""
        catalog = self.catalog()
        now = time.monotonic()
        for key, instance in list(self._instances.items()):
            entry = catalog.get(instance.name)
            if entry is None or entry != self._entries.get(key):
                await self._stop(key, "its catalog entry changed")
            elif instance.busy == 0 and now - instance.last_used > entry.idle_timeout:
                if not (entry.warm and key[0].principal == SHARED):
                    await self._stop(key, f"idle for {entry.idle_timeout:g} s")
        self.warm.fill(catalog.entries.values())

    def _wants_warm(self, key: Key, entry: Entry) -> bool:
        """Not running, and room below the replica's cap (it never stops another for room)."""
        running = self._instances.get(key)
        if running is not None and running.alive and self._entries.get(key) == entry:
            return False
        return not self._closed and len(self._instances) + len(self._starting) < self.max_instances

    def workspaces_in_use(self) -> set[str]:
        return {workspace_name(owner) for owner, _ in self._instances}

    async def stop_idle_in(self, workspace: str) -> None:
        """Stop the idle instances in `workspace` (its filesystem failed: it is checked now)."""
        keys = [k for k in self._instances if workspace_name(k[0]) == workspace]
        idle = [self._stop(k, "its workspace failed") for k in keys if not self._instances[k].busy]
        await asyncio.gather(*idle, return_exceptions=True)

    def status(self, name: str, principal: str | None) -> dict[str, Any]:
        """One server's state on this replica as `principal` sees it: its own instances and
        the shared one (None: every instance, the operator's view). Never a running state
        for a dead child."""
        alive = [
            i
            for k, i in self._instances.items()
            if k[1] == name and i.alive and (principal is None or sees(principal, k))
        ]
        error, at = self.learned.last_error(name, principal)
        return {
            "instances": len(alive),
            "crashes_recent": self.learned.crashes_recent(name, principal),
            "last_error": error,
            "last_error_at": at,
        }

    async def aclose(self) -> None:
        self._closed = True
        await self.warm.aclose()
        await asyncio.gather(
            *(self._stop(key, "server stopping") for key in list(self._instances)),
            return_exceptions=True,
        )


def _error(code: int, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}
