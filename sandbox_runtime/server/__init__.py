"""The HTTP and MCP edge: auth, tools, health, the ASGI app."""
