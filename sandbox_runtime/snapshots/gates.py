"""Gates: while a session's workspace is being replaced (a restore), its calls wait, and a
snapshot taken across the replacement is not kept. Slots: how many captures and restores run
at once, shared fairly among principals."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from sandbox_runtime.errors import LimitExceededError


class Gates:
    def __init__(self) -> None:
        self._open: dict[str, asyncio.Event] = {}
        self._replaced: dict[str, int] = {}  # name -> how many times a gate opened

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """While held, `settled(name)` waits: the workspace is being replaced."""
        while (other := self._open.get(name)) is not None:
            await other.wait()
        event = self._open[name] = asyncio.Event()
        if len(self._replaced) > 10_000:
            self._replaced.clear()
        self._replaced[name] = self._replaced.get(name, 0) + 1
        try:
            yield
        finally:
            del self._open[name]
            event.set()

    async def settled(self, name: str) -> None:
        while (event := self._open.get(name)) is not None:
            await event.wait()

    def is_open(self, name: str) -> bool:
        return name in self._open

    def replaced(self, name: str) -> int:
        """How many times the workspace began to be replaced (a change means: since then)."""
        return self._replaced.get(name, 0)


class SlotsBusyError(LimitExceededError):
    """No snapshot slot came free within the caller's deadline."""


class FairSlots:
    """The replica's slots for captures and restores (each a thread reading or writing a
    whole workspace), shared fairly among principals: one principal holds at most
    `per_principal` of them (so another always finds one it can have), and a slot that comes
    free goes to the principals waiting in turn, not to whoever asks most often."""

    def __init__(self, total: int, per_principal: int) -> None:
        self.total = total
        self.per_principal = max(1, min(per_principal, total))
        self._held: dict[str, int] = {}
        # principal -> its waiters, in arrival order; the dict's order is the turn order
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}

    def held(self, principal: str) -> int:
        return self._held.get(principal, 0)

    @contextlib.asynccontextmanager
    async def hold(self, principal: str, deadline: float | None = None) -> AsyncIterator[None]:
        """A slot for `principal` while the block runs; SlotsBusyError if none came free by
        `deadline` (the event loop's clock)."""
        await self._acquire(principal, deadline)
        try:
            yield
        finally:
            self._release(principal)

    def _may_take(self, principal: str) -> bool:
        return sum(self._held.values()) < self.total and self.held(principal) < self.per_principal

    async def _acquire(self, principal: str, deadline: float | None) -> None:
        if principal not in self._waiting and self._may_take(principal):
            self._held[principal] = self.held(principal) + 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(principal, collections.deque()).append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release(principal)  # (granted as it gave up: hand it on)
            else:
                self._drop(principal, waiter)
            if isinstance(exc, TimeoutError):
                raise SlotsBusyError(
                    "this replica's snapshot slots stayed busy (other snapshots and restores "
                    "running); retry shortly"
                ) from None
            raise

    def _drop(self, principal: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(principal)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[principal]

    def _release(self, principal: str) -> None:
        self._held[principal] = self.held(principal) - 1
        if self._held[principal] <= 0:
            del self._held[principal]
        self._grant()

    def _grant(self) -> None:
        """Give free slots to waiting principals in turn (one each, then round again)."""
        progress = True
        while progress and sum(self._held.values()) < self.total:
            progress = False
            for principal in list(self._waiting):
                if not self._may_take(principal):
                    continue
                queue = self._waiting.pop(principal)
                waiter = queue.popleft()
                if queue:  # (to the back of the turn order)
                    self._waiting[principal] = queue
                if waiter.done():  # (cancelled, its task not yet run to take it out)
                    progress = True
                    continue
                self._held[principal] = self.held(principal) + 1
                waiter.set_result(None)
                progress = True
                if sum(self._held.values()) >= self.total:
                    break
