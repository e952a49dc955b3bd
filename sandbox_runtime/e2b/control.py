"""E2B's control plane (`X-API-KEY`): sandboxes created, found, listed, timed, paused, killed.

Paths are those of E2B's API (spec/openapi.yml), v1 and v2 (the Python SDK moved to
`POST /v2/sandboxes` in 2.51). What E2B has and we do not (templates built by API, volumes,
network rules, MCP gateway, metrics, logs, snapshots by API, forks, secrets) answers a 501
`{code, message}` naming the feature.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sandbox_runtime.e2b import wire
from sandbox_runtime.e2b.lifecycle import (
    DEFAULT_TIMEOUT_SECONDS,
    Sandboxes,
    SandboxGoneError,
    checked_map,
    checked_timeout,
)
from sandbox_runtime.e2b.sandboxes import E2BSandbox
from sandbox_runtime.errors import (
    InvalidRequestError,
    LimitExceededError,
    OwnerUnavailableError,
    SandboxRuntimeError,
)

MAX_BODY = 256 * 1024
SANDBOX_PATH = re.compile(r"/(?:v2/)?sandboxes/([^/]+)(?:/([a-z]+))?")
UNSUPPORTED_PREFIXES = {
    "/templates": "building or managing templates",
    "/v2/templates": "building or managing templates",
    "/v3/templates": "building or managing templates",
    "/volumes": "volumes",
    "/secrets": "secrets by API",
    "/snapshots": "snapshots by API",
    "/teams": "teams",
    "/admin": "admin endpoints",
    "/access-tokens": "access tokens",
    "/api-keys": "API keys by API",
}
UNSUPPORTED_ACTIONS = {
    "metrics": "sandbox metrics",
    "logs": "sandbox logs",
    "fork": "forking a sandbox",
    "snapshots": "snapshots by API",
    "network": "changing a sandbox's network rules",
}


async def body_of(request: Request) -> dict[str, Any]:
    """The request's JSON object (empty body: {}). Raises InvalidRequestError."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise InvalidRequestError(f"the request body is over {MAX_BODY} bytes")
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise InvalidRequestError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


