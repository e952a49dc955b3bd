"""A hosted MCP server that shows its environment, sleeps on request, and echoes.

Tools:
  env {}               one text content: JSON object of the whole environment (sorted keys)
  slow {seconds?: number = 10}
      sleeps, then answers "slept <seconds>"; on notifications/cancelled for the call it
      stops at once and sends no response (MCP: a cancelled request gets none)
  echo {text: str}     content [{"type": "text", "text": text}], structuredContent
                       {"text": text}; tools/list gives it an outputSchema
  ok {}                "fine"
"""

from __future__ import annotations

import json
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, ok_tool, serve, text, tool  # noqa: E402


def env(args: dict, ctx: Context) -> str:
    return json.dumps(dict(os.environ), sort_keys=True)


def slow(args: dict, ctx: Context) -> str | None:
    seconds = args.get("seconds")
    seconds = seconds if isinstance(seconds, int | float) else 10
    if ctx.cancelled.wait(seconds):
        ctx.log(f"slow: request {ctx.id!r} cancelled, not answering")
        return None
    return f"slept {seconds}"


def echo(args: dict, ctx: Context) -> dict:
    value = args.get("text")
    value = value if isinstance(value, str) else ""
    return {**text(value), "structuredContent": {"text": value}}


TOOLS = {
    "env": tool(env, "Return the whole environment as JSON."),
    "slow": tool(
        slow,
        "Sleep `seconds`, then answer (no answer when cancelled).",
        {"seconds": {"type": "number"}},
    ),
    "echo": tool(
        echo,
        "Return `text`, also as structured content.",
        {"text": {"type": "string"}},
        ["text"],
        output_schema={
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    ),
    "ok": ok_tool(),
}

if __name__ == "__main__":
    serve(TOOLS, "echoenv")
