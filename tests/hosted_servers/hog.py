"""A hosted MCP server that runs into its sandbox's limits.

Tools:
  hog {mb?: int = 1024}  allocates and touches that many MiB, then answers (it should not:
      its memory limit ends it first)
  forkbomb {}            starts processes until it cannot, then answers how many it got
  ok {}                  "fine"
"""

from __future__ import annotations

import os
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, ok_tool, serve, text, tool  # noqa: E402


def hog(args: dict, ctx: Context) -> dict:
    mb = args.get("mb") if isinstance(args.get("mb"), int) else 1024
    blocks = [bytearray(1 << 20) for _ in range(mb)]
    for block in blocks:
        block[::4096] = b"x" * len(block[::4096])
    return text(f"held {mb} MiB")


def forkbomb(args: dict, ctx: Context) -> dict:
    children = []
    try:
        while len(children) < 10_000:
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children.append(pid)
    except OSError:
        pass
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return text(f"started {len(children)} processes")


TOOLS = {
    "hog": tool(hog, "Allocate memory.", {"mb": {"type": "integer"}}),
    "forkbomb": tool(forkbomb, "Start processes until refused.", {}),
    "ok": ok_tool(),
}

if __name__ == "__main__":
    serve(TOOLS, "hog")
