"""Which finished executions to forget: past their retention, past the count cap, past the
byte budget. Pure arithmetic over what is held (the manager drops what this picks)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from sandbox_runtime.domain.models import ExecutionInfo, ExecutionStatus
from sandbox_runtime.domain.owner import Owner


class Held(Protocol):
    @property
    def execution_id(self) -> str: ...
    @property
    def status(self) -> ExecutionStatus: ...
    @property
    def info(self) -> ExecutionInfo: ...
    @property
    def owner(self) -> Owner: ...
    @property
    def retained_bytes(self) -> int: ...


def evicted(
    held: Iterable[Held], now: float, retention_seconds: float, max_retained: int, budget: int
) -> set[str]:
    """The ids to drop: finished past retention; then, oldest first, past `max_retained` and
    past `budget` bytes of output, in all and per principal (half the budget), always taking
    from the principal that holds the most, so no one can push out another's."""
    finished = [e for e in held if e.status.finished]
    doomed = {
        e.execution_id for e in finished if (e.info.finished_at or 0) + retention_seconds <= now
    }
    kept = [e for e in finished if e.execution_id not in doomed]
    by_principal: dict[str, list[Held]] = {}
    for e in sorted(kept, key=lambda e: e.info.finished_at or 0):
        by_principal.setdefault(e.owner.principal, []).append(e)
    for _ in range(len(kept) - max_retained):
        heaviest = max(by_principal.values(), key=len)
        doomed.add(heaviest.pop(0).execution_id)
    held_bytes = {p: sum(e.retained_bytes for e in es) for p, es in by_principal.items()}
    total = sum(held_bytes.values())
    while total > budget or max(held_bytes.values(), default=0) > budget // 2:
        principal = max(held_bytes, key=lambda p: held_bytes[p])
        oldest = by_principal[principal].pop(0)
        doomed.add(oldest.execution_id)
        held_bytes[principal] -= oldest.retained_bytes
        total -= oldest.retained_bytes
    return doomed
