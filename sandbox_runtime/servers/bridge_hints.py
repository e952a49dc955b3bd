"""What code mode's bridge says when it refuses a server or a tool: the fix, in one line. A
server the principal may use but the execution did not name comes with the exact
`servers=[...]` that allows it; a name that is no server (or none the principal may use)
with the close names among the principal's servers, and never any other name."""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection

MAX_LISTED = 30  # names shown after "this code may call" / "its tools"


def close_names(name: str, names: Collection[str]) -> list[str]:
    """Up to three names like `name` (a typo, `_` for `-`), the closest first."""
    close = difflib.get_close_matches(name, sorted(names), 3, 0.6)
    return close + [n for n in sorted(names) if n.replace("-", "_") == name and n not in close]


def _listed(names: Collection[str]) -> str:
    shown = sorted(names)[:MAX_LISTED]
    more = f", ... ({len(names)} in all)" if len(names) > MAX_LISTED else ""
    return ", ".join(shown) + more if shown else "none"


def _alternatives(names: list[str]) -> str:
    return " or ".join(repr(n) for n in names)


def server_refusal(name: str, allowed: Collection[str], usable: Collection[str], tool: str) -> str:
    """Why `name` may not be called by this execution (`allowed`: what it named, narrowed;
    `usable`: every server its principal may use; `tool`: the tool that started it)."""

    def allow(server: str) -> str:
        return f"call {tool} again with servers={json.dumps(sorted({*allowed, server}))}"

    if name in usable:
        return f"server {name!r} was not named in this {tool} call's servers: {allow(name)}"
    close = close_names(name, {*usable, *allowed})
    question = f"; did you mean {_alternatives(close)}?" if close else ""
    outside = [c for c in close if c not in allowed]
    how = f"to call {outside[0]!r}: {allow(outside[0])}; " if outside else ""
    return f"no server {name!r}{question} ({how}this code may call: {_listed(allowed)})"


def tool_refusal(server: str, tool: str, names: Collection[str]) -> str:
    """`server` lists no tool `tool` (`names`: the tools it lists, as filtered for this code)."""
    close = close_names(tool, names)
    hint = f"; did you mean {_alternatives(close)}?" if close else ""
    return f"server {server!r} has no tool {tool!r}{hint} (its tools: {_listed(names)})"
