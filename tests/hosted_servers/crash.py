"""A hosted MCP server that dies in the middle of a call.

Tools:
  crash {code?: int = 3, partial?: bool = false}
      writes "crash.py: crashing on purpose (exit <code>)" to stderr, then os._exit(code)
      with no response. partial: first writes the start of a response line to stdout (no
      newline), so the host sees half a message before the EOF.
  ok {}  "fine"
"""

from __future__ import annotations

import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, ok_tool, serve, tool  # noqa: E402


def crash(args: dict, ctx: Context) -> None:
    code = args.get("code")
    code = code if isinstance(code, int) else 3
    sys.stderr.write(f"crash.py: crashing on purpose (exit {code})\n")
    sys.stderr.flush()
    if args.get("partial"):
        ctx.write_raw(b'{"jsonrpc": "2.0", "id": ' + str(ctx.id).encode() + b', "resu')
    os._exit(code)


TOOLS = {
    "crash": tool(
        crash,
        "Write a line to stderr and exit (code 3) without answering.",
        {"code": {"type": "integer"}, "partial": {"type": "boolean"}},
    ),
    "ok": ok_tool(),
}

if __name__ == "__main__":
    serve(TOOLS, "crash")
