"""What a caller asks an execution to be, and the checks of it that need no sandbox."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sandbox_runtime.config import Settings
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.sandbox import shell_argv, validate_command


@dataclass
class ExecuteRequest:
    command: str | list[str]
    timeout_seconds: float | None = None
    interactive: bool = False
    working_directory: str | None = None
    environment: dict[str, str] | None = None
    sandbox_config: dict[str, Any] | None = None
    # Code mode: the hosted servers its code may call ("*": every one the principal may use)
    servers: list[str] | None = None
    # The environment the session's sandboxes run on (execution/images.py); None: the
    # session's, or the default for its first sandbox.
    image: str | None = None


def command_argv(command: object) -> list[str]:
    """The argv a command runs as: a string through the shell, a list as it is.

    Raises InvalidRequestError."""
    if isinstance(command, str):
        if not command.strip():
            raise InvalidRequestError("command must not be empty")
        argv = shell_argv(command)
    elif isinstance(command, list):
        argv = command
    else:
        raise InvalidRequestError("command must be a string or a list of strings")
    validate_command(argv)
    return argv


def checked_timeout(requested: object, settings: Settings) -> float:
    """The timeout an execution runs under: the server's default, or the caller's within the
    server's maximum. Raises InvalidRequestError."""
    if requested is None:
        return settings.timeout
    if isinstance(requested, bool) or not isinstance(requested, int | float):
        raise InvalidRequestError("timeout_seconds must be a number")
    if not math.isfinite(requested) or requested <= 0:
        raise InvalidRequestError(f"timeout_seconds must be positive, got {requested}")
    if requested > settings.max_timeout:
        raise InvalidRequestError(
            f"timeout_seconds={requested:g} exceeds the server's maximum of "
            f"{settings.max_timeout:g} seconds"
        )
    return float(requested)
