"""Where this replica last saw each session placed: for a Redis outage (it goes on serving the
sessions it holds while its heartbeat lives) and for publishing again the records of the
sessions it holds when Redis lost them. Bounded: the least recently placed are forgotten.
Beside it: the remote homes this replica's forwarded calls just reached (RecentHomes)."""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import OwnerUnavailableError
from sandbox_runtime.sessions.models import SessionReset

MAX_REMEMBERED = 100_000
RECENT_HOME_SECONDS = 1.0  # a remote home answered within this: the next call skips the store
MAX_RECENT_HOMES = 10_000


@dataclass(frozen=True)
class Placement:
    """Where an operation runs: here (with a reset if it just moved here), or at `address`
    (the cluster listener of the home's process `incarnation`)."""

    local: bool
    home: str
    address: str = ""
    reset: SessionReset | None = None
    incarnation: str = ""


class RecentHomes:
    """The remote homes that answered this replica's forwarded calls in the last second: a
    session's next call there skips the store's lookup (an api replica forwards every call).

    Stale is safe: the home checks that it is still the home (the store's record, on every
    forwarded call) and answers `not_home` if not, and a call that fails in any way forgets
    the entry, so the retry looks the session up again. An entry lives one second, well
    inside a heartbeat's TTL, counted from the lookup that found the home (not from the end of
    a long call) and not renewed by use: a home whose heartbeat expired is looked up again
    within it. Bounded in count; the oldest are dropped first."""

    def __init__(self, seconds: float = RECENT_HOME_SECONDS, limit: int = MAX_RECENT_HOMES):
        self.seconds = seconds
        self.limit = limit
        self._homes: OrderedDict[str, tuple[float, Placement]] = OrderedDict()

    def get(self, key: str) -> Placement | None:
        entry = self._homes.get(key)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._homes[key]
            return None
        return entry[1]

    def remember(self, key: str, placement: Placement, found_at: float) -> None:
        """`placement`, found by a lookup at `found_at` (time.monotonic())."""
        expires = found_at + self.seconds
        if placement.local or key in self._homes or expires <= time.monotonic():
            return  # (not renewed by use: see the class)
        self._homes[key] = (expires, placement)
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)

    def forget(self, key: str) -> None:
        self._homes.pop(key, None)

    @contextlib.contextmanager
    def trying(self, key: str, placement: Placement, found_at: float | None) -> Iterator[None]:
        """Around a call forwarded to `placement`: remembered if it succeeds (found by a lookup
        at `found_at`; None: it came from here), else forgotten."""
        try:
            yield
        except BaseException:
            self.forget(key)
            raise
        if found_at is not None:
            self.remember(key, placement, found_at)


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
