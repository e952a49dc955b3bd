"""Where the HTTP edge finds the process's running parts (app/services.py builds them)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from sandbox_runtime.errors import SandboxRuntimeError

if TYPE_CHECKING:
    from sandbox_runtime.app.services import Services


class Root:
    """Where the HTTP edge finds the running parts: set for the life of the ASGI app."""

    def __init__(self) -> None:
        self._services: Services | None = None

    @property
    def services(self) -> Services:
        if self._services is None:
            raise SandboxRuntimeError("the server is starting or stopping")
        return self._services

    @property
    def running(self) -> bool:
        return self._services is not None

    @contextlib.asynccontextmanager
    async def serving(self, services: Services) -> AsyncIterator[Services]:
        self._services = services
        try:
            yield services
        finally:
            self._services = None
