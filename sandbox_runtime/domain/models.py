"""What an execution is on the wire: its metadata and its output events."""

from __future__ import annotations

import json
import re
import uuid
from enum import StrEnum
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

# An execution id is exactly what new_execution_id makes: ids from callers are checked against
# it before any lookup, so that a key-shaped id ("ID:output", "ID*") never reaches the store.
EXECUTION_ID = re.compile(r"[0-9a-f]{32}")


def new_execution_id() -> str:
    """A fresh, unguessable execution id (uuid4, 32 lowercase hex digits)."""
    return uuid.uuid4().hex


def is_execution_id(value: object) -> bool:
    """Whether `value` has the form of an execution id (it may still be unknown)."""
    return isinstance(value, str) and EXECUTION_ID.fullmatch(value) is not None


def shown_id(value: object) -> str:
    """A caller's execution id as error messages show it: quoted, and short."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:64]}… ({len(text)} characters)"


class ExecutionStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"  # the command exited on its own (any exit code)
    FAILED = "failed"  # the sandbox could not start, or a resource limit killed it
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    LOST = "lost"  # the owning replica died while it ran

    @property
    def finished(self) -> bool:
        return self not in (ExecutionStatus.PENDING, ExecutionStatus.RUNNING)


class EventType(StrEnum):
    READY = "ready"
    STDOUT = "stdout"
    STDERR = "stderr"
    EXIT = "exit"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    ERROR = "error"
    RESOURCE_LIMIT = "resource_limit"
    TRUNCATED = "truncated"
    # Interpreter calls (run_code): a rich output (a MIME bundle), an exception the code
    # raised (`name`, `value`, `traceback`), and a prompt waiting for send_stdin.
    RESULT = "result"
    EXCEPTION = "exception"
    INPUT_REQUEST = "input_request"
    # The egress proxy refused a request of the sandbox's (`host`, `port`, `reason`).
    NETWORK_DENIED = "network_denied"
    # The egress proxy set a secret rule's headers on a request (`name` the rule, `host`,
    # `port`); never the value.
    NETWORK_SECRET = "network_secret"  # noqa: S105 (an event's name, not a password)
    # Code mode: the code called a hosted server's tool (`name` server.tool, `reason` ok,
    # error, refused or failed, `duration_ms`, `message` what was sent and received).
    TOOL_CALL = "tool_call"


class OutputEvent(BaseModel):
    """One event of an execution's output. `seq` strictly increases; it is the cursor."""

    model_config = ConfigDict(extra="forbid")

    seq: int
    event_id: str = ""
    type: EventType
    # Seconds since the epoch. (Earlier versions stored it as `timestamp`: still read.)
    ts: float = Field(validation_alias=AliasChoices("ts", "timestamp"))
    data: str | None = None
    code: int | None = None
    signal: str | None = None
    duration_ms: int | None = None
    reason: str | None = None
    message: str | None = None
    dropped_bytes: int | None = None
    bundle: dict[str, Any] | None = None
    execution_count: int | None = None
    name: str | None = None
    value: str | None = None
    traceback: list[str] | None = None
    prompt: str | None = None
    password: bool | None = None
    host: str | None = None
    port: int | None = None

    def model_post_init(self, context: Any, /) -> None:
        if not self.event_id:
            self.event_id = str(self.seq)

    def wire(self) -> dict[str, Any]:
        """As stored (in Redis) and sent between replicas: every field."""
        return self.model_dump(mode="json", exclude_none=True)

    def public(self) -> dict[str, Any]:
        """As clients see it (srt-mcp-server 0.2's events): `event_id` is the cursor, no `seq`."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"seq"})

    def wire_size(self) -> int:
        """Bytes of this event as JSON, escapes included (what a page of output budgets): as
        the 2026 era's replies send it, every character past ASCII escaped (an emoji is 12
        bytes, `\ud83d\ude00`; the legacy era sends it as its 4 UTF-8 bytes)."""
        return len(json.dumps(self.model_dump(mode="json", exclude_none=True)))


class ExecutionInfo(BaseModel):
    """An execution's metadata, as tools return it and as Redis stores it."""

    execution_id: str
    status: ExecutionStatus
    principal: str
    session_id: str
    replica_id: str
    # The process of `replica_id` that runs it (a replica restarted under the same id is a
    # new incarnation: the old one's executions are lost). None: written before there were any.
    incarnation: str | None = None
    command: str | list[str]
    language: str | None = None  # set for run_code: the code is in `command`
    interactive: bool = False
    working_directory: str = "/workspace"
    timeout_seconds: float
    limits: dict[str, Any] = Field(default_factory=dict)
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None
    error: str | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    duration_ms: int | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    dropped_bytes: int = 0
    last_seq: int = 0
    stdin_open: bool = False
    execution_count: int | None = None  # run_code: the interpreter's count for this call
