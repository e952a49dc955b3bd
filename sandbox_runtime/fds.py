"""This process's file descriptors: how many are open, how many may be, and when that is too
near the limit (RLIMIT_NOFILE) to take on more work."""

from __future__ import annotations

import errno
import os
import resource
from dataclasses import dataclass

# Descriptors kept free for what must keep working when sandboxes cannot start (accepting a
# connection, answering /health, Redis, logs): at least this many, or this share of the limit.
MIN_RESERVE = 16
RESERVE_SHARE = 8  # 1/8 of the limit
EXHAUSTION_ERRNOS = (errno.EMFILE, errno.ENFILE)


def limit() -> int:
    """The soft RLIMIT_NOFILE: the lowest descriptor number this process cannot have."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_count() -> int:
    """Descriptors open now (0 if /proc cannot tell: no descriptor to read it with, say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (listing it opens one)
    except OSError:
        return 0


def reserve(fd_limit: int) -> int:
    return max(MIN_RESERVE, fd_limit // RESERVE_SHARE)


@dataclass(frozen=True)
class FdUsage:
    open: int
    limit: int

    @property
    def problem(self) -> str | None:
        """Why new work should not be taken on now, or None."""
        free = self.limit - self.open
        if self.open and free < reserve(self.limit):
            return (
                f"file descriptors nearly exhausted: {self.open} of {self.limit} open "
                f"(fewer than {reserve(self.limit)} free)"
            )
        return None

    def as_dict(self) -> dict[str, object]:
        return {"open": self.open, "limit": self.limit, "problem": self.problem}


def usage() -> FdUsage:
    return FdUsage(open_count(), limit())


def is_exhaustion(exc: BaseException) -> bool:
    """Whether `exc` is this process (EMFILE) or the host (ENFILE) out of descriptors."""
    return isinstance(exc, OSError) and exc.errno in EXHAUSTION_ERRNOS


def exhaustion_message(exc: OSError) -> str:
    """What a caller refused for `exc` (see is_exhaustion) is told."""
    if exc.errno == errno.ENFILE:
        return "the host is out of file descriptors (ENFILE); retry later"
    now = usage()
    held = f"{now.open} of {now.limit} open" if now.open else f"all {now.limit} in use"
    return f"the server is out of file descriptors ({held}); retry when fewer calls are running"
