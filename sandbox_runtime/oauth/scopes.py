"""Which scope each tool needs: the one table. A policy file (policy.py) grants scopes to
groups and principals; the HTTP edge (403 insufficient_scope) and the tool layer check them
against this table."""

from __future__ import annotations

import re
from collections.abc import Iterable

EXECUTE = "sandbox:execute"
FILES = "sandbox:files"
SNAPSHOTS = "snapshots"
SERVERS_PREFIX = "servers:"
# Discovery (lists of what exists, no effect): every signed-in caller.
NONE = ""

# tool name -> scope (NONE: no scope needed). A tool missing here needs EXECUTE, the
# broadest everyday scope, so that a new tool is never open by accident.
TOOL_SCOPES: dict[str, str] = {
    "execute_code": EXECUTE,
    "execute_code_async": EXECUTE,
    "get_execution_output": EXECUTE,
    "get_execution_status": EXECUTE,
    "send_stdin": EXECUTE,
    "cancel_execution": EXECUTE,
    "list_executions": EXECUTE,
    "run_code": EXECUTE,
    "run_code_async": EXECUTE,
    "list_languages": EXECUTE,
    "restart_interpreter": EXECUTE,
    "list_environments": EXECUTE,
    "write_file": FILES,
    "read_file": FILES,
    "list_files": FILES,
    "delete_file": FILES,
    "create_file_url": FILES,
    "snapshot_session": SNAPSHOTS,
    "list_snapshots": SNAPSHOTS,
    "restore_session": SNAPSHOTS,
    "fork_session": SNAPSHOTS,
    # The catalog as the caller may use it; each server's own calls need servers:<name>.
    "list_servers": NONE,
    "search_tools": NONE,
}

# MCP methods other than tools/call that reach a tool's data.
METHOD_SCOPES: dict[str, str] = {"resources/read": FILES}

SCOPE_NAME = re.compile(r"[A-Za-z0-9:._-]{1,128}")


def tool_scope(tool: str) -> str:
    """The scope a tools/call of `tool` needs (NONE: none)."""
    return TOOL_SCOPES.get(tool, EXECUTE)


def server_scope(name: str, required: str | None = None) -> str:
    """The scope a hosted server's calls need: its catalog entry's `required_scope`, else
    `servers:<name>` (on /servers/<name>/mcp and in code mode's servers=[...])."""
    return required or f"{SERVERS_PREFIX}{name}"


def known_scope(scope: str) -> bool:
    """Whether `scope` is one this server checks (a token's other scopes mean nothing here)."""
    return scope in (EXECUTE, FILES, SNAPSHOTS) or (
        scope.startswith(SERVERS_PREFIX) and len(scope) > len(SERVERS_PREFIX)
    )


def supported(server_names: Iterable[str] = ()) -> list[str]:
    """The scopes the protected resource metadata advertises."""
    return [EXECUTE, FILES, SNAPSHOTS, *(server_scope(n) for n in server_names)]
