"""Logging with loguru: stderr and an optional rotating file; execution ids as context."""

from __future__ import annotations

import sys

from loguru import logger

from sandbox_runtime.config import Settings

FORMAT = (
    "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | {extra[replica_id]} "
    "{extra[execution_id]} | {message}"
)


def setup_logging(settings: Settings) -> None:
    """Replace loguru's default sink. Never logs tokens or request bodies (callers ensure it)."""
    logger.remove()
    logger.configure(extra={"replica_id": settings.replica_id, "execution_id": "-"})
    logger.add(sys.stderr, level=settings.log_level, format=FORMAT, backtrace=False)
    if settings.log_file is not None:
        settings.log_file.parent.mkdir(parents=True, exist_ok=True)
        logger.add(
            settings.log_file,
            level=settings.log_level,
            format=FORMAT,
            rotation="10 MB",
            retention="7 days",
            enqueue=True,
            backtrace=False,
        )
