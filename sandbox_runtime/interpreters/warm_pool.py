"""Interpreters started ahead of need: per language (or language on an environment: `r@r`),
each kernel in a slot workspace of its own.

A new session's first call takes one instead of starting a kernel: its slot workspace becomes
the session's (only for a session whose workspace is empty and that nothing uses), and the pool
is refilled in the background. Pooled kernels run under the server's limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.execution.manager import ExecutionManager
from sandbox_runtime.interpreters.env_kernels import pool_key
from sandbox_runtime.interpreters.interpreter import Key
from sandbox_runtime.interpreters.kernel import SandboxedKernel
from sandbox_runtime.interpreters.runtime import KernelSpec
from sandbox_runtime.sandbox import SandboxLimits

SLOT_PREFIX = "slot-"  # workspaces of pooled interpreters, before a session takes one

NewKernel = Callable[[KernelSpec, Path, SandboxLimits], SandboxedKernel]


class WarmPool:
    """The pooled kernels of one replica, and their refills."""

    def __init__(
        self,
        settings: Settings,
        manager: ExecutionManager,
        spec: Callable[[str], KernelSpec],
        new_kernel: NewKernel,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.metrics = manager.metrics
        self._spec = spec
        self._new_kernel = new_kernel
        self._kernels: dict[str, list[tuple[SandboxedKernel, Path]]] = {}
        self._refills: dict[asyncio.Task[None], str] = {}  # (with their language)
        # Starts handing a warm kernel their workspace, with the kernel's slot (out of the
        # pool meanwhile, still the kernel's: in use).
        self.adopting: dict[Key, str] = {}
        self._closed = False

    def workspaces(self) -> set[str]:
        """The slot workspaces pooled kernels (or ones being handed over) run in."""
        names = {slot.name for pool in self._kernels.values() for _, slot in pool}
        return names | set(self.adopting.values())

    def counts(self) -> dict[str, int]:
        """language -> kernels pooled now."""
        return {language: len(pool) for language, pool in self._kernels.items()}

    def close(self) -> tuple[list[asyncio.Task[None]], list[SandboxedKernel]]:
        """No more refills: the refills under way (cancelled now) and the pooled kernels
        (no longer pooled), for the caller to wait for and stop."""
        self._closed = True
        refills = list(self._refills)
        for task in refills:
            task.cancel()
        kernels = [k for pool in self._kernels.values() for k, _ in pool]
        self._kernels.clear()
        return refills, kernels

    def fill(self, language: str) -> None:
        """Start one more kernel of `language` in the background if the pool (with the refills
        under way) is short of the settings' count."""
        if self._closed:
            return
        wanted = self.settings.warm_interpreters().get(language, 0)
        pool = self._kernels.get(language, [])
        pending = sum(1 for name in self._refills.values() if name == language)
        if len(pool) + pending >= wanted:
            return
        task = self.manager.supervisor.spawn(f"warm {language} interpreter", self._warm(language))
        self._refills[task] = language
        task.add_done_callback(lambda done: self._refills.pop(done, None))

    async def _warm(self, language: str) -> None:
        started = time.monotonic()
        try:  # (`language`: LANGUAGE, or LANGUAGE@ENVIRONMENT: env_kernels.pool_key)
            spec = self._spec(language)
        except SandboxRuntimeError as exc:
            logger.warning("no warm {} interpreter: {}", language, exc)
            return
        try:
            slot, _ = await self.manager.workspaces.ensure(
                f"{SLOT_PREFIX}{secrets.token_hex(8)}", ahead=True
            )  # (at the replica's mount cap: no warm one, and no refusal counted)
        except SandboxRuntimeError as exc:
            logger.warning("no workspace for a warm {} interpreter: {}", language, exc)
            return
        kernel = self._new_kernel(spec, slot, self.manager.limits)
        try:
            await kernel.start()
        except Exception as exc:  # the pool stays short; calls start kernels themselves
            logger.warning("could not start a warm {} interpreter: {}", language, exc)
            with contextlib.suppress(OSError, SandboxRuntimeError):
                await self.manager.workspaces.remove(slot.name)
            return
        if self._closed:
            await kernel.stop()
            return
        self._kernels.setdefault(language, []).append((kernel, slot))
        self.metrics.warm_refill.observe(time.monotonic() - started)

    async def take(self, spec: KernelSpec, owner: Owner) -> SandboxedKernel | None:
        """A pooled kernel, made this owner's by turning its slot workspace into the owner's:
        only for a session whose workspace is empty (a new session) and that nothing uses
        (no execution, other interpreter, file operation or sandbox waiting in it)."""
        pooled = pool_key(spec)
        pool = self._kernels.get(pooled)
        workspaces = self.manager.workspaces
        name = workspace_name(owner)
        key = (owner, spec.language)
        while pool:
            kernel, slot = pool.pop()
            self.fill(pooled)
            # (dead, or its proxy socket died, or on an environment rebuilt since)
            if not kernel.alive or kernel.egress_lost or kernel.spec.image != spec.image:
                self.manager.supervisor.spawn(f"stop a warm {spec.language} kernel", kernel.stop())
                continue
            self.adopting[key] = slot.name
            try:
                adopted = await workspaces.adopt(slot.name, name, owner.principal)
            except (OSError, SandboxRuntimeError) as exc:
                logger.warning("could not hand a warm interpreter its workspace: {}", exc)
                adopted = False
            finally:
                self.adopting.pop(key, None)
            if not adopted:
                pool.append((kernel, slot))
                return None
            kernel.workspace = workspaces.path(name)
            return kernel
        return None
