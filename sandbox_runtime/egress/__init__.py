"""Network egress for sandboxes: the allowlist policy (and, later, the proxy that enforces it)."""
