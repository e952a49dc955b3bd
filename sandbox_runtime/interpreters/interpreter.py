"""A running interpreter (one owner's kernel of one language, and its queue of calls), and
which one to stop when a token is at its limit of interpreters. Pure: no process here."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sandbox_runtime.domain.owner import Owner, session_name
from sandbox_runtime.errors import InvalidRequestError, LimitExceededError
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.interpreters.kernel import SandboxedKernel
from sandbox_runtime.sandbox import SandboxLimits

MAX_NAMED = 16  # interpreters a refusal names
# `LANGUAGE:INSTANCE` names one more interpreter of a language in a session (the E2B edge's
# code contexts); metrics count it under its language.
INSTANCE_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")

Key = tuple[Owner, str]


@dataclass
class Interpreter:
    """A running kernel of one (owner, language) and its queue."""

    owner: Owner
    language: str
    kernel: SandboxedKernel
    limits: SandboxLimits
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    calls: int = 0
    current: Execution | None = None  # the call running now

    @property
    def idle(self) -> bool:
        """Neither running a call nor with calls waiting."""
        return not self.busy and self.waiting == 0


def base_language(language: str) -> str:
    """The language of an interpreter's name (`python` of `python:ctx1`)."""
    return language.partition(":")[0]


def valid_instance(language: str) -> bool:
    """Whether a `LANGUAGE:INSTANCE` name's instance is well formed (a plain language is)."""
    _, colon, instance = language.partition(":")
    return not colon or INSTANCE_RE.fullmatch(instance) is not None


def choose_eviction(mine: Sequence[Interpreter], starting: int, limit: int) -> Interpreter | None:
    """Room for one more interpreter of a token that runs `mine` and starts `starting` others:
    None when there is room; else its least recently used idle interpreter, to stop (that
    session's next call says `state_reset: evicted`).

    Raises LimitExceededError when all are running code or starting."""
    if len(mine) + starting < limit:
        return None
    idle = [i for i in mine if i.idle]
    if idle and len(mine) + starting - 1 < limit:
        return min(idle, key=lambda i: i.last_used)
    held = ", ".join(sorted(f"{session_of(i.owner)} ({i.language})" for i in mine)[:MAX_NAMED])
    raise LimitExceededError(
        f"this token runs its maximum of {limit} interpreters and all are running code or "
        f"starting: {held}; wait for one to finish, cancel_execution one of their calls, or "
        "restart_interpreter / a named session's idle timeout frees a slot"
    )


def same_limits(interpreter: Interpreter, limits: SandboxLimits | None) -> None:
    """Raises InvalidRequestError when `limits` (a caller's) differ from the running
    interpreter's: a tighter sandbox_config is never silently ignored."""
    if limits is not None and limits != interpreter.limits:
        raise InvalidRequestError(
            f"this session's {interpreter.language} interpreter runs with other limits "
            "than this sandbox_config; restart_interpreter with it (the state is lost) or "
            "leave sandbox_config out"
        )


def session_of(owner: Owner) -> str:
    """A session as callers name it, for messages."""
    return f"session {session_name(owner.session_id)!r}"