class ControlPlane:
    def __init__(self, sandboxes: Sandboxes, memory_mb: int, disk_mb: int) -> None:
        self.sandboxes = sandboxes
        self.memory_mb = memory_mb
        self.disk_mb = disk_mb

    async def __call__(self, request: Request, path: str, principal: str) -> Response:
        try:
            return await self._route(request, path, principal)
        except SandboxGoneError as exc:
            return wire.error(404, f"sandbox {exc} not found (it was killed meanwhile)")
        except LimitExceededError as exc:
            return wire.error(429, str(exc))
        except InvalidRequestError as exc:
            return wire.error(400, str(exc))
        except OwnerUnavailableError as exc:
            return wire.error(503, str(exc))
        except SandboxRuntimeError as exc:
            return wire.error(500, str(exc))

    async def _route(self, request: Request, path: str, principal: str) -> Response:
        method = request.method
        if path in ("/sandboxes", "/v2/sandboxes"):
            if method == "POST":
                return await self.create(request, principal)
            if method == "GET":
                return await self.list(request, principal, v2=path.startswith("/v2"))
            return wire.error(405, "GET or POST")
        if path == "/sandboxes/metrics":
            return wire.unsupported("sandbox metrics")
        if (m := SANDBOX_PATH.fullmatch(path)) is not None:
            return await self.one(request, m.group(1), m.group(2), principal)
        for prefix, feature in UNSUPPORTED_PREFIXES.items():
            if path == prefix or path.startswith(prefix + "/"):
                return wire.unsupported(feature)
        return wire.error(404, f"no such endpoint: {method} {path}")

    async def create(self, request: Request, principal: str) -> Response:
        body = await body_of(request)
        name = body.get("templateID")
        template = wire.template_of(name)
        if template is None:
            return wire.error(
                400,
                f"template {name!r} is not available here: this server runs `base` and "
                "`code-interpreter-v1` (and their aliases) only",
            )
        if body.get("mcp"):
            return wire.unsupported("the MCP gateway")
        if body.get("volumeMounts"):
            return wire.unsupported("volumes")
        network = body.get("network")
        if isinstance(network, dict) and any(
            network.get(k) for k in ("allowOut", "denyOut", "rules", "maskRequestHost")
        ):
            return wire.unsupported("network rules by API (egress follows the server's policy)")
        if body.get("iam"):
            return wire.unsupported("IAM")
        if body.get("secure") is False:
            return wire.unsupported(
                "secure=False (every sandbox here has an envd access token; leave secure on)"
            )
        auto_pause = bool(body.get("autoPause"))
        sandbox = await self.sandboxes.create(
            principal,
            template,
            name if isinstance(name, str) else template,
            checked_timeout(body.get("timeout"), DEFAULT_TIMEOUT_SECONDS),
            checked_map(body.get("metadata"), "metadata"),
            checked_map(body.get("envVars"), "envVars"),
            auto_pause,
            body.get("allow_internet_access") is not False,
        )
        return JSONResponse(wire.created(sandbox), status_code=201)

    async def list(self, request: Request, principal: str, v2: bool) -> Response:
        params = request.query_params
        wanted_meta = _metadata_filter(params.get("metadata") or params.get("query") or "")
        states = set(params.getlist("state")) if v2 else {"running"}
        states = {s for st in states for s in st.split(",") if s} or {"running", "paused"}
        found = [
            s
            for s in await self.sandboxes.list(principal)
            if s.state in states and all(s.metadata.get(k) == v for k, v in wanted_meta.items())
        ]
        found.sort(key=lambda s: (s.started_at, s.sandbox_id))
        start = 0
        token = params.get("nextToken")
        if token:
            ids = [s.sandbox_id for s in found]
            start = ids.index(token) if token in ids else len(found)
        limit = _int(params.get("limit"), 100, 1, 1000)
        page = found[start : start + limit] if v2 else found
        headers = {}
        if v2 and start + limit < len(found):
            headers["X-Next-Token"] = found[start + limit].sandbox_id
        body = [wire.listed(s, self.memory_mb, self.disk_mb) for s in page]
        return JSONResponse(body, headers=headers)

    async def one(
        self, request: Request, sandbox_id: str, action: str | None, principal: str
    ) -> Response:
        method = request.method
        if action in UNSUPPORTED_ACTIONS:
            return wire.unsupported(UNSUPPORTED_ACTIONS[action])
        sandbox = await self.sandboxes.find(principal, sandbox_id)
        if sandbox is None:
            return wire.error(404, f"sandbox {sandbox_id} not found")
        if action is None and method == "GET":
            return JSONResponse(wire.detail(sandbox, self.memory_mb, self.disk_mb))
        if action is None and method == "DELETE":
            await self.sandboxes.kill(sandbox)
            return Response(status_code=204)
        if method != "POST":
            return wire.error(405, "POST")
        body = await body_of(request)
        if action == "timeout":
            if sandbox.state != "running":
                return wire.error(409, f"sandbox {sandbox_id} is paused: resume it first")
            await self.sandboxes.set_timeout(sandbox, checked_timeout(body.get("timeout"), 0))
            return Response(status_code=204)
        if action == "refreshes":
            duration = checked_timeout(body.get("duration"), 60)
            if sandbox.state == "running":
                await self.sandboxes.set_timeout(sandbox, max(duration, _left(sandbox)))
            return Response(status_code=204)
        if action in ("pause", "connect", "resume"):
            async with self.sandboxes.transition(sandbox_id):  # (one at a time, then re-read)
                again = await self.sandboxes.find_live(sandbox_id, principal)
                if again is None:
                    return wire.error(404, f"sandbox {sandbox_id} not found")
                return await self.change(again, action, body)
        return wire.error(404, f"no such endpoint: POST {request.url.path}")

    async def change(self, sandbox: E2BSandbox, action: str, body: dict[str, Any]) -> Response:
        """Pause, resume or connect (which resumes a paused sandbox)."""
        sandbox_id = sandbox.sandbox_id
        if action == "pause":
            if sandbox.state == "paused":
                return wire.error(409, f"sandbox {sandbox_id} is already paused")
            if not self.sandboxes.services.snapshots.enabled:
                return wire.unsupported(
                    "pause (this server keeps no snapshots: SANDBOX_SNAPSHOT_STORE=none)"
                )
            await self.sandboxes.pause(sandbox)
            return Response(status_code=204)
        timeout = checked_timeout(body.get("timeout"), DEFAULT_TIMEOUT_SECONDS)
        sandbox = await self.sandboxes.with_traffic_token(sandbox)
        if sandbox.state == "paused":
            await self.sandboxes.resume(sandbox, timeout)
            return JSONResponse(wire.created(sandbox), status_code=201)
        if action == "resume":
            return wire.error(409, f"sandbox {sandbox_id} is already running")
        if timeout > _left(sandbox):  # (connect only ever lengthens a sandbox's life)
            await self.sandboxes.set_timeout(sandbox, timeout)
        return JSONResponse(wire.created(sandbox), status_code=200)


def _left(sandbox: E2BSandbox) -> int:
    return max(0, int(sandbox.end_at - time.time()))


def _int(text: str | None, default: int, low: int, high: int) -> int:
    try:
        return min(high, max(low, int(text))) if text else default
    except ValueError:
        raise InvalidRequestError(f"not a number: {text!r}") from None


def _metadata_filter(text: str) -> dict[str, str]:
    """`metadata=k1%3Dv1%26k2%3Dv2` (URL-encoded query string) as a dict."""
    if not text:
        return {}
    try:
        return dict(parse_qsl(text, keep_blank_values=True))
    except ValueError:
        raise InvalidRequestError("metadata must be an encoded query string k=v&k2=v2") from None


def principal_of(request: Request, tokens: dict[str, str]) -> str | None:
    """The principal of the request's `X-API-KEY` (or a bearer token); with no tokens
    configured (an open server on loopback) every key is `default`, but one must be sent.
    None: refused. Compared by digest in constant time, as the MCP edge's tokens are."""
    offered = request.headers.get("x-api-key") or ""
    if not offered:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            offered = token.strip()
    if not offered:  # (required even on an open server: a browser cannot send it cross-site
        return None  # without a CORS preflight, which nothing here answers)
    if not tokens:
        return "default"
    digest = hashlib.sha256(offered.encode("utf-8", "surrogatepass")).digest()
    match = None
    for token, principal in tokens.items():
        known = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        if hmac.compare_digest(digest, known):
            match = principal
    return match
