"""The screens of server/screens.py as pure functions: what they show, and their bounds."""

from __future__ import annotations

import random
import re

import pytest

from sandbox_runtime.execution.execution import CHUNK_BYTES, chunks
from sandbox_runtime.server.screen_spans import Span, cursor_within, output_in
from sandbox_runtime.server.screens import (
    MIN_BUDGET,
    call,
    error_text,
    execution_screen,
    read_screen,
    render,
)

pytestmark = pytest.mark.unit


def events(*pairs: tuple[str, str]) -> list[dict[str, object]]:
    return [{"event_id": str(i + 2), "type": t, "data": d} for i, (t, d) in enumerate(pairs)]


def test_output_reads_as_a_terminal_with_stderr_marked() -> None:
    shown = render(events(("stdout", "a\n"), ("stderr", "b"), ("stdout", "c\n")), None, "e")
    assert shown == "a\n[stderr]\nb\n[stdout]\nc\n"
    assert render(events(("stdout", "only\n")), None, "e") == "only\n"
    call_event = {"type": "tool_call", "name": "time.now", "reason": "ok", "duration_ms": 3}
    assert render([call_event], None, "e") == "[time.now → ok, 3 ms]\n"


def test_calls_name_the_session_unless_it_is_the_default() -> None:
    assert call("list_executions", "default", cursor="c") == "list_executions(cursor='c')"
    assert call("read_file", "s1", path="p", offset=3) == (
        "read_file(path='p', offset=3, session='s1')"
    )


def test_an_exception_is_its_last_lines_and_name_value() -> None:
    error = {
        "name": "ValueError",
        "value": "bad",
        "traceback": ["-" * 20, "Traceback", *[f"frame {i}" for i in range(20)], "ValueError: bad"],
    }
    text = error_text(error)
    assert text.endswith("frame 19\nValueError: bad") and "-----" not in text
    assert len(text.splitlines()) <= 9


@pytest.mark.parametrize("budget", [MIN_BUDGET, 5_000, 100_000])
def test_every_screen_is_within_its_budget(budget: int) -> None:
    rng = random.Random(budget)
    for _ in range(20):
        pieces = [
            (
                rng.choice(["stdout", "stderr"]),
                "x" * rng.randint(0, 30_000) + "\n" * rng.randint(0, 3),
            )
            for _ in range(rng.randint(1, 12))
        ]
        result = {
            "execution_id": "e",
            "status": "completed",
            "exit_code": 0,
            "output": events(*pieces),
            "next_cursor": "20",
            "has_more": rng.random() < 0.5,
            "session": "s",
            "files": [{"path": f"f{i}", "size": i} for i in range(rng.randint(0, 60))],
        }
        assert len(execution_screen(result, budget)) <= budget


def test_a_part_of_a_file_says_where_the_next_starts() -> None:
    part = {"path": "log", "size": 10_000, "offset": 0, "length": 9_000, "eof": False}
    text = read_screen({**part, "encoding": "utf-8", "content": "y\n" * 4_500}, "s", MIN_BUDGET)
    assert len(text) <= MIN_BUDGET
    assert text.endswith("read_file(path='log', offset=1000, length=1000, session='s')]")


def test_output_is_cut_into_events_of_at_most_64_kib() -> None:
    for text in ("a" * 200_000, "é" * 100_000, "€x" * 50_000, "short"):
        pieces = chunks(text, CHUNK_BYTES)
        assert "".join(pieces) == text
        assert all(len(p.encode()) <= CHUNK_BYTES for p in pieces)


def test_a_cut_page_reads_on_from_its_note_without_repeating_or_adding() -> None:
    """The head of a cut page ends with a whole event, so the note's get_execution_output reads
    on where it stops; a head (or a page) that ends inside a line says so, so the line break
    before the note is not taken for the output's. Followed from page to page, the text a model
    reads adds up to the output exactly."""
    whole = "".join(f"line {i}\n" for i in range(30_000))
    pieces = [whole[i : i + 7_777] for i in range(0, len(whole), 7_777)]  # (ends mid-line)
    all_events = events(*(("stdout", p) for p in pieces))
    got, after, pages = "", "0", 0
    while True:
        pages += 1
        page = [e for e in all_events if int(str(e["event_id"])) > int(after)][:20]
        last = str(page[-1]["event_id"])
        more = last != str(all_events[-1]["event_id"])
        result = {"execution_id": "e", "status": "completed", "exit_code": 0, "output": page,
                  "next_cursor": last, "has_more": more, "session": "s"}  # fmt: skip
        text = execution_screen(result, 20_000, after=after)
        assert len(text) <= 20_000
        note = re.search(r"\n\[… (the line goes on; )?[\d,]+ bytes.*last_event_id='(\d+)'", text)
        if note:
            got += text[: note.start() + (note.group(1) is None)]
            after = note.group(2)
            continue
        body, _, end = text.rpartition("\n")
        goes_on = "the line goes on" in end
        got += body + ("" if goes_on else "\n")
        found = re.search(r"last_event_id='(\d+)'", end)
        if found is None:
            break
        after = found.group(1)
    assert pages > 3 and got == whole


def test_what_a_cut_shows_is_counted_as_output_not_as_text() -> None:
    spans: list[Span] = []
    shown = render(
        events(("stdout", "a\n"), ("stderr", "bé\n"), ("stdout", "c\nd\n")), None, "e", spans
    )
    assert shown == "a\n[stderr]\nbé\n[stdout]\nc\nd\n"
    # Up to "c\n": a\n, bé\n (4 bytes) and c\n are output; the marks are not.
    upto = shown.index("d\n")
    assert output_in(spans, 0, upto) == (2 + 4 + 2, 3)
    assert cursor_within(spans, upto, "0") == "3"  # (event 4, "c\nd\n", is shown in part)
    assert cursor_within(spans, len(shown), "0") == "4"
    assert output_in(spans, upto, len(shown)) == (2, 1)


def test_a_head_of_whole_events_is_counted_as_output_when_streams_take_turns() -> None:
    """The head ends with a whole event and its hints count output only: the cursor is that
    event's id, the read_file offset the bytes of the events up to it (not the [stderr] and
    [stdout] marks), the omitted bytes the output neither the head nor the tail shows."""
    pairs = [("stdout" if i % 3 else "stderr", f"lïne {i} " * 9 + "\n") for i in range(600)]
    page = events(*pairs)
    result = {"execution_id": "e", "status": "completed", "exit_code": 0, "output": page,
              "next_cursor": page[-1]["event_id"], "has_more": False, "session": "s",
              "screen": {"log": {"path": ".outputs/e.log", "offset": 0}}}  # fmt: skip
    text = execution_screen(result, 20_000)
    note = re.search(r"\n\[… ([\d,]+) bytes.*offset=(\d+).*last_event_id='(\d+)'[^\]]*\]\n", text)
    assert note, text[-3000:]
    cursor = int(note.group(3))
    upto = "".join(str(e["data"]) for e in page if int(str(e["event_id"])) <= cursor)
    head = re.sub(r"^\[std(out|err)\]\n", "", text[: note.start() + 1], flags=re.M)
    assert head == upto  # (whole events, the marks aside)
    assert int(note.group(2)) == len(upto.encode())
    tail = text[note.end() :].removesuffix("[exit 0]")
    tail = re.sub(r"^\[std(out|err)\]\n", "", tail, flags=re.M)
    whole = "".join(d for _, d in pairs)
    assert whole.endswith(tail) and int(note.group(1).replace(",", "")) == len(
        whole[len(upto) : len(whole) - len(tail)].encode()
    )
