"""The domain errors replicas answer each other with, by name (forwarded calls and control).

A replica that refuses a request answers with the error's class name and message; the caller
raises the same error again (an unknown name: the root error), so a refusal reads the same
wherever the execution or session lives.
"""

from __future__ import annotations

from typing import Any

from sandbox_runtime.errors import (
    DiskFullError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    FileAccessError,
    FileMissingError,
    InvalidRequestError,
    LimitExceededError,
    OwnerUnavailableError,
    PolicyViolationError,
    SandboxRuntimeError,
    SandboxSpawnError,
    SandboxUnavailableError,
    WorkspaceDamagedError,
    WorkspaceFullError,
)

# Errors a replica may answer with, by name.
ERRORS: dict[str, type[SandboxRuntimeError]] = {
    cls.__name__: cls
    for cls in (
        DiskFullError,
        ExecutionFinishedError,
        ExecutionNotFoundError,
        FileAccessError,
        FileMissingError,
        InvalidRequestError,
        LimitExceededError,
        OwnerUnavailableError,
        PolicyViolationError,
        SandboxRuntimeError,
        SandboxSpawnError,
        SandboxUnavailableError,
        WorkspaceDamagedError,
        WorkspaceFullError,
    )
}


def error_reply(exc: SandboxRuntimeError) -> dict[str, Any]:
    """The answer that carries `exc` to the replica that asked."""
    return {"error": type(exc).__name__, "message": str(exc)}


def raise_error_reply(reply: dict[str, Any]) -> None:
    """Raise the domain error a replica answered with (unknown names: the root error)."""
    error = ERRORS.get(str(reply.get("error")), SandboxRuntimeError)
    raise error(str(reply.get("message", "the owning replica refused the request")))
