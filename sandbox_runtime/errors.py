"""The domain's exceptions: one root, subclasses named for what the caller can do."""


class SandboxRuntimeError(Exception):
    """Root of every error this package raises on purpose."""


class SandboxUnavailableError(SandboxRuntimeError):
    """The host cannot run sandboxes (missing bwrap, no user namespaces, ...): fix the host."""


class SandboxSpawnError(SandboxRuntimeError):
    """One sandbox failed to start; others may still work."""


class PolicyViolationError(SandboxRuntimeError):
    """A request asked for more than the server's policy allows (or for something unknown)."""


class InvalidRequestError(SandboxRuntimeError):
    """A request was malformed: fix the arguments."""


class ExecutionNotFoundError(SandboxRuntimeError):
    """No execution with this id is visible to the caller."""


class ExecutionFinishedError(SandboxRuntimeError):
    """The execution has already finished; the operation no longer applies."""


class LimitExceededError(SandboxRuntimeError):
    """A concurrency limit is full: retry later or cancel something."""


class OwnerUnavailableError(SandboxRuntimeError):
    """The replica that owns the execution did not answer."""


class FileAccessError(SandboxRuntimeError):
    """A workspace path cannot be used as asked (missing, a directory, a link, exists)."""


class FileMissingError(FileAccessError):
    """No file or directory at a workspace path."""


class WorkspaceFullError(SandboxRuntimeError):
    """The workspace's byte or file quota is spent: delete something first."""


class DiskFullError(LimitExceededError):
    """The replica's state filesystem has no room for another workspace: retry later or on
    another replica."""


class WorkspaceDamagedError(SandboxRuntimeError):
    """The workspace's filesystem failed (an I/O error, a journal the kernel aborted): it is
    checked, and repaired or set aside, before its next use; retry."""


class ReplicaIdInUseError(SandboxRuntimeError):
    """Another live process holds this replica id (its heartbeat is another incarnation's):
    give every replica its own SANDBOX_REPLICA_ID."""
