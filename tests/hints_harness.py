"""Following the hints a result's text gives, as a model does: the call made exactly as written
must succeed (the parser is tests/clients/_hints.py, which the framework drivers share)."""

from __future__ import annotations

from typing import Any

from clients._hints import CALL, TOOLS, hints
from mcp.types import CallToolResult, TextContent
from mcp_harness import Conn

__all__ = ["CALL", "TOOLS", "follow", "hints", "text_of"]


def text_of(result: CallToolResult) -> str:
    texts = [b.text for b in result.content if isinstance(b, TextContent)]
    assert len(texts) == 1, f"one text block: {result.content}"
    return texts[0]


async def follow(
    conn: Conn, text: str, tool: str, progress: Any = None
) -> tuple[dict[str, Any], str]:
    """Make the first call to `tool` the text names, exactly; it must succeed (`progress`: a
    callback, which makes the reply an SSE event, whose size the official client bounds)."""
    named = [args for name, args in hints(text) if name == tool]
    assert named, f"no {tool}(...) hint in: {text[-2000:]}"
    result = await conn.call(tool, progress, **named[0])
    assert not result.is_error, f"following {tool}({named[0]}) failed: {text_of(result)}"
    return dict(result.structured_content or {}), text_of(result)
