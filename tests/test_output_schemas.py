"""Output schemas are cut down for the clients that compile them: a nullable simple type
becomes a type list, and a result's schema is outlined (its required fields typed, the others
named in its description); results that were valid stay valid."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator

from sandbox_runtime.server.results import ExecutionList, ExecutionResult
from sandbox_runtime.server.schemas import compact, outline, portable

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


def test_an_outline_types_the_required_fields_and_names_the_others() -> None:
    schema = outline(compact(portable(ExecutionResult.model_json_schema())))
    assert set(schema["properties"]) == {"execution_id", "status"} == set(schema["required"])
    assert "cancelled" in schema["properties"]["status"]["enum"]
    assert "exit_code (integer|null)" in schema["description"]
    assert "files (array|null)" in schema["description"]
    Draft202012Validator.check_schema(schema)
    listed = outline(compact(portable(ExecutionList.model_json_schema())))
    assert listed["properties"] == {
        "result": {"type": "array", "description": "The executions, newest first."}
    }
    assert "next_cursor (string|null)" in listed["description"]


@pytest.mark.parametrize("result", RESULTS)
def test_what_the_whole_schema_accepts_its_outline_accepts(result: dict[str, Any]) -> None:
    whole = portable(ExecutionResult.model_json_schema())
    cut = outline(compact(whole))
    if Draft202012Validator(whole).is_valid(result):
        assert Draft202012Validator(cut).is_valid(result)
    assert Draft202012Validator(cut).is_valid(result) == (result.get("status") != "done")
