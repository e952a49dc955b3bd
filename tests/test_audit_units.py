"""The audit log's writer on real files: rotation by size, one writer per file, lines kept in
order across rotated files and read back in that order by `srt-mcp-server audit`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sandbox_runtime.audit.cli import main as audit_main
from sandbox_runtime.audit.cli import since_time
from sandbox_runtime.audit.log import AuditLog, AuditLogInUseError, rotated
from sandbox_runtime.audit.records import argument_sizes

pytestmark = pytest.mark.unit


def record(n: int, principal: str = "alice") -> dict[str, object]:
    return {
        "time": f"2026-01-01T00:00:{n % 60:02d}.000Z",
        "event": "tool_call",
        "principal": principal,
        "tool": "execute_code",
        "session": "default",
        "outcome": "ok" if n % 3 else "not_found",
        "n": n,
        "pad": "x" * 200,
    }


async def test_the_log_rotates_by_size_keeping_its_backups_in_order(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path), max_bytes=4096, backups=3, registry=CollectorRegistry())
    log.start()
    try:
        for n in range(200):
            log.write(record(n))
    finally:
        await log.aclose()
    files = rotated(path, 3)
    assert [f.name for f in files] == ["audit.log.3", "audit.log.2", "audit.log.1", "audit.log"]
    assert all(f.stat().st_size < 4096 + 65536 for f in files)
    numbers = [json.loads(line)["n"] for f in files for line in f.read_text().splitlines()]
    assert numbers == sorted(numbers) and numbers[-1] == 199  # the oldest were let go
    assert len(numbers) < 200

    out = io.StringIO()
    assert audit_main(["--file", str(path), "--json"], out) == 0
    assert [json.loads(line)["n"] for line in out.getvalue().splitlines()] == numbers
    out = io.StringIO()
    assert audit_main(["--file", str(path), "--json", "--outcome", "not_found"], out) == 0
    picked = [json.loads(line)["n"] for line in out.getvalue().splitlines()]
    assert picked == [n for n in numbers if n % 3 == 0]


async def test_a_second_writer_of_the_same_file_is_refused(tmp_path: Path) -> None:
    first = AuditLog(str(tmp_path / "a.log"), registry=CollectorRegistry())
    first.start()
    try:
        second = AuditLog(str(tmp_path / "a.log"), registry=CollectorRegistry())
        with pytest.raises(AuditLogInUseError, match="its own file"):
            second.start()
    finally:
        await first.aclose()
    again = AuditLog(str(tmp_path / "a.log"), registry=CollectorRegistry())
    again.start()  # (the first let go)
    await again.aclose()


async def test_an_unwritable_log_loses_lines_counted_and_says_so_when_it_can(
    tmp_path: Path,
) -> None:
    """A write that fails (here: the file removed and a directory in its place; a full disk
    fails the same way) costs its lines, counted; once writing works again the log says how
    many it lost. A file moved away is followed by a new one under its name."""
    directory = tmp_path / "logs"
    registry = CollectorRegistry()
    log = AuditLog(str(directory / "a.log"), registry=registry)
    log.start()
    try:
        log.write(record(1))
        await _until(lambda: (directory / "a.log").exists())
        (directory / "a.log").rename(directory / "moved.log")
        (directory / "a.log").mkdir()
        try:
            log.write(record(2))
            await _until(lambda: registry.get_sample_value("srt_audit_dropped_lines_total") == 1)
        finally:
            (directory / "a.log").rmdir()
        log.write(record(3))
    finally:
        await log.aclose()
    lines = [json.loads(line) for line in (directory / "a.log").read_text().splitlines()]
    assert [
        json.loads(line)["n"] for line in (directory / "moved.log").read_text().splitlines()
    ] == [1]
    assert [(line.get("event"), line.get("lines"), line.get("n")) for line in lines] == [
        ("dropped", 1, None),
        ("tool_call", None, 3),
    ]


def test_argument_sizes_are_bytes_and_bounded_in_number() -> None:
    sizes = argument_sizes({"code": "é" * 10, "n": 12345, "flag": True, "list": [1, 2]})
    assert sizes == {"code": 20, "n": 5, "flag": 4, "list": 6}
    many = argument_sizes({f"a{n}": "" for n in range(40)})
    assert len(many) == 33 and many["…"] == 8
    assert all(len(name) <= 64 for name in argument_sizes({"x" * 500: 1}))


def test_since_takes_spans_and_iso_times() -> None:
    from datetime import UTC, datetime

    now = datetime(2026, 1, 2, tzinfo=UTC)
    assert since_time("1h", now) == datetime(2026, 1, 1, 23, tzinfo=UTC)
    assert since_time("2d", now) == datetime(2025, 12, 31, tzinfo=UTC)
    assert since_time("2026-01-01T10:00:00Z") == datetime(2026, 1, 1, 10, tzinfo=UTC)
    assert since_time("2026-01-01T10:00:00") == datetime(2026, 1, 1, 10, tzinfo=UTC)
    with pytest.raises(ValueError):
        since_time("yesterday")


async def _until(predicate: object, within: float = 10.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)
