"""Prometheus metrics: every series this service exports, in one registry per process.

No label ever carries an execution id, a session or a principal: a scrape shows nothing of
any owner's work beyond counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from sandbox_runtime.domain.models import ExecutionInfo

DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)
SPAWN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30)


class Metrics:
    """The service's metrics. One instance per ExecutionManager (its own registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.started = Counter(
            "srt_executions_started_total", "Executions whose sandbox started.", registry=r
        )
        self.finished = Counter(
            "srt_executions_finished_total",
            "Executions that ended, by final status.",
            ["status"],
            registry=r,
        )
        self.running = Gauge("srt_executions_running", "Executions running now.", registry=r)
        self.duration = Histogram(
            "srt_execution_duration_seconds",
            "Wall-clock duration of finished executions.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.spawn = Histogram(
            "srt_sandbox_spawn_seconds",
            "Time to start a sandbox (cgroup, launcher, bwrap exec); for one started ahead of "
            "need, to hand it its command.",
            buckets=SPAWN_BUCKETS,
            registry=r,
        )
        self.pool_hits = Counter(
            "srt_sandbox_pool_hits_total",
            "Executions that ran in a sandbox started ahead of need.",
            registry=r,
        )
        self.pool_misses = Counter(
            "srt_sandbox_pool_misses_total",
            "Executions that started a sandbox of their own, by why (empty: none was waiting "
            "in their workspace; busy: it was not started for want of spare CPU or room; "
            "limits: tighter limits; unpoolable: egress; disabled; ended; failed).",
            ["reason"],
            registry=r,
        )
        self.pool_refill = Histogram(
            "srt_sandbox_pool_refill_seconds",
            "Time to start a sandbox ahead of need.",
            buckets=SPAWN_BUCKETS,
            registry=r,
        )
        self.pool_ready = Gauge(
            "srt_sandbox_pool_ready", "Sandboxes started ahead, waiting for a command.", registry=r
        )
        self.limit_kills = Counter(
            "srt_limit_kills_total",
            "Executions ended by a limit, by kind (memory, cpu, file_size, timeout).",
            ["kind"],
            registry=r,
        )
        self.tool_calls = Counter(
            "srt_tool_calls_total", "MCP tool calls, by tool.", ["tool"], registry=r
        )
        self.tool_errors = Counter(
            "srt_tool_errors_total",
            "MCP tool calls answered with an error, by tool and error kind.",
            ["tool", "error"],
            registry=r,
        )
        self.rejections = Counter(
            "srt_concurrency_rejections_total",
            "Calls refused because a limit was full, by scope (global, session, interpreters, "
            "principal_interpreters, mounted_workspaces, principal_mounted_workspaces, ...).",
            ["scope"],
            registry=r,
        )
        self.output_bytes = Counter(
            "srt_output_bytes_total", "Output bytes read from sandboxes.", ["stream"], registry=r
        )
        self.output_dropped = Counter(
            "srt_output_dropped_bytes_total",
            "Output bytes dropped past the per-execution cap.",
            registry=r,
        )
        self.mirror_lag = Histogram(
            "srt_redis_mirror_lag_seconds",
            "From an event produced to it being written to Redis.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.mirror_backlog = Gauge(
            "srt_redis_mirror_backlog", "Executions with changes not yet in Redis.", registry=r
        )
        self.redis_connected = Gauge(
            "srt_redis_connected", "1 when the last Redis operation succeeded.", registry=r
        )
        self.lost_detected = Counter(
            "srt_lost_executions_detected_total",
            "Executions of dead replicas this replica marked lost.",
            registry=r,
        )
        self.control = Counter(
            "srt_control_forwarded_total",
            "stdin/cancel requests forwarded to the owning replica, by op and result.",
            ["op", "result"],
            registry=r,
        )
        self.control_served = Counter(
            "srt_control_served_total",
            "Forwarded requests this replica answered as the owner, by op.",
            ["op"],
            registry=r,
        )

        self.control_refused = Counter(
            "srt_control_refused_total",
            "Control calls refused: unsigned, forged, stale, replayed or misaddressed.",
            registry=r,
        )
        self.sessions = Counter(
            "srt_sessions_homed_total",
            "Sessions given a home here, by cause (created; home_lost or home_stopped: "
            "re-homed from a replica that died or stopped).",
            ["cause"],
            registry=r,
        )
        self.forwarded = Counter(
            "srt_forwarded_calls_total",
            "Session-bound calls sent to the session's home replica, by op and result.",
            ["op", "result"],
            registry=r,
        )
        self.forward_seconds = Histogram(
            "srt_forwarded_call_seconds",
            "Duration of forwarded calls, as the receiving replica saw them.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.forwarded_serving = Gauge(
            "srt_forwarded_calls_serving",
            "Forwarded calls this replica is running now as the session's home.",
            registry=r,
        )
        self.server_calls = Counter(
            "srt_hosted_server_calls_total",
            "Requests to hosted MCP servers, by server, tool (tools/call) or method, and outcome "
            "(ok, error: the server's own error, failed: it died or timed out, refused).",
            ["server", "tool", "outcome"],
            registry=r,
        )
        self.server_call_seconds = Histogram(
            "srt_hosted_server_call_seconds",
            "Duration of requests to hosted MCP servers, by server and tool (or method).",
            ["server", "tool"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.server_instances = Gauge(
            "srt_hosted_server_instances",
            "Hosted MCP server instances running on this replica, by server.",
            ["server"],
            registry=r,
        )
        self.server_starts = Counter(
            "srt_hosted_server_starts_total",
            "Hosted MCP server instances started (cold starts), by server and outcome.",
            ["server", "outcome"],
            registry=r,
        )
        self.server_start_seconds = Histogram(
            "srt_hosted_server_start_seconds",
            "Time to start a hosted MCP server instance and initialize it.",
            ["server"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.forwarded_served = Counter(
            "srt_forwarded_calls_served_total",
            "Forwarded calls this replica ran as the session's home, by op.",
            ["op"],
            registry=r,
        )

        self.interpreters = Gauge(
            "srt_interpreters",
            "Interpreters on this replica, by language and state (busy, idle, warm).",
            ["language", "state"],
            registry=r,
        )
        self.interpreter_events = Counter(
            "srt_interpreter_events_total",
            "Interpreter lifecycle events by language: start, restart, crash, flood (stopped for "
            "flooding the server), reaped, warm_hit, warm_miss.",
            ["language", "event"],
            registry=r,
        )
        self.interpreter_dropped = Counter(
            "srt_interpreter_dropped_bytes_total",
            "Bytes of kernel messages the server dropped: unsolicited (answering no call: "
            "output of a cell that returned, made-up parents), over_bound (past a call's "
            "queue or message size bounds).",
            ["reason"],
            registry=r,
        )
        self.warm_refill = Histogram(
            "srt_interpreter_warm_refill_seconds",
            "Time to start one warm-pool interpreter.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.egress_denied = Counter(
            "srt_egress_denied_total",
            "Requests the egress proxy refused, by reason (not_allowed, denied, "
            "private_address, ...).",
            ["reason"],
            registry=r,
        )
        self.egress_connections = Counter(
            "srt_egress_connections_total",
            "Connections the egress proxy made to an origin.",
            registry=r,
        )
        self.egress_bytes = Counter(
            "srt_egress_bytes_total",
            "Bytes through the egress proxy (both ways), counted when a sandbox ends.",
            registry=r,
        )
        self.egress_secret_uses = Counter(
            "srt_egress_secret_uses_total",
            "Requests the egress proxy set a secret rule's headers on, by rule name (never "
            "the value).",
            ["rule"],
            registry=r,
        )
        self.workspaces_mounted = Gauge(
            "srt_workspaces_mounted",
            "Workspace images mounted on this replica, by kind (session; slot: a warm "
            "interpreter's; blank: made ahead for a new session), against "
            "SANDBOX_MAX_MOUNTED_WORKSPACES.",
            ["kind"],
            registry=r,
        )
        self.loop_devices = Gauge(
            "srt_workspace_loop_devices",
            "Loop devices backed by this replica's workspace images (more than the mounted "
            "ones: detached mounts a sandbox still holds).",
            registry=r,
        )
        self.damage = Counter(
            "srt_workspace_damage_total",
            "Workspaces whose filesystem failed (detected: an I/O error or a read-only mount "
            "was found), and how their check before the next mount ended (clean, repaired, "
            "quarantined: set aside for the operator, the session started afresh).",
            ["event"],
            registry=r,
        )
        self.workspaces_removed = Counter(
            "srt_workspaces_removed_total",
            "Idle workspaces removed, by reason: age (unused for SANDBOX_WORKSPACE_RETENTION_"
            "SECONDS), budget (over SANDBOX_IDLE_WORKSPACES_MB or its per-principal budget).",
            ["reason"],
            registry=r,
        )
        self.disk_free = Gauge(
            "srt_state_disk_free_bytes",
            "Free bytes on the state filesystem (SANDBOX_STATE_DIR) for new workspaces.",
            registry=r,
        )
        self.disk_low = Gauge(
            "srt_state_disk_low",
            "1 while the state filesystem is below SANDBOX_MIN_FREE_DISK_MB (not ready, no new "
            "workspaces).",
            registry=r,
        )
        self._interpreter_gauges: Callable[[], dict[tuple[str, str], float]] | None = None
        self._workspace_gauges: Callable[[], dict[str, int]] | None = None

    def bind_interpreters(self, values: Callable[[], dict[tuple[str, str], float]]) -> None:
        """Interpreter gauges read at scrape time."""
        self._interpreter_gauges = values

    def bind_workspaces(
        self, mounted: Callable[[], dict[str, int]], loop_devices: Callable[[], float]
    ) -> None:
        """Workspace gauges read at scrape time: mounted images by kind, loop devices."""
        self._workspace_gauges = mounted
        self.loop_devices.set_function(loop_devices)

    def bind_disk(self, free: Callable[[], float], low: Callable[[], float]) -> None:
        """State filesystem gauges read at scrape time."""
        self.disk_free.set_function(free)
        self.disk_low.set_function(low)

    def bind_running(self, running: Callable[[], float]) -> None:
        """Executions running now, read at scrape time."""
        self.running.set_function(running)

    def bind_store(self, backlog: Callable[[], float], connected: Callable[[], float]) -> None:
        """The Redis mirror's gauges, read at scrape time."""
        self.mirror_backlog.set_function(backlog)
        self.redis_connected.set_function(connected)

    def count_finished(self, info: ExecutionInfo) -> None:
        """An execution ended: its status, duration, limit kill and output."""
        self.finished.labels(info.status.value).inc()
        self.duration.observe((info.duration_ms or 0) / 1000)
        if info.reason in ("memory", "cpu", "file_size", "timeout"):
            self.limit_kills.labels(info.reason).inc()
        self.output_bytes.labels("stdout").inc(info.stdout_bytes)
        self.output_bytes.labels("stderr").inc(info.stderr_bytes)
        self.output_dropped.inc(info.dropped_bytes)

    def count_egress(self, op: str, message: dict[str, Any]) -> None:
        """An event of the egress proxy: a denial, a connection, a closed one's bytes."""
        if op == "denied":
            self.egress_denied.labels(str(message.get("reason"))).inc()
        elif op == "connected":
            self.egress_connections.inc()
        elif op == "closed":
            self.egress_bytes.inc(int(message.get("bytes") or 0))
        elif op == "secret":
            self.egress_secret_uses.labels(str(message.get("rule"))).inc()

    def render(self) -> tuple[bytes, str]:
        if self._interpreter_gauges is not None:
            self.interpreters.clear()
            for (language, state), value in self._interpreter_gauges().items():
                self.interpreters.labels(language, state).set(value)
        if self._workspace_gauges is not None:
            for kind, value in self._workspace_gauges().items():
                self.workspaces_mounted.labels(kind).set(value)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
