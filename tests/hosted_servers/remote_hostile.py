"""A hostile remote Streamable HTTP MCP server for the tests (raw ASGI on uvicorn, on the host).

    python remote_hostile.py PORT

POST /mcp speaks just enough MCP (initialize, tools/list, tools/call) to be called through
/servers/NAME/mcp; each tool misbehaves in its own way:

- endless_line: an SSE `data:` line that never ends (up to 800 MiB, until the caller goes);
- endless_event: an SSE event of 1 KiB `data:` lines that never ends (the same);
- u2028 {}: a valid answer whose text holds raw U+2028, U+2029 and U+0085;
- hang {}: never answers; and `notifications/cancelled` is never answered either;
- denied {}: HTTP 500 whose body echoes the request's query and Authorization header;
- gzipped {}: a gzip-encoded answer, though asked for none (a bomb could hide in one);
- echo {text}: answers at once (the control).

GET /stats: what it saw and did ({"cancels": N, "hangs": N, "endless_sent": BYTES (of the
last endless reply), "queries": [...]}).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import sys
from typing import Any

import uvicorn

ENDLESS = 800 * 1024 * 1024
CHUNK = b"x" * (1024 * 1024)
SEPARATORS = "one\u2028two\u2029three\x85four"
TOOLS = [
    {"name": name, "description": description, "inputSchema": {"type": "object"}}
    for name, description in (
        ("endless_line", "An SSE line that never ends."),
        ("endless_event", "An SSE event that never ends."),
        ("u2028", "Answers with raw line separators in a JSON string."),
        ("hang", "Never answers."),
        ("denied", "HTTP 500, echoing what it was sent."),
        ("gzipped", "A gzip-encoded answer."),
        ("echo", "Answers at once."),
    )
]
stats: dict[str, Any] = {"cancels": 0, "hangs": 0, "endless_sent": 0, "queries": []}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/stats":
        await reply(send, 200, json.dumps(stats).encode())
        return
    if scope["method"] != "POST":
        await reply(send, 200 if scope["method"] == "DELETE" else 405, b"")
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    request = json.loads(body)
    stats["queries"].append(scope["query_string"].decode())
    method = request.get("method")
    if "id" not in request:
        if method == "notifications/cancelled":
            stats["cancels"] += 1
            await asyncio.Event().wait()  # (never answered)
        await reply(send, 202, b"")
        return
    if method == "initialize":
        result = {
            "protocolVersion": request["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "hostile", "version": "1"},
        }
        await answer(send, request["id"], result, [(b"mcp-session-id", b"hostile-session")])
    elif method == "tools/list":
        await answer(send, request["id"], {"tools": TOOLS})
    elif method == "tools/call":
        await call(scope, receive, send, request["id"], request["params"])
    else:
        await answer(send, request["id"], {})


async def call(
    scope: dict[str, Any], receive: Any, send: Any, request_id: Any, params: dict[str, Any]
) -> None:
    tool = params.get("name")
    if tool in ("endless_line", "endless_event"):
        stats["endless_sent"] = 0  # (set when this reply stops)
        gone = asyncio.get_running_loop().create_task(receive())  # (http.disconnect)
        await start_stream(send)
        await send({"type": "http.response.body", "body": b"data: ", "more_body": True})
        chunk = CHUNK if tool == "endless_line" else (b"y" * 1024 + b"\ndata: ") * 1024
        sent = 0
        while sent < ENDLESS and not gone.done():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent += len(chunk)
        stats["endless_sent"] = sent
        gone.cancel()
        await send({"type": "http.response.body", "body": b""})
    elif tool == "u2028":
        result = {"content": [{"type": "text", "text": SEPARATORS}]}
        await answer(send, request_id, result)
    elif tool == "hang":
        stats["hangs"] += 1
        await asyncio.Event().wait()
    elif tool == "gzipped":
        message = {"jsonrpc": "2.0", "id": request_id, "result": {"content": []}}
        extra = [(b"content-encoding", b"gzip")]
        await start_stream(send, extra)
        body = gzip.compress(b"data: " + json.dumps(message).encode() + b"\n\n")
        await send({"type": "http.response.body", "body": body})
    elif tool == "denied":
        token = dict(scope["headers"]).get(b"authorization", b"").decode()
        seen = f"denied: query {scope['query_string'].decode()} auth {token}"
        await reply(send, 500, seen.encode())
    else:
        text = str((params.get("arguments") or {}).get("text", ""))
        await answer(send, request_id, {"content": [{"type": "text", "text": text}]})


async def start_stream(send: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), *(extra or [])],
        }
    )


async def answer(
    send: Any,
    request_id: Any,
    result: dict[str, Any],
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """The result as one SSE event, its JSON with raw (unescaped) non-ASCII text."""
    message = {"jsonrpc": "2.0", "id": request_id, "result": result}
    event = b"data: " + json.dumps(message, ensure_ascii=False).encode() + b"\n\n"
    await start_stream(send, extra)
    await send({"type": "http.response.body", "body": event})


async def reply(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json" if body[:1] == b"{" else b"text/plain")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
