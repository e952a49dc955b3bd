"""How the operator runs this CLI, for the hints it prints: each must run as printed."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

NAME = "srt-mcp-server"


def cli_name() -> str:
    """`srt-mcp-server` when that is on PATH; else what ./scripts/srt says it is run as
    (SRT_CLI), else the path this process was started by (`.venv/bin/srt-mcp-server`)."""
    if os.environ.get("SRT_CLI"):
        return os.environ["SRT_CLI"]
    if shutil.which(NAME):
        return NAME
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is None or argv0.name != NAME or not argv0.exists():
        return NAME
    try:
        return "./" + str(argv0.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(argv0.resolve())
