"""A hosted MCP server that sends too much: huge lines, many notifications, progress.

Tools:
  giant {mb?: number = 64}
      one result whose single text content is `mb` MiB of "x", all in ONE JSON line
      (written in 1 MiB pieces, so the server itself stays small)
  many {count?: int = 100}
      `count` notifications/message (level "info", logger "giant", data "message <i>",
      i = 0..count-1), then the result "sent <count> notifications"
  progress {steps?: int = 5, token?: str | int}
      for i = 1..steps, 0.05 s apart: notifications/progress {progressToken, progress: i,
      total: steps, message: "step <i>"}; the token is `token` when given, else the call's
      _meta.progressToken (neither: no notifications). Then the result "done <steps> steps"
  ok {}  "fine"

Capabilities: tools and logging (logging/setLevel is answered {}).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, ok_tool, serve, tool  # noqa: E402

MIB = 1 << 20


def giant(args: dict, ctx: Context) -> None:
    mb = args.get("mb")
    size = int((mb if isinstance(mb, int | float) and mb >= 0 else 64) * MIB)
    head = '{"jsonrpc": "2.0", "id": %s, "result": {"content": [{"type": "text", "text": "'
    tail = '"}], "isError": false}}\n'

    def parts() -> Iterator[bytes]:
        yield (head % json.dumps(ctx.id)).encode()
        chunk = b"x" * MIB
        left = size
        while left > 0:
            yield chunk[: min(left, MIB)]
            left -= MIB
        yield tail.encode()

    ctx.write_parts(parts())


def many(args: dict, ctx: Context) -> str:
    count = args.get("count")
    count = count if isinstance(count, int) else 100
    for i in range(count):
        ctx.notify(
            "notifications/message", {"level": "info", "logger": "giant", "data": f"message {i}"}
        )
    return f"sent {count} notifications"


def progress(args: dict, ctx: Context) -> str:
    steps = args.get("steps")
    steps = steps if isinstance(steps, int) else 5
    token = args["token"] if args.get("token") is not None else ctx.progress_token
    for i in range(1, steps + 1):
        time.sleep(0.05)
        if token is not None:
            ctx.notify(
                "notifications/progress",
                {"progressToken": token, "progress": i, "total": steps, "message": f"step {i}"},
            )
    return f"done {steps} steps"


TOOLS = {
    "giant": tool(giant, "Answer with `mb` MiB of text in one line.", {"mb": {"type": "number"}}),
    "many": tool(
        many, "Send `count` log notifications, then answer.", {"count": {"type": "integer"}}
    ),
    "progress": tool(
        progress,
        "Send `steps` progress notifications, then answer.",
        {"steps": {"type": "integer"}, "token": {"type": ["string", "integer"]}},
    ),
    "ok": ok_tool(),
}

if __name__ == "__main__":
    serve(
        TOOLS,
        "giant",
        capabilities={"tools": {}, "logging": {}},
        methods={"logging/setLevel": lambda params, ctx: {}},
    )
