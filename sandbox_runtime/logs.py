"""Logging with loguru: stderr and an optional rotating file, as text or one JSON object a line.

Context fields (replica_id, execution_id, session, request_id, tool) come from
`logger.contextualize`. uvicorn's and the MCP libraries' standard-library logging is routed
here too. Never log tokens or request bodies (which carry code) at INFO or above.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any, Protocol

from loguru import logger

TEXT_FORMAT = (
    "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | {extra[replica_id]} "
    "{extra[execution_id]} | {message}"
)
CONTEXT_FIELDS = ("replica_id", "execution_id", "session", "request_id", "tool")
ROUTED_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "fastmcp", "mcp", "sse_starlette")


def _json_line(record: Any) -> str:
    extra = record["extra"]
    obj: dict[str, Any] = {
        "time": record["time"].isoformat(),
        "level": record["level"].name,
        "message": record["message"],
        "logger": record["name"],
    }
    for field in CONTEXT_FIELDS:
        value = extra.get(field)
        if value not in (None, "-"):
            obj[field] = value
    if record["exception"] is not None:
        obj["exception"] = repr(record["exception"].value)
    record["extra"]["_json"] = json.dumps(obj, ensure_ascii=False, default=str)
    return "{extra[_json]}\n"


# A file URL's token grants a download or an upload until it expires: never in a log line.
FILE_TOKEN = re.compile(r"/files/[^/?\s]+")


# A query string may carry a credential whatever its name (`?token=`, `?api_key=`, a client's
# own scheme): its values never reach a log line, only its names.
QUERY_VALUE = re.compile(r"([?&][^=&#\s]*)=[^&#\s]*")


def redact(path: str) -> str:
    """An access log's request line or path with file URL tokens and query values hidden."""
    return QUERY_VALUE.sub(r"\1=<redacted>", FILE_TOKEN.sub("/files/<token>", path))


class _InterceptHandler(logging.Handler):
    """Standard-library records into loguru, at their level (access log paths redacted)."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "uvicorn.access" and isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(depth=6, exception=record.exc_info).log(level, record.getMessage())


class LogSettings(Protocol):
    """What logging needs of the settings (config.Settings has it; logs sits beside config,
    not above it)."""

    @property
    def replica_id(self) -> str: ...
    @property
    def log_format(self) -> str: ...
    @property
    def log_level(self) -> str: ...
    @property
    def log_file(self) -> Path | None: ...


def setup_logging(settings: LogSettings) -> None:
    """Replace loguru's default sink and route standard logging into it."""
    logger.remove()
    logger.configure(extra={"replica_id": settings.replica_id, "execution_id": "-"})
    fmt: Any = _json_line if settings.log_format == "json" else TEXT_FORMAT
    logger.add(sys.stderr, level=settings.log_level, format=fmt, backtrace=False, diagnose=False)
    if settings.log_file is not None:
        settings.log_file.parent.mkdir(parents=True, exist_ok=True)
        logger.add(
            settings.log_file,
            level=settings.log_level,
            format=fmt,
            rotation="10 MB",
            retention="7 days",
            enqueue=True,
            backtrace=False,
            diagnose=False,  # locals in tracebacks can hold tokens and code
        )
    handler = _InterceptHandler()
    for name in ROUTED_LOGGERS:
        std = logging.getLogger(name)
        std.handlers = [handler]
        std.propagate = False
        std.setLevel(settings.log_level if settings.log_level != "TRACE" else "DEBUG")
