"""google-genai with an MCP ClientSession in tools=[...], as its docs show it: the SDK lists the
session's tools and converts every inputSchema itself (google/genai/_mcp_utils.py,
mcp_to_gemini_tools) before it sends a request.

Two ways in: the conversion code run on each tool alone (so one tool's failure names it), and
client.aio.models.generate_content with the API endpoint pointed at a closed local port, where
the request can only fail at connecting once every tool converted. The config goes in as a dict:
a GenerateContentConfig object is deep-copied first, which fails on any live session ("cannot
pickle '_asyncio.Future' object") before our schemas are looked at; that is recorded too.

On mcp 1.x the session speaks 2025-11-25; on mcp 2.x it is the session of an mcp.Client in
mode="auto" (2026-07-28 when the server offers it).
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import AsyncIterator
from typing import Any

from _driver import Json, arguments, error_text, main, mcp_major, step, usable, versions
from google import genai
from google.genai import _mcp_utils, types


@contextlib.asynccontextmanager
async def open_session(url: str, token: str) -> AsyncIterator[tuple[Any, str | None]]:
    """An initialized mcp ClientSession and the protocol version it speaks."""
    headers = {"Authorization": f"Bearer {token}"}
    if mcp_major() >= 2:
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        async with create_mcp_http_client(headers=headers) as http:
            transport = streamable_http_client(url, http_client=http)
            async with Client(transport, mode="auto") as client:
                yield client.session, client.protocol_version
    else:
        from mcp import ClientSession
        from mcp.client.streamable_http import streamablehttp_client

        async with (
            streamablehttp_client(url, headers=headers) as (read, write, _),
            ClientSession(read, write) as session,
        ):
            init = await session.initialize()
            yield session, init.protocolVersion


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_connection_error(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a refused or failed connection."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionError) or "ConnectError" in type(e).__name__:
            return True
        if isinstance(e, OSError) and e.errno == errno.ECONNREFUSED:
            return True
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        stack.extend(getattr(e, "exceptions", None) or [])
    return False


def converted_property(tool: types.Tool, name: str) -> Json | None:
    declarations = tool.function_declarations or []
    params = declarations[0].parameters if declarations else None
    if params is None or not params.properties or name not in params.properties:
        return None
    dumped: Json = params.properties[name].model_dump(mode="json", exclude_none=True)
    return dumped


def as_json_schema(gemini: Json | None) -> Json | None:
    """A Gemini Schema dump in JSON-schema spelling, enough for `usable`."""
    if gemini is None:
        return None
    out: Json = {}
    if "type" in gemini:
        out["type"] = str(gemini["type"]).lower()
    if gemini.get("properties"):
        out["properties"] = {k: as_json_schema(v) for k, v in gemini["properties"].items()}
    if "items" in gemini:
        out["items"] = as_json_schema(gemini["items"])
    if gemini.get("any_of"):
        out["anyOf"] = [as_json_schema(v) for v in gemini["any_of"]]
    return out


async def run() -> Json:
    args = arguments(__doc__ or "").parse_args()
    report: Json = {"framework": "google-genai", "versions": versions("google-genai")}
    async with open_session(args.url, args.token) as (session, protocol):
        report["protocol_version"] = protocol
        listed = await session.list_tools()
        tools: dict[str, Json] = {}
        for tool in listed.tools:
            entry: Json = {}
            try:
                (converted,) = _mcp_utils.mcp_to_gemini_tools([tool])
            except Exception as exc:
                entry["exception"] = error_text(exc)
            else:
                entry["converted"] = True
                for name in ("environment", "sandbox_config"):
                    prop = converted_property(converted, name)
                    if prop is not None:
                        entry[f"{name}_schema"] = prop
                        entry[f"{name}_usable"] = usable(as_json_schema(prop))
            tools[tool.name] = entry
        report["tools"] = tools

        port = closed_port()
        client = genai.Client(
            api_key="srt-test-no-key",
            http_options=types.HttpOptions(
                base_url=f"http://127.0.0.1:{port}",
                retry_options=types.HttpRetryOptions(attempts=1),
                timeout=10_000,
            ),
        )

        async def generate(config: Any) -> Json:
            try:
                await client.aio.models.generate_content(
                    model="gemini-2.5-flash", contents="run echo hi", config=config
                )
            except Exception as exc:
                return {"exception": error_text(exc), "connection_error": is_connection_error(exc)}
            return {"exception": None, "connection_error": False}

        await step(report, "generate_dict_config", lambda: generate({"tools": [session]}))
        await step(
            report,
            "generate_object_config",
            lambda: generate(types.GenerateContentConfig(tools=[session])),
        )
    return report


if __name__ == "__main__":
    main(run)
