"""The E2B-compatible API: an edge onto the same sessions, executions, interpreters, files and
snapshots as the MCP edge (DESIGN §20; docs/e2b.md)."""
