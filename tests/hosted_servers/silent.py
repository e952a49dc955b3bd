"""A hosted MCP server that stops answering.

Tools:
  hang {}  never answers: sleeps forever, ignoring notifications/cancelled
  ok {}    "fine" (answered even while calls of hang are pending)

Flags:
  --no-init   never answers initialize (everything else as usual)
  --stubborn  ignores SIGTERM and keeps running after stdin closes (only SIGKILL ends it)
"""

from __future__ import annotations

import os
import signal
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, ok_tool, serve, tool  # noqa: E402


def hang(args: dict, ctx: Context) -> None:
    while True:
        time.sleep(3600)


TOOLS = {
    "hang": tool(hang, "Never answers."),
    "ok": ok_tool(),
}

if __name__ == "__main__":
    methods = {}
    if "--no-init" in sys.argv[1:]:
        methods["initialize"] = lambda params, ctx: None
    stubborn = "--stubborn" in sys.argv[1:]
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve(TOOLS, "silent", methods=methods, exit_on_eof=not stubborn)
