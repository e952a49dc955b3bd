"""What this replica learned from hosted servers' instances, kept per instance (its owner and
its server's name), never per server: the last tools/list (what search and code mode's stubs
read without starting an instance), the crashes that back its starts off, its last error.

A principal is shown only what its own instances and shared ones said: a tool list read from
one principal's workspace, or one principal's crashes, are nobody else's (one per server name
let a principal's instance write the tool descriptions another's agent read, and let one
principal's crashes refuse another's starts). Bounded: the least recently used go first.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.servers.catalog import Entry

SHARED = ""  # the principal of a shared instance's owner
CRASH_WINDOW = 300.0  # crashes this recent count toward the backoff
BACKOFF_MAX = 30.0
MAX_HISTORIES = 4096  # instances whose crashes and last error are kept
MAX_TOOL_LISTS = 512  # instances whose last tool list is kept
MAX_TOOL_LIST_BYTES = 16 << 20  # those lists' JSON, in all (several times that as objects)

Key = tuple[Owner, str]  # an instance: its state's owner and its server's name


def owner_of(entry: Entry, principal: str, session: str) -> Owner:
    """Whose instance a call of `principal` in `session` uses: the owner of its state (its
    workspace, and its home replica). Entries naming the same `state` share it."""
    state = f"srv:{entry.state or entry.name}"
    if entry.scope == "shared":
        return Owner(SHARED, state)
    if entry.scope == "session":
        return Owner(principal, f"{state}:{session}")
    return Owner(principal, state)


@dataclass
class History:
    """One instance's crashes (monotonic times, within CRASH_WINDOW) and last failure."""

    crashes: list[float] = field(default_factory=list)
    last_error: str | None = None
    last_error_at: float | None = None

    def recent(self, now: float) -> list[float]:
        self.crashes = [t for t in self.crashes if now - t < CRASH_WINDOW]
        return self.crashes

    def backoff(self, now: float) -> float:
        """Seconds before the next start may go (0: now): 1 s after the first recent crash,
        doubling to BACKOFF_MAX, counted from the last."""
        crashes = self.recent(now)
        if not crashes:
            return 0.0
        return max(0.0, min(BACKOFF_MAX, 2.0 ** (len(crashes) - 1)) - (now - crashes[-1]))


def sees(principal: str, key: Key) -> bool:
    """Whether `principal` is shown what the instance `key` said: its own, or a shared one."""
    return key[0].principal in (principal, SHARED)


class Learned:
    """Tool lists and crash histories by instance, bounded in count and bytes."""

    def __init__(self) -> None:
        self._histories: dict[Key, History] = {}
        self._tools: dict[Key, tuple[Entry, list[Any], int]] = {}
        self._tool_bytes = 0

    # -- crashes and errors --------------------------------------------------------------------

    def history(self, key: Key) -> History:
        """The instance's history (made on first use; the oldest untouched one goes past
        MAX_HISTORIES)."""
        found = self._histories.pop(key, None) or History()
        self._histories[key] = found  # (last: the most recently used)
        while len(self._histories) > MAX_HISTORIES:
            del self._histories[next(iter(self._histories))]
        return found

    def peek(self, key: Key) -> History | None:
        """The instance's history if it has one (made by a crash or a failure only, so
        starts that go well push out no one's)."""
        return self._histories.get(key)

    def histories(self, name: str, principal: str | None) -> list[History]:
        """The histories of `name`'s instances that `principal` sees (None: every one, for
        the operator)."""
        return [
            h
            for k, h in self._histories.items()
            if k[1] == name and (principal is None or sees(principal, k))
        ]

    def crashes_recent(self, name: str, principal: str | None) -> int:
        now = time.monotonic()
        return sum(len(h.recent(now)) for h in self.histories(name, principal))

    def last_error(self, name: str, principal: str | None) -> tuple[str | None, float | None]:
        """The latest error of `name`'s instances that `principal` sees, and when."""
        errors = [
            (h.last_error_at, h.last_error)
            for h in self.histories(name, principal)
            if h.last_error is not None and h.last_error_at is not None
        ]
        if not errors:
            return None, None
        at, text = max(errors)
        return text, at

    # -- tool lists ----------------------------------------------------------------------------

    def keep_tools(self, key: Key, entry: Entry, tools: list[Any]) -> None:
        """The instance's tool list (as filtered for `entry`), for search and stubs."""
        size = len(json.dumps(tools, separators=(",", ":"), default=str))
        self.forget_tools(key)
        if size > MAX_TOOL_LIST_BYTES // 4:  # (one list never pushes out all the others)
            return
        self._tools[key] = (entry, tools, size)
        self._tool_bytes += size
        while len(self._tools) > MAX_TOOL_LISTS or self._tool_bytes > MAX_TOOL_LIST_BYTES:
            self.forget_tools(next(iter(self._tools)))

    def forget_tools(self, key: Key) -> None:
        kept = self._tools.pop(key, None)
        if kept is not None:
            self._tool_bytes -= kept[2]

    def tools(self, key: Key, entry: Entry) -> list[Any] | None:
        """The instance's last tool list, if it was listed for this very entry."""
        kept = self._tools.get(key)
        if kept is None or kept[0] != entry:
            return None
        self._tools[key] = self._tools.pop(key)  # (the most recently used)
        return kept[1]
