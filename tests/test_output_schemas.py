"""Output schemas are compacted for the clients that compile them: a nullable simple type
becomes a type list, everything else stays as it was, and results validate the same."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator

from sandbox_runtime.server.results import ExecutionResult
from sandbox_runtime.server.schemas import compact, portable

pytestmark = pytest.mark.unit


def test_a_nullable_simple_type_becomes_a_type_list() -> None:
    schema = {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "X"}
    assert compact(schema) == {"type": ["integer", "null"], "default": None, "title": "X"}
    swapped = {"anyOf": [{"type": "null"}, {"type": "string"}]}
    assert compact(swapped) == {"type": ["string", "null"]}


@pytest.mark.parametrize(
    "kept",
    [
        {"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "null"}]},
        {"anyOf": [{"type": "string", "enum": ["a"]}, {"type": "null"}]},
        {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
        {"type": "object", "anyOf": [{"type": "string"}, {"type": "null"}]},
    ],
)
def test_other_shapes_are_kept(kept: dict[str, Any]) -> None:
    assert compact(kept) == kept


RESULTS: list[dict[str, Any]] = [
    {"execution_id": "a" * 32, "status": "completed", "exit_code": 0, "output": [],
     "signal": None, "files": None, "session_reset": None},
    {"execution_id": "a" * 32, "status": "running", "exit_code": None, "message": "poll"},
    {"execution_id": "a" * 32, "status": "completed", "exit_code": "0"},
    {"execution_id": "a" * 32, "status": "done"},
    {"execution_id": "a" * 32, "status": "failed", "signal": 9},
    {"execution_id": "a" * 32, "status": "failed", "files": [{"path": "x"}]},
]  # fmt: skip


@pytest.mark.parametrize("result", RESULTS)
def test_results_validate_the_same_against_either_form(result: dict[str, Any]) -> None:
    before = portable(ExecutionResult.model_json_schema())
    after = compact(before)
    assert after != before
    Draft202012Validator.check_schema(after)
    verdict = Draft202012Validator(before).is_valid(result)
    assert Draft202012Validator(after).is_valid(result) == verdict
