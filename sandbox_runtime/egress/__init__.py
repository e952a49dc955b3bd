"""Network egress for sandboxes: the allowlist proxy (proxy.py, a separate process: request.py,
outbound.py, pipe.py), the server's supervisor of it (supervisor.py), and the relay inside each
sandbox (relay.pl; relay.py, the same in Python, in environment builds). The policy itself is
sandbox_runtime.domain.egress."""
