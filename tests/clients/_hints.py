"""A model's reading of a result's text: every call the text names, with its arguments as the
literals a model would send (tests/test_screens.py and the agent workflow follow them exactly).
Standard library only: the framework drivers import it in their own venvs."""

from __future__ import annotations

import ast
import re
from typing import Any

TOOLS = (
    "get_execution_output",
    "read_file",
    "list_executions",
    "send_stdin",
    "cancel_execution",
    "get_execution_status",
)
CALL = re.compile(rf"\b({'|'.join(TOOLS)})\(([^()]*)\)")


def hints(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Every call the text names, in order, with its arguments (keyword literals only)."""
    found = []
    for match in CALL.finditer(text):
        call = ast.parse(f"f({match.group(2)})", mode="eval").body
        assert isinstance(call, ast.Call) and not call.args, match.group(0)
        args = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        found.append((match.group(1), args))
    return found
