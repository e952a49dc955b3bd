"""A hosted server's log file: its stderr and the host's notes about it, for the operator."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from loguru import logger

LOG_MAX_BYTES = 4 << 20  # a log file rotates past this (one previous kept)


class LogSink:
    """An instance's stderr and the host's notes about it, in the server's log file on disk
    (`<servers_dir>/logs/<name>.log`, rotated at LOG_MAX_BYTES), for the operator only."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    @classmethod
    def of_server(cls, servers_dir: Path, name: str) -> LogSink:
        logs = servers_dir / "logs"
        with contextlib.suppress(OSError):
            logs.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cls(logs / f"{name}.log")

    def write(self, data: bytes) -> None:
        if self.path is None:
            return
        try:
            if self.path.exists() and self.path.stat().st_size > LOG_MAX_BYTES:
                self.path.replace(self.path.with_suffix(".log.1"))
            with open(self.path, "ab") as f:
                f.write(data)
        except OSError as exc:  # (a full disk: the instance goes on)
            logger.debug("server log {} not written: {}", self.path, exc)

    def note(self, text: str) -> None:
        """A line of the host's own about this instance (start, stop, why it was ended)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.write(f"[srt {stamp}] {text}\n".encode())
