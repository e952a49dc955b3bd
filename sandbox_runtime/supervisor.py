"""One owner for the process's long-lived background work.

Every loop that runs for the life of a part (sweeping, reaping, evicting, renewing leases,
flushing the mirror, beating the heartbeat, watching the store's epoch) is started here under
a name, with one policy: a loop step that raises is logged once (with the name and the
traceback), then retried; its recovery is logged; a loop that ends by itself is an error and
is restarted. Nothing is left running: `stop(name)` ends one loop, `aclose()` ends every loop,
newest first, and waits for them. The composition root makes one for the process and hands it
to the parts; a part built alone (in a test) makes its own.

Short-lived work that outlives the call that started it (a lease released after an execution
ends, a sandbox discarded in the background, a kernel stopped) is `spawn`ed: named, kept
referenced until it ends, a failure logged once, cancelled by `aclose()`. Nothing else in the
program calls `create_task`; tasks a function starts and awaits or cancels before it returns
(racing a queue against a process's death) are scoped to that function (see `scoped`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from loguru import logger

T = TypeVar("T")
Step = Callable[[], Awaitable[Any] | Any]
RESTART_PAUSE = 1.0
RESTART_PAUSE_MAX = 30.0
STOP_GRACE = 2.0


class Supervisor:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._spawned: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def names(self) -> list[str]:
        """The loops running now, oldest first."""
        return [name for name, task in self._tasks.items() if not task.done()]

    def every(
        self, name: str, interval: float | Callable[[], float], step: Step, at_once: bool = False
    ) -> None:
        """Run `step` (sync or async) every `interval` seconds (a number, or a function asked
        before each pause) until stopped; `at_once`: a first step before the first pause."""

        async def loop() -> None:
            failing = False
            first = at_once
            while True:
                if not first:
                    await asyncio.sleep(interval() if callable(interval) else interval)
                first = False
                try:
                    result = step()
                    if inspect.isawaitable(result):
                        await result
                except asyncio.CancelledError:
                    raise
                except Exception:
                    if not failing:
                        logger.exception("background loop {} failed; it goes on", name)
                    failing = True
                    continue
                if failing:
                    logger.info("background loop {} works again", name)
                    failing = False

        self._start(name, loop)

    def run(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run `loop` (meant to run until cancelled) and restart it, after a pause that grows
        while it keeps failing, if it raises or returns."""

        async def keep() -> None:
            pause = RESTART_PAUSE
            while True:
                try:
                    await loop()
                    logger.error("background loop {} ended by itself; restarting it", name)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("background loop {} failed; restarting it", name)
                await asyncio.sleep(pause)
                pause = min(RESTART_PAUSE_MAX, pause * 2)

        self._start(name, keep)

    def _start(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if self._closed:
            raise RuntimeError(f"the supervisor is closed: {name} cannot start")
        running = self._tasks.get(name)
        if running is not None and not running.done():
            raise RuntimeError(f"background loop {name} is already running")
        self._tasks[name] = asyncio.get_running_loop().create_task(loop(), name=name)

    def once(self, name: str, job: Callable[[], Awaitable[None]]) -> None:
        """Run `job` to its end (it retries what it must itself); a failure is logged."""

        async def run_once() -> None:
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("background job {} failed", name)

        self._start(name, run_once)

    def spawn(self, name: str, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `work` to its end in the background: referenced until done, a failure logged
        once (with `name`), cancelled by `aclose()`. Returns the task (await it, or not)."""
        if self._closed:
            work.close()
            raise RuntimeError(f"the supervisor is closed: {name} cannot start")
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._spawned.add(task)
        task.add_done_callback(self._spawned_done)
        return task

    def _spawned_done(self, task: asyncio.Task[Any]) -> None:
        self._spawned.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.opt(exception=exc).error("background task {} failed", task.get_name())

    @property
    def closed(self) -> bool:
        """Whether it has closed (nothing starts any more)."""
        return self._closed

    @property
    def spawned(self) -> int:
        """Short-lived tasks not yet ended."""
        return len(self._spawned)

    async def stop(self, *names: str, grace: float = STOP_GRACE) -> None:
        """End these loops together and wait for them, at most `grace` seconds: a step stuck
        in a call that ignores cancellation (a Redis call in flight) must not hold a shutdown;
        one still running then is logged and left to the loop's own end. Names not running
        are skipped."""
        tasks = {name: task for name in names if (task := self._tasks.pop(name, None))}
        for task in tasks.values():
            task.cancel()
        if not tasks:
            return
        # (asyncio.wait: a cancellation of the caller itself is not swallowed.)
        await asyncio.wait(tasks.values(), timeout=grace)
        for name, task in tasks.items():
            if not task.done():
                logger.warning("background loop {} did not stop within {} s", name, grace)

    async def aclose(self) -> None:
        """End every spawned task and every loop still running (newest first) within one
        grace. Idempotent."""
        self._closed = True
        spawned = list(self._spawned)
        for task in spawned:
            task.cancel()
        if spawned:
            await asyncio.wait(spawned, timeout=STOP_GRACE)
        await self.stop(*reversed(list(self._tasks)))


def scoped(work: Awaitable[T]) -> asyncio.Future[T]:
    """A task scoped to the function that starts it: that function awaits it or cancels it
    before it returns (a race of a queue against a process's death, the two directions of a
    relay). The one place besides the Supervisor that starts tasks."""
    return asyncio.ensure_future(work)


async def outcome(work: Awaitable[T]) -> T | Exception:
    """`work`'s result, or the exception it raised: for spawned work that a caller awaits
    (its failure is handed to that caller, not logged as a background failure)."""
    try:
        return await work
    except Exception as exc:
        return exc
