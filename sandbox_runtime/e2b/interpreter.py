"""The code interpreter's HTTP API (sandbox port 49999: `POST /execute`, `/contexts`).

A stub until the interpreter edge lands: every request is a clear 501.

Interface: `serve_interpreter(request, sandbox, services)` gets a request whose
`E2b-Sandbox-Port` is 49999, already authenticated (its `X-Access-Token` is the sandbox's) and
with the `/e2b` prefix stripped from its path; `sandbox.owner` is the session to run code in
(`services.router.run(sandbox.owner, "run_code", args, sink)`), `sandbox.env_vars` the
sandbox's environment.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sandbox_runtime.e2b.sandboxes import E2BSandbox


async def serve_interpreter(request: Request, sandbox: E2BSandbox, services: Any) -> Response:
    return JSONResponse(
        {"code": 501, "message": "the code interpreter (port 49999) is not implemented yet"},
        status_code=501,
    )
