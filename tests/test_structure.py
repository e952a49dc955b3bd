"""The program's shape, checked: background work only through the supervisor, modules small
enough to read, and one composition root. (The layers are checked by `lint-imports`.)"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "sandbox_runtime"
MAX_LINES = 450
# Modules allowed to be longer, each saying why at its top.
LONG_ON_PURPOSE = {
    "config/settings.py": "one field each",
    "snapshots/service.py": "the one facade over capture, apply, the store and retention",
    "sessions/router.py": "every\npath a session-bound call can take",
}


def product_modules() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if "runtime_files" not in p.relative_to(PACKAGE).parts
    )


@functools.cache
def nodes_of(path: Path) -> tuple[ast.AST, ...]:
    """Every node of a module, parsed once for all the tests here (parsing is their time)."""
    return tuple(ast.walk(ast.parse(path.read_text(), str(path))))


def calls_named(path: Path, names: set[str]) -> list[int]:
    return [
        node.lineno
        for node in nodes_of(path)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr in names)
            or (isinstance(node.func, ast.Name) and node.func.id in names)
        )
    ]


def test_no_task_is_started_outside_the_supervisor() -> None:
    """Every task is the supervisor's (spawned, or a loop) or scoped to its function."""
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in product_modules()
        if path.name != "supervisor.py"
        and (lines := calls_named(path, {"create_task", "ensure_future"}))
    }
    assert found == {}, f"start tasks through sandbox_runtime.supervisor instead: {found}"


def test_modules_stay_small_or_say_why() -> None:
    long = {
        name: count
        for path in product_modules()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
        and (name := str(path.relative_to(PACKAGE))) not in LONG_ON_PURPOSE
    }
    assert long == {}, f"split these, or add them to LONG_ON_PURPOSE with a note: {long}"
    for name, why in LONG_ON_PURPOSE.items():
        assert why in (PACKAGE / name).read_text()[:600], f"{name} must say why it is long"


def test_the_execution_manager_is_built_only_by_the_composition_root() -> None:
    builders = {
        str(path.relative_to(PACKAGE))
        for path in product_modules()
        if calls_named(path, {"ExecutionManager"})
    }
    assert builders == {"app/services.py"}
