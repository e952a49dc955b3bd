"""docs/configuration.md's table is the settings class's: regenerate it when a setting
changes (`python -m sandbox_runtime.config.reference`), or this fails."""

from __future__ import annotations

import pytest

from sandbox_runtime.config import Settings
from sandbox_runtime.config.reference import BEGIN, END, PAGE, main, render, table

pytestmark = pytest.mark.unit


def test_the_page_is_current() -> None:
    text = PAGE.read_text("utf-8")
    assert render(text) == text, (
        "docs/configuration.md is stale: run python -m sandbox_runtime.config.reference"
    )
    assert main(["--check"]) == 0


def test_every_setting_has_a_row_with_a_description() -> None:
    rows = table().splitlines()[2:]
    assert len(rows) == len(Settings.model_fields)
    for (name, field), row in zip(Settings.model_fields.items(), rows, strict=True):
        assert field.description, f"{name} has no description: the page would say nothing"
        assert f"`SANDBOX_{name.upper()}`" in row or name == "redis_url", row
    assert "| `REDIS_URL` or `SANDBOX_REDIS_URL` | none |" in table()


def test_a_stale_page_is_caught() -> None:
    text = PAGE.read_text("utf-8")
    stale = text.replace("| `SANDBOX_PORT` |", "| `SANDBOX_PORTS` |")
    assert render(stale) == text
    with pytest.raises(ValueError, match="markers"):
        render(text.replace(BEGIN, "").replace(END, ""))
