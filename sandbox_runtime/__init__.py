"""sandbox_runtime: stateful, sandboxed code execution for AI agents over MCP."""

__version__ = "0.1.0"
