"""`srt-mcp-server audit`: the audit log's lines, filtered, oldest first across its rotated
files (FILE.N … FILE.1, FILE)."""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

from sandbox_runtime.audit.log import STDOUT

SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="srt-mcp-server audit",
        description="Show the audit log (SANDBOX_AUDIT_LOG), oldest first, across its rotated "
        "files. Filters combine (all must match); notices of dropped lines are always shown.",
    )
    parser.add_argument("--file", help="the log file (default: SANDBOX_AUDIT_LOG)")
    parser.add_argument("--principal", help="only this principal")
    parser.add_argument("--tool", help="only this tool (a glob: 'file_url.*', 'execute_*')")
    parser.add_argument("--session", help="only this session")
    parser.add_argument(
        "--outcome", help="ok, error (any failure), or one kind (invalid_arguments, not_found…)"
    )
    parser.add_argument(
        "--since", help="a span back from now (30s, 15m, 1h, 2d, 1w) or an ISO time"
    )
    parser.add_argument("--json", action="store_true", help="the lines as they are (JSON)")
    return parser


def since_time(text: str, now: datetime | None = None) -> datetime:
    """`--since`: a span back from now, or an ISO 8601 time (UTC when it names no zone).
    ValueError when it is neither."""
    match = SPAN.fullmatch(text.strip())
    if match:
        back = timedelta(seconds=float(match[1]) * UNITS[match[2]])
        return (now or datetime.now(UTC)) - back
    when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def log_files(path: Path) -> list[Path]:
    """The log's files, oldest first: the rotated FILE.N … FILE.1, then FILE."""
    numbered = []
    for found in path.parent.glob(f"{glob_escape(path.name)}.*"):
        suffix = found.name[len(path.name) + 1 :]
        if suffix.isdigit():
            numbered.append((int(suffix), found))
    files = [p for _, p in sorted(numbered, reverse=True)]
    return files + ([path] if path.exists() else [])


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def records(files: list[Path], bad: list[int]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, record) of each line that is a JSON object; `bad` counts the others (a line cut
    off by a crash)."""
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    bad[0] += 1
                    continue
                if isinstance(record, dict):
                    yield line.rstrip("\n"), record


def matches(record: dict[str, Any], args: argparse.Namespace, since: datetime | None) -> bool:
    if since is not None:
        try:
            when = datetime.fromisoformat(str(record.get("time", "")).replace("Z", "+00:00"))
        except ValueError:
            return False
        if when < since:
            return False
    if record.get("event") == "dropped":  # (a gap: whoever's lines were lost)
        return True
    if args.principal is not None and record.get("principal") != args.principal:
        return False
    if args.session is not None and record.get("session") != args.session:
        return False
    if args.tool is not None and not fnmatch.fnmatchcase(str(record.get("tool")), args.tool):
        return False
    if args.outcome is not None:
        outcome = record.get("outcome")
        if args.outcome == "error":
            return outcome != "ok"
        return outcome == args.outcome
    return True


def shown(record: dict[str, Any]) -> str:
    """One line for people: time, who, what, where, how it went."""
    if record.get("event") == "dropped":
        return f"{record.get('time')}  ({record.get('lines')} audit lines dropped here)"
    parts = [
        str(record.get("time")),
        str(record.get("principal")),
        str(record.get("tool")),
        f"session={record.get('session')}",
        str(record.get("outcome")),
        f"{record.get('duration_ms')} ms",
        f"token={record.get('token_id')}",
    ]
    if record.get("server"):
        parts.insert(2, f"server={record['server']}")
    if record.get("execution_id"):
        parts.append(f"execution={record['execution_id']}")
    if record.get("client_id"):
        parts.append(f"client={record['client_id']}")
    return "  ".join(parts)


def main(argv: list[str], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    target = args.file
    if target is None:
        from sandbox_runtime.config import Settings

        target = Settings(**{}).audit_log  # (from the environment and .env)
    if not target or target == STDOUT:
        print(
            "no audit log file to read: pass --file PATH, or set SANDBOX_AUDIT_LOG to the "
            "server's file (a server logging to stdout (`-`) is read where its output goes)",
            file=sys.stderr,
        )
        return 2
    try:
        since = since_time(args.since) if args.since else None
    except ValueError:
        print(
            f"--since {args.since!r}: give a span (30s, 15m, 1h, 2d, 1w) or an ISO time "
            "(2026-01-31T09:00:00Z)",
            file=sys.stderr,
        )
        return 2
    files = log_files(Path(target))
    if not files:
        print(f"no audit log at {target} (nor rotated files beside it)", file=sys.stderr)
        return 1
    bad = [0]
    for line, record in records(files, bad):
        if matches(record, args, since):
            print(line if args.json else shown(record), file=out)
    if bad[0]:
        print(f"({bad[0]} lines were not JSON and were skipped)", file=sys.stderr)
    return 0
