"""A hosted MCP server that floods its stdout or stderr.

Tools (neither flood ever answers, or stops, or heeds a cancellation):
  flood {mode?: "lines" | "bigline" = "lines"}
      "lines": writes lines to stdout as fast as it can, forever, none of them valid JSON-RPC
      (plain text, a JSON array, JSON objects without "jsonrpc", {"jsonrpc": "2.0"} alone).
      "bigline": one endless line of "x" with no newline, in 64 KiB writes.
  stderr_flood {mode?: "lines" | "bigline" = "lines"}  the same on stderr
  ok {}  "fine"
"""

from __future__ import annotations

import itertools
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, ok_tool, serve, tool  # noqa: E402

JUNK = [
    b"junk line %d: this is not JSON at all " + b"#" * 200 + b"\n",
    b"[%d, 2, 3]\n",
    b'{"hello": "world", "n": %d}\n',
    b'{"jsonrpc": "2.0", "n": %d}\n',
    b'{"jsonrpc": "2.0"}\n',
]
CHUNK = b"x" * 65536


def _junk() -> bytes:
    lines = []
    for n, pattern in zip(range(64), itertools.cycle(JUNK), strict=False):
        lines.append(pattern % n if b"%d" in pattern else pattern)
    return b"".join(lines)


def flood(args: dict, ctx: Context) -> None:
    block = CHUNK if args.get("mode") == "bigline" else _junk()
    while True:
        ctx.write_raw(block)


def stderr_flood(args: dict, ctx: Context) -> None:
    block = CHUNK if args.get("mode") == "bigline" else _junk()
    err = sys.stderr.buffer
    while True:
        try:
            err.write(block)
            err.flush()
        except OSError:
            os._exit(0)


MODE = {"mode": {"type": "string", "enum": ["lines", "bigline"]}}

TOOLS = {
    "flood": tool(flood, "Flood stdout with junk, forever.", MODE),
    "stderr_flood": tool(stderr_flood, "Flood stderr, forever.", MODE),
    "ok": ok_tool(),
}

if __name__ == "__main__":
    serve(TOOLS, "flood")
