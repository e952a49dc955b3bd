"""Hosted MCP servers: the catalog, installs, sandboxed instances and their supervision."""
