"""Tags legacy MCP session ids with the replica id so nginx can route a session home."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"mcp-session-id"


class SessionTagMiddleware:
    """Outgoing `Mcp-Session-Id: <sid>` becomes `<replica>.<sid>`; incoming ids lose the tag.

    An incoming id tagged for another replica (or untagged) is passed on altered, so the MCP
    layer answers 404 "Session not found": the spec's signal for the client to re-initialize.
    """

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.prefix = f"{replica_id}.".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = []
        for key, value in scope["headers"]:
            if key == HEADER:
                if value.startswith(self.prefix):
                    value = value[len(self.prefix) :]
                else:
                    value = b"foreign-" + value
            headers.append((key, value))
        scope = dict(scope, headers=headers)

        async def send_tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [
                    (k, self.prefix + v if k.lower() == HEADER else v)
                    for k, v in message.get("headers", [])
                ]
            await send(message)

        await self.app(scope, receive, send_tagged)
