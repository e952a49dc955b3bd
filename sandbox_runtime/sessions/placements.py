"""Where this replica last saw each session placed: for a Redis outage (it goes on serving the
sessions it holds while its heartbeat lives) and for publishing again the records of the
sessions it holds when Redis lost them. Bounded: the least recently placed are forgotten."""

from __future__ import annotations

from collections import OrderedDict

from sandbox_runtime.domain.owner import Owner

MAX_REMEMBERED = 100_000


class Placements:
    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self.limit = limit
        self._homes: OrderedDict[str, tuple[str, Owner]] = OrderedDict()

    def remember(self, key: str, home: str, owner: Owner) -> None:
        self._homes[key] = (home, owner)
        self._homes.move_to_end(key)
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)

    def get(self, key: str) -> tuple[str, Owner] | None:
        return self._homes.get(key)

    def homed_at(self, replica_id: str) -> list[tuple[str, Owner]]:
        """(session key, owner) of every session last placed on `replica_id`."""
        return [(key, owner) for key, (home, owner) in self._homes.items() if home == replica_id]
