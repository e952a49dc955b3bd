"""Cutting text to a result's budget (server/screens.py): head and tail at line ends, and the
note that says what was cut and how to read it."""

from __future__ import annotations


def measure(text: str) -> tuple[int, int]:
    return len(text.encode("utf-8", "surrogatepass")), text.count("\n")


def first(text: str, size: int) -> str:
    """The start of `text`, at most `size` characters, cut at a line end if there is one."""
    if len(text) <= size:
        return text
    return text[: text.rfind("\n", 0, size) + 1 or size]


def last(text: str, size: int) -> str:
    """The end of `text`, at most `size` characters, cut after a line end if there is one."""
    if len(text) <= size:
        return text
    start = text.find("\n", len(text) - size) + 1
    return text[start if 0 < start < len(text) else len(text) - size :]


def cut(text: str, budget: int) -> tuple[str, str, str]:
    """`text` as (head, omitted, tail) within `budget` characters, cut at line ends."""
    if len(text) <= budget:
        return text, "", ""
    half = budget // 2
    head_end = text.rfind("\n", 0, half) + 1 or half
    tail_start = text.find("\n", len(text) - half) + 1 or len(text) - half
    tail_start = max(tail_start, head_end)
    return text[:head_end], text[head_end:tail_start], text[tail_start:]


def omitted_note(size: int, lines: int, how: list[str], after: str = "\n") -> str:
    """What was cut and how to read it; `after`: the text before the note (when it does not
    end a line, the note says so: the line break before the note is not the output's)."""
    goes_on = "" if after.endswith("\n") else "the line goes on; "
    return (
        f"[… {goes_on}{size:,} bytes, {lines:,} lines omitted; read them with {' or '.join(how)}]"
    )
