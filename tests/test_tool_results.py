"""The execution tools' result shaping (server/results.py), without a server."""

from __future__ import annotations

import pytest

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.server.replies import ToolFailure
from sandbox_runtime.server.results import (
    ExecutionResult,
    cursor_of,
    event_not_found,
    execution_result,
    id_text,
    unfinished_message,
)
from sandbox_runtime.server.results import _preview as preview

pytestmark = pytest.mark.unit


def test_an_event_id_is_a_decimal_sequence_number() -> None:
    assert cursor_of(None) == 0 and cursor_of("") == 0
    assert cursor_of(" 42 ") == 42
    assert cursor_of("-1") is None and cursor_of("4a") is None and cursor_of("\u0661") is None
    assert cursor_of("1" * 19) is None
    assert id_text(7) == "7" and id_text(True) is True and id_text("7") == "7"
    assert isinstance(event_not_found("9"), ToolFailure)


def test_long_commands_are_previewed() -> None:
    assert preview("short", 10) == "short"
    assert preview("x" * 12, 10) == "x" * 10 + "… [2 more characters]"
    assert preview(["a", "b"], 10) == ["a", "b"]
    shown = preview(["x" * 8, "y" * 8, "z"], 10)
    assert shown == ["x" * 8, "yy… [6 more characters]", "… [1 more arguments]"]


def test_an_unfinished_result_says_how_to_read_on() -> None:
    running = {"execution_id": "e1", "status": "running", "next_cursor": "5"}
    message = unfinished_message(running)
    assert message is not None and "last_event_id='5'" in message
    assert unfinished_message({"execution_id": "e1", "status": "completed"}) is None
    assert "session" not in message  # the default session: no need to name it
    shaped = execution_result(Owner("p", "s:work"), running, ExecutionResult)
    # A named session's ids are its own: the call that reads on names it.
    assert shaped["session"] == "work"
    assert shaped["message"] == unfinished_message(running, "work")
    assert shaped["message"].endswith(
        "get_execution_output(execution_id='e1', last_event_id='5', wait=True, session='work')."
    )
