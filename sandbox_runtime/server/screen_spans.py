"""Where each event is in a screen's text, so that what a cut text shows is counted in the
output's own terms: the bytes of the log file it covers (the offset a read_file hint starts
at) and the last event it shows whole (the cursor a get_execution_output hint reads after).
The text holds more than the output (stderr and stdout marks, an event's header in the
detailed format, a line per other event): counting the text's own characters as output made
the hints skip what the text never showed.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

OUTPUT_TYPES = ("stdout", "stderr")
# An event and where it is in a text: its data's start and end (an output event's), or its
# line's (another's; empty when it has none).
Span = tuple[dict[str, Any], int, int]


def output_in(spans: list[Span], start: int, end: int) -> tuple[int, int]:
    """The bytes and lines of output the text shows between `start` and `end`."""
    size = lines = 0
    for event, first, last in spans:
        low, high = max(first, start), min(last, end)
        if event.get("type") not in OUTPUT_TYPES or high <= low:
            continue
        data = (event.get("data") or "")[low - first : high - first]
        size += len(data.encode("utf-8", "replace"))
        lines += data.count("\n")
    return size, lines


def cursor_within(spans: list[Span], end: int, after: str) -> str:
    """The id of the last event the text up to `end` shows whole (`after`: none)."""
    cursor = after
    for event, _, last in spans:
        if last > end:
            break
        cursor = str(event.get("event_id"))
    return cursor


def detailed_events(events: list[dict[str, Any]], spans: list[Span] | None = None) -> str:
    """Every event with its id, type, time and fields (response_format='detailed');
    `spans` gets where each is."""
    lines: list[str] = []
    at = 0
    for event in events:
        fields = {k: v for k, v in event.items() if k not in ("event_id", "type", "ts", "data")}
        when = datetime.fromtimestamp(float(event.get("ts") or 0), UTC).strftime("%H:%M:%S.%f")
        head = f"#{event.get('event_id')} {event.get('type')} {when[:-3]}"
        head += " " + json.dumps(fields, ensure_ascii=False) if fields else ""
        line = head + (f"\n{event['data']}" if event.get("data") else "")
        start = at + (1 if lines else 0)  # (after the newline that joins it)
        data_start = start + len(head) + 1 if event.get("data") else start
        lines.append(line)
        at = start + len(line)
        if spans is not None:
            spans.append((event, data_start, at))
    return "\n".join(lines)
