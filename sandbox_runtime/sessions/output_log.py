"""An execution's output past a result's budget: its totals, its tail, and the whole of it kept
as a file in the workspace (`.outputs/<execution_id>.log`), so that a model reads the rest with
read_file. Runs on the session's home, where the execution's events are.

The file holds the stdout and stderr the execution kept, in order, as a terminal shows them
(the events' data, nothing else); it is written once the execution has ended, only when its
output is larger than the result's budget, and bounded by the workspace's quota like any file
(a full workspace or disk is said in the result, never raised).
"""

from __future__ import annotations

import asyncio
from typing import Any

from sandbox_runtime.domain.owner import Owner, workspace_name
from sandbox_runtime.errors import ExecutionNotFoundError, SandboxRuntimeError
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.execution.manager import ExecutionManager

LOG_DIR = ".outputs"
OUTPUT_TYPES = ("stdout", "stderr")
DEFAULT_BUDGET = 100_000  # characters, when a caller names none (the tools pass theirs)


def log_path(execution_id: str) -> str:
    return f"{LOG_DIR}/{execution_id}.log"


def output_of(execution: Execution) -> list[tuple[int, str]]:
    """The (seq, data) of every stdout and stderr event the execution keeps, in order."""
    return [(e.seq, e.data or "") for e in execution.events if e.type in OUTPUT_TYPES]


def budget_of(args: dict[str, Any]) -> int:
    value = args.get("max_chars")
    return value if isinstance(value, int) and value > 0 else DEFAULT_BUDGET


async def screen_extras(
    manager: ExecutionManager, owner: Owner, execution: Execution, shown_upto: int, budget: int
) -> dict[str, Any]:
    """For a finished execution whose output is larger than `budget` characters: its totals,
    the events of its tail past `shown_upto` (about half the budget), and the file that keeps
    it all. Empty for an output that fits. (Extra fields: the tools' models drop them from the
    structured content; the text shows them.)"""
    output = output_of(execution)
    chars = sum(len(d) for _, d in output)
    if chars <= budget or not execution.status.finished:
        return {}
    tail: list[dict[str, Any]] = []
    size = 0
    for event in reversed(execution.events):
        if event.seq <= shown_upto:
            break
        if event.type not in OUTPUT_TYPES:
            continue
        size += len(event.data or "")
        tail.append(event.public())
        if size >= budget // 2:
            break
    tail.reverse()
    log = await keep_log(manager, owner, execution, output)
    if "path" in log:  # (where the first kept event's output begins: after the note)
        log["offset"] = len(_note(execution))
    return {
        "screen": {
            "total_bytes": sum(len(d.encode("utf-8", "surrogatepass")) for _, d in output),
            "total_lines": sum(d.count("\n") for _, d in output),
            "tail": tail,
            "log": log,
        }
    }


async def keep_log(
    manager: ExecutionManager,
    owner: Owner,
    execution: Execution,
    output: list[tuple[int, str]] | None = None,
) -> dict[str, Any]:
    """Write the execution's output to its log file (once): {"path", "size"}, or {"error"}."""
    path = log_path(execution.execution_id)
    if execution.kept_log is not None:
        return dict(execution.kept_log)
    text = "".join(d for _, d in output or output_of(execution))
    data = _note(execution) + text.encode("utf-8", "replace")
    name = workspace_name(owner)
    workspaces = manager.workspaces
    try:
        await workspaces.ensure(name, owner.principal)
        with workspaces.hold(name):
            size = await asyncio.to_thread(workspaces.files(name).write, path, data, True)
        kept = {"path": path, "size": size}
    except SandboxRuntimeError as exc:
        kept = {"error": f"the full output was not kept in {path}: {exc}"}
    execution.kept_log = kept
    return dict(kept)


async def keep_output(
    manager: ExecutionManager, owner: Owner, args: dict[str, Any], progress: object = None
) -> dict[str, Any]:
    """The session operation: keep a finished execution's output as its log file, if it is
    larger than the budget; {} when it fits, is still running or is no longer here."""
    try:
        execution = manager.get(owner, str(args.get("execution_id")))
    except ExecutionNotFoundError:
        return {}
    output = output_of(execution)
    if not execution.status.finished or sum(len(d) for _, d in output) <= budget_of(args):
        return {}
    kept = await keep_log(manager, owner, execution, output)
    after = args.get("after")
    if "path" in kept and isinstance(after, int):  # where the page read after `after` begins
        before = "".join(d for seq, d in output if seq <= after)
        kept["offset"] = len(_note(execution)) + len(before.encode("utf-8", "replace"))
    return kept


def _note(execution: Execution) -> bytes:
    """What the log says first when the execution's oldest events were no longer kept."""
    if execution.first_seq <= 1:
        return b""
    return f"[the first {execution.first_seq - 1} events were no longer kept]\n".encode()
