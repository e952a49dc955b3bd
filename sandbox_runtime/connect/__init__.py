"""`srt-mcp-server connect|disconnect|clients`: wire this server (or one hosted server's
endpoint) into the MCP clients people run agents in, by their own CLI when installed, else by
editing their config file in place (comments and other entries kept)."""
