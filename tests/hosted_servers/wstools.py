"""A hosted MCP server whose tool list comes from its state directory: what one principal's
instance lists is that principal's to write (a tool's name and description, as any server
that reads its tools from a workspace or repository does).

Tools:
  set_tools {names: [str], description?: str}
      writes <state dir>/tools.json; from the next tools/list on, a tool per name (at most
      50, each described by `description`) that answers its own name
  ok {}  "fine"
Options:
  --many N [--size BYTES]  also lists N tools big_0 .. big_<N-1>, each with a description
      and an argument schema of about BYTES (default 4000) each; they answer "big"

The state dir is /workspace ($HOSTED_STATE_DIR overrides it, for tests outside the sandbox).
"""

from __future__ import annotations

import json
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, Server, Tool, ok_tool, tool  # noqa: E402

STATE_DIR = os.environ.get("HOSTED_STATE_DIR") or "/workspace"
LISTED = os.path.join(STATE_DIR, "tools.json")


def _option(name: str, default: int) -> int:
    argv = sys.argv[1:]
    if name in argv and argv.index(name) + 1 < len(argv):
        return int(argv[argv.index(name) + 1])
    return default


def set_tools(args: dict, ctx: Context) -> str:
    names = [n for n in args.get("names") or [] if isinstance(n, str)][:50]
    description = args.get("description")
    description = description if isinstance(description, str) else ""
    with open(LISTED, "w") as f:
        json.dump({"names": names, "description": description}, f)
    return f"listing {len(names)} tools from now on"


def _named(name: str, description: str) -> Tool:
    return tool(lambda args, ctx: name, description)


def _big(n: int, size: int) -> dict[str, Tool]:
    words = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    properties = {
        f"arg_{i}": {"type": "string", "description": words[: size // 20]} for i in range(20)
    }
    return {
        f"big_{i}": tool(lambda args, ctx: "big", f"Big tool {i}. {words}", properties)
        for i in range(n)
    }


class WorkspaceTools(Server):
    def list_tools(self, params: dict, ctx: Context) -> dict | None:
        try:
            with open(LISTED) as f:
                listed = json.load(f)
        except (OSError, ValueError):
            listed = {"names": []}
        for name in listed.get("names", []):
            self.tools[name] = _named(name, listed.get("description", ""))
        return super().list_tools(params, ctx)


TOOLS: dict[str, Tool] = {
    "set_tools": tool(
        set_tools,
        "From the next tools/list on, list a tool per name (each answering its name).",
        {
            "names": {"type": "array", "items": {"type": "string"}},
            "description": {"type": "string"},
        },
        ["names"],
    ),
    "ok": ok_tool(),
}

if __name__ == "__main__":
    TOOLS.update(_big(_option("--many", 0), _option("--size", 4000)))
    WorkspaceTools("wstools", TOOLS).run()
