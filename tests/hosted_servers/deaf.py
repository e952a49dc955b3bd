"""A hosted MCP server that stops reading its stdin on command, and one that talks faster than
its caller reads.

Tools:
  deafen {partial?: int = 0, pings?: int = 0}
      stops reading stdin for good (the process keeps running, stdin open, until killed):
      first sends `pings` ping requests to its client (ids "ping-0" ... "ping-<pings-1>"),
      whose answers it never reads; then answers this call "deaf after <pings> pings"; then
      reads `partial` more bytes of stdin (the start of the next message: it stops in the
      middle of it) and nothing after them.
  chatter {count?: int = 1000, size?: int = 1000}
      `count` notifications/progress for the call's _meta.progressToken (none: no
      notifications), each with a message of `size` characters, as fast as it can; then the
      result "chatted <count>"
  id {}    a random hex string chosen when the process started (tells instances apart)
  ok {...} "fine", whatever its arguments (a large one is what fills a deaf server's pipe)
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, Server, ok_tool, text, tool  # noqa: E402

ME = os.urandom(8).hex()


def chatter(args: dict, ctx: Context) -> str:
    count = args.get("count")
    count = count if isinstance(count, int) else 1000
    size = args.get("size")
    note = "n" * (size if isinstance(size, int) and size >= 0 else 1000)
    if ctx.progress_token is not None:
        for i in range(1, count + 1):
            ctx.notify(
                "notifications/progress",
                {"progressToken": ctx.progress_token, "progress": i, "message": note},
            )
    return f"chatted {count}"


class Deaf(Server):
    """The skeleton, with `deafen` handled on the reading thread itself: no line after the
    call's is read (but `partial` bytes)."""

    def __init__(self) -> None:
        super().__init__(
            "deaf",
            {
                "deafen": tool(
                    lambda args, ctx: None,
                    "Stop reading stdin.",
                    {"partial": {"type": "integer"}, "pings": {"type": "integer"}},
                ),
                "chatter": tool(
                    chatter,
                    "Send progress notifications, fast.",
                    {"count": {"type": "integer"}, "size": {"type": "integer"}},
                ),
                "id": tool(lambda args, ctx: ME, "This process's random id."),
                "ok": ok_tool(),
            },
        )
        self.deafened: tuple[object, dict] | None = None

    def call_tool(self, params: dict, ctx: Context) -> None:
        if params.get("name") == "deafen":
            args = params.get("arguments")
            self.deafened = (ctx.id, args if isinstance(args, dict) else {})
            return None
        return super().call_tool(params, ctx)

    def run(self) -> None:
        stdin = sys.stdin.buffer
        while self.deafened is None:
            line = stdin.readline()
            if not line:
                os._exit(0)
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                self.error(None, -32700, "Parse error")
                continue
            self.handle(msg)
        request_id, args = self.deafened
        pings = args.get("pings") if isinstance(args.get("pings"), int) else 0
        self.log(f"deaf: {pings} pings, then {args.get('partial', 0)} bytes")
        for i in range(pings):
            self.send({"jsonrpc": "2.0", "id": f"ping-{i}", "method": "ping"})
        self.respond(request_id, text(f"deaf after {pings} pings"))
        partial = args.get("partial")
        if isinstance(partial, int) and partial > 0:
            stdin.read(partial)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    Deaf().run()
