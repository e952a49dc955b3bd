"""The mount caps: how many workspace images a replica, and a principal on it, may have mounted,
and making room under them.

Each mount holds a loop device and a journal thread in the kernel, so mounts are capped per
replica and per principal. A mount counts from the moment it is decided (its principal is
recorded; None: a warm interpreter's slot, which counts against the replica's cap only). A
mount past a cap first unmounts the least recently used idle workspace in that cap's scope
(one without a sandbox waiting in it first; its image stays: its files come back on its next
use), and is refused (LimitExceededError) when every one is in use. A warm slot never
unmounts a session's workspace.

The arithmetic is pure (the functions below, tested in-process); `MountCaps` applies it to a
store's state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from loguru import logger

from sandbox_runtime.errors import LimitExceededError
from sandbox_runtime.workspaces.budget import Budgets
from sandbox_runtime.workspaces.store_state import BLANK_PREFIX

REPLICA_CAP = "mounted_workspaces"  # what a refusal is counted as (metrics' label)
PRINCIPAL_CAP = "principal_mounted_workspaces"


def count_mounted(principals: Mapping[str, str | None], principal: str | None = None) -> int:
    """Mounted images (and those being mounted), given name -> principal: all, or
    `principal`'s."""
    if principal is None:
        return len(principals)
    return sum(1 for p in principals.values() if p == principal)


def by_kind(principals: Mapping[str, str | None]) -> dict[str, int]:
    """Mounted images of sessions, of warm interpreters' slots, and blanks made ahead for
    new sessions (the last two: principal None)."""
    blanks = sum(1 for n, p in principals.items() if p is None and n.startswith(BLANK_PREFIX))
    slots = sum(1 for p in principals.values() if p is None) - blanks
    return {"session": len(principals) - slots - blanks, "slot": slots, "blank": blanks}


def over_caps(
    principals: Mapping[str, str | None],
    principal: str | None,
    *,
    host: bool,
    max_mounted: int,
    max_per_principal: int,
) -> tuple[bool, bool]:
    """Whether one more mount of `principal` would pass the replica's cap (only looked at
    with `host`) and `principal`'s own (never for a warm slot, None)."""
    over_host = host and len(principals) >= max_mounted
    over_mine = principal is not None and count_mounted(principals, principal) >= max_per_principal
    return over_host, over_mine


def pick_victim(
    candidates: Iterable[str], standby: set[str], last_used: Mapping[str, float]
) -> str | None:
    """The workspace to unmount first among idle `candidates`: one without a sandbox waiting
    in it before one with, then the least recently used. None: no candidate."""
    names = list(candidates)
    if not names:
        return None
    return min(names, key=lambda n: (n in standby, last_used.get(n, 0.0)))


def refusal(mine: bool, max_mounted: int, max_per_principal: int) -> LimitExceededError:
    """The error of a mount refused by the principal's cap (`mine`) or the replica's."""
    if mine:
        return LimitExceededError(
            f"this token has its maximum of {max_per_principal} session "
            "workspaces mounted on this replica (SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL)"
            " and every one is in use (running code, an interpreter, a file operation): "
            "wait for one to finish, restart_interpreter or stop work in a session you no "
            "longer need, or reuse a session; idle workspaces are unmounted to make room"
        )
    return LimitExceededError(
        f"this replica has its maximum of {max_mounted} workspaces mounted "
        "(SANDBOX_MAX_MOUNTED_WORKSPACES) and every one is in use: retry later (idle "
        "workspaces are unmounted to make room) or on another replica"
    )


class MountCaps(Budgets):
    """A store's mount counts, and making room under its caps (by unmounting idle ones)."""

    def mounted_count(self, principal: str | None = None) -> int:
        """Mounted images (and those being mounted): all, or `principal`'s."""
        return count_mounted(dict(self._principals), principal)

    def mounted_by_kind(self) -> dict[str, int]:
        """Mounted images of sessions and of warm interpreters' slots (the metrics' view)."""
        return by_kind(dict(self._principals))

    async def _make_room(self, principal: str | None, *, host: bool, count: bool = True) -> None:
        """Unmount least recently used idle workspaces until one more mount of `principal`
        fits under the caps (the replica's too if `host`). A warm slot (principal None) never
        unmounts a session's workspace. The caller holds the lock of the name it mounts.

        Raises LimitExceededError.
        """
        tried: set[str] = set()
        while True:
            over_host, over_mine = over_caps(
                dict(self._principals),
                principal,
                host=host,
                max_mounted=self.max_mounted,
                max_per_principal=self.max_mounted_per_principal,
            )
            if not over_host and not over_mine:
                return
            if over_host and principal is not None and await self._drop_a_blank():
                continue  # (blanks go first: they hold nothing)
            victim = None
            if principal is not None:
                victim = self._least_recently_used(principal if over_mine else None, tried)
            if victim is None:
                self._refuse(over_mine, count)
            assert victim is not None
            tried.add(victim)
            if await self._unmount(victim):
                logger.info("unmounted the idle workspace {} to mount another", victim)

    async def _drop_a_blank(self) -> bool:
        """Remove one blank workspace that is not being taken (store.py); whether one was."""
        for name in list(self._blanks):
            if not (name in self._locks and self._locks[name].locked()):
                self._blanks.remove(name)
                await self.remove(name)
                return True
        return False

    def _least_recently_used(self, principal: str | None, skip: set[str]) -> str | None:
        """The mounted workspace (of `principal`, or anyone's) to unmount first: not in use,
        not locked; one without a sandbox waiting in it before one with, then the oldest."""
        busy = self._in_use()
        candidates = [
            name
            for name in list(self._mounted)  # (a copy: see StoreState)
            if name not in busy
            and name not in skip
            and name in self._ready
            and not (name in self._locks and self._locks[name].locked())
            and (principal is None or self._principals.get(name) == principal)
        ]
        return pick_victim(candidates, self._standing_by(), self._ready)

    def _refuse(self, mine: bool, count: bool) -> None:
        for hook in self.on_refused if count else ():
            hook(PRINCIPAL_CAP if mine else REPLICA_CAP)
        raise refusal(mine, self.max_mounted, self.max_mounted_per_principal)
