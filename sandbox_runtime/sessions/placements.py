"""Where this replica last saw each session placed: for a Redis outage (it goes on serving the
sessions it holds while its heartbeat lives) and for publishing again the records of the
sessions it holds when Redis lost them. Bounded: the least recently placed are forgotten."""

from __future__ import annotations

import time
from collections import OrderedDict

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import OwnerUnavailableError

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

    def serve_without_store(
        self, key: str, replica_id: str, exc: Exception, last_contact: float | None, ttl: float
    ) -> None:
        """Whether this replica may serve session `key` while the store is down (raises
        OwnerUnavailableError if not): only a session it last saw homed here, while its last
        heartbeat lives; until then no other replica can take it (they wait for its heartbeat
        to expire, or for its records after the store restarted empty). Nothing else: a new
        home it cannot record could be another's too."""
        last = self.get(key)
        if last is not None and last[0] == replica_id:
            if last_contact is not None and time.monotonic() - last_contact < ttl:
                return
            raise OwnerUnavailableError(
                f"the shared store is unavailable ({type(exc).__name__}) for longer than a "
                f"heartbeat ({ttl} s): this replica can no longer be sure it is still this "
                "session's home; retry shortly"
            ) from exc
        raise OwnerUnavailableError(
            f"the shared store is unavailable ({type(exc).__name__}) and this replica is not "
            "known to be this session's home; retry shortly"
        ) from exc
