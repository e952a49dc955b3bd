"""The E2B-compatible API as one ASGI app, served under `/e2b` on the main listener
(SANDBOX_E2B=true): point the SDKs' `E2B_API_URL` and `E2B_SANDBOX_URL` at
`http://HOST:PORT/e2b`.

A request with an `E2b-Sandbox-Id` header is for a sandbox (envd on port 49983, the code
interpreter on 49999, by `E2b-Sandbox-Port`) and must carry that sandbox's `X-Access-Token` (or,
to the interpreter, its `E2B-Traffic-Access-Token`: E2B's SDKs send only that to `/contexts`;
create and connect hand out both); any other is for the
control plane and must carry an API key (`X-API-KEY`: one of the server's tokens,
SANDBOX_AUTH_TOKEN(S); `srt-mcp-server token new --e2b` makes one of E2B's shape). A token
that does not match gets the same answer as a sandbox that does not exist.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_runtime.audit.log import now
from sandbox_runtime.audit.records import clip
from sandbox_runtime.config import Settings
from sandbox_runtime.domain.identity import UNNAMED, token_id
from sandbox_runtime.e2b import wire
from sandbox_runtime.e2b.control import ControlPlane, principal_of
from sandbox_runtime.e2b.envd import Envd
from sandbox_runtime.e2b.files import SPOOL_DIR
from sandbox_runtime.e2b.interpreter import CodeInterpreter
from sandbox_runtime.e2b.lifecycle import Sandboxes
from sandbox_runtime.oauth.policy import load_policy, refusal_text
from sandbox_runtime.oauth.scopes import EXECUTE

PREFIX = "/e2b"


class E2BApp:
    """ASGI app of `/e2b/...`; `files` is the signed-URL file app (large transfers)."""

    def __init__(self, settings: Settings, root: Any, files: ASGIApp) -> None:
        self.settings = settings
        self.root = root
        self.files = files
        self.tokens = settings.tokens()
        # With OAuth sign-in, the E2B API's keys are the static tokens alone: none configured
        # means no key works (not the open loopback server's "any key is `default`"), and a
        # key's principal needs the policy's sandbox:execute, as on /mcp.
        self.closed = not self.tokens and bool(settings.oauth_issuers())
        self.policy = load_policy(settings.policy_file) if settings.policy_file else None
        self.sandboxes: Sandboxes | None = None
        self.control: ControlPlane | None = None
        self.envd: Envd | None = None
        self.interpreter: CodeInterpreter | None = None

    def start(self, services: Any) -> None:
        """Called by the app's lifespan once the parts run: the records' store, the sweep of
        timed-out sandboxes."""
        # Multipart uploads a killed server was spooling (the state directory is this
        # process's alone: its lock).
        shutil.rmtree(self.settings.state_dir / SPOOL_DIR, ignore_errors=True)
        self.sandboxes = Sandboxes(services)
        self.control = ControlPlane(
            self.sandboxes, self.settings.memory_mb, self.settings.workspace_mb
        )
        self.envd = Envd(services, self.files)
        self.interpreter = CodeInterpreter(services)
        self.sandboxes.start()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"][len(PREFIX) :] or "/"
        scope = dict(scope, path=path, root_path=scope.get("root_path", "") + PREFIX)
        request = Request(scope, receive)
        if not self.root.running or not self.root.services.audit.enabled:
            await (await self._answer(request, path))(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def sending(message: Message) -> None:  # (the status, whatever answers)
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await (await self._answer(request, path))(scope, receive, sending)
        finally:
            self._audit(request, path, status, started)

    def _audit(self, request: Request, path: str, status: int, started: float) -> None:
        """One audit line per E2B API call: who (the API key's principal, or the sandbox's
        owner for envd and the interpreter), the key's or the sandbox token's id (never the
        key), the method and path (no query: it may name files), the status."""
        principal, credential, sandbox_id = getattr(request.state, "caller", (None, "", None))
        self.root.services.audit.write(
            {
                "time": now(),
                "event": "e2b_call",
                "principal": principal,
                "token_id": token_id(credential, "e2b") if credential else UNNAMED,
                "client_id": None,
                "tool": clip(f"{request.method} {path}"),
                "session": None,
                "sandbox_id": sandbox_id,
                "outcome": "ok" if 0 < status < 400 else f"http_{status}",
                "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 1),
            }
        )

    async def _answer(self, request: Request, path: str) -> Any:
        if not self.root.running or self.sandboxes is None or self.control is None:
            return wire.error(503, "the server is starting or stopping; retry shortly")
        sandbox_id = request.headers.get("e2b-sandbox-id")
        if sandbox_id is None:
            if path == "/health" and request.method == "GET":
                return JSONResponse({"status": "ok"})
            principal = None if self.closed else principal_of(request, self.tokens)
            if principal is None:
                return wire.error(
                    401,
                    "invalid API key: send one of this server's tokens as X-API-KEY "
                    "(E2B_API_KEY; `srt-mcp-server token new --e2b` makes one, for "
                    "SANDBOX_AUTH_TOKENS; OAuth access tokens are not E2B keys)",
                )
            if self.policy is not None:
                scopes = self.policy.scopes_of(principal, self.policy.groups_of(principal))
                if scopes is not None and EXECUTE not in scopes:
                    return wire.error(403, refusal_text(EXECUTE, principal, self.policy))
            bearer = request.headers.get("authorization", "").partition(" ")[2].strip()
            request.state.caller = (principal, request.headers.get("x-api-key") or bearer, None)
            return await self.control(request, path, principal)
        port = request.headers.get("e2b-sandbox-port", str(wire.ENVD_PORT))
        token = request.headers.get("x-access-token", "")
        # E2B's code-interpreter SDKs send no access token to the interpreter's /contexts,
        # but do send the sandbox's traffic access token to all of port 49999: either opens
        # it. envd takes the access token alone.
        traffic = ""
        if port == str(wire.INTERPRETER_PORT):
            traffic = request.headers.get("e2b-traffic-access-token", "")
        if not token and not traffic:
            return wire.error(
                401,
                "missing X-Access-Token: send the sandbox's envdAccessToken (or, to the code "
                "interpreter, its trafficAccessToken as E2B-Traffic-Access-Token)",
            )
        sandbox = await self.sandboxes.by_token(sandbox_id, token, traffic)
        if sandbox is None:  # (the same answer whether it exists or not)
            return _gone(sandbox_id, f"The sandbox {sandbox_id} was not found")
        request.state.caller = (sandbox.principal, token or traffic, sandbox_id)
        if sandbox.state != "running":
            return _gone(sandbox_id, f"The sandbox {sandbox_id} is paused (resume it with connect)")
        if port == str(wire.INTERPRETER_PORT):
            assert self.interpreter is not None
            return await self.interpreter(request, path, sandbox)
        if port != str(wire.ENVD_PORT):
            return JSONResponse(
                {
                    "sandboxId": sandbox_id,
                    "message": f"The sandbox is running but port {port} is not open "
                    "(this server exposes envd, 49983, and the code interpreter, 49999)",
                    "port": port,
                    "code": 502,
                },
                status_code=502,
            )
        assert self.envd is not None
        return await self.envd(request, path, sandbox)


def _gone(sandbox_id: str, message: str) -> JSONResponse:
    """What E2B's proxy answers for a sandbox that is not running (the SDKs read a 502 so)."""
    return JSONResponse({"sandboxId": sandbox_id, "message": message, "code": 502}, status_code=502)
