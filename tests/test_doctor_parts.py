"""The doctor's report lines, without checking anything."""

from __future__ import annotations

import pytest

from sandbox_runtime.doctor import Check

pytestmark = pytest.mark.unit


def test_a_check_is_ok_fail_or_warn() -> None:
    assert Check("x", True, "fine").label == "OK"
    assert Check("x", False, "broken").label == "FAIL"
    assert Check("x", False, "degraded", required=False).label == "WARN"
