"""Shapes of E2B's control-plane wire: errors, sandbox bodies, templates, times."""

from __future__ import annotations

import datetime as dt
from typing import Any

from starlette.responses import JSONResponse

from sandbox_runtime.e2b.sandboxes import E2BSandbox

ENVD_VERSION = "0.5.7"  # stdin, CloseStdin and octet-stream uploads; no file metadata (0.6.2)
ENVD_PORT = 49983
INTERPRETER_PORT = 49999
# Templates we run, and the names they are known by (E2B's public templates and aliases).
TEMPLATES = {
    "base": "base",
    "e2b/base": "base",
    "code-interpreter-v1": "code-interpreter-v1",
    "code-interpreter": "code-interpreter-v1",
    "e2b/code-interpreter-v1": "code-interpreter-v1",
    "code-interpreter-beta": "code-interpreter-v1",
}
CPU_COUNT = 2
MEMORY_NOTE = "memory is not kept across pause/resume: processes and interpreter state restart"


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """E2B's error body, `{code, message}` (code: the HTTP status)."""
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def unsupported(feature: str) -> JSONResponse:
    return error(501, f"{feature} is not supported by this server (sandbox_runtime's E2B API)")


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


def template_of(name: object) -> str | None:
    """Our template for an E2B template id or alias (a `:tag` suffix ignored), or None."""
    if not isinstance(name, str):
        return None
    return TEMPLATES.get(name.split(":", 1)[0].strip().lower())


def created(sandbox: E2BSandbox) -> dict[str, Any]:
    """The body of a create (201) or connect/resume answer."""
    return {
        "templateID": sandbox.template,
        "sandboxID": sandbox.sandbox_id,
        "alias": sandbox.alias,
        "clientID": "sandbox-runtime",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": sandbox.access_token,
        "trafficAccessToken": sandbox.traffic_token or None,
        "domain": None,
    }


def listed(sandbox: E2BSandbox, memory_mb: int, disk_mb: int) -> dict[str, Any]:
    return {
        "templateID": sandbox.template,
        "alias": sandbox.alias,
        "sandboxID": sandbox.sandbox_id,
        "clientID": "sandbox-runtime",
        "startedAt": iso(sandbox.started_at),
        "endAt": iso(sandbox.end_at),
        "cpuCount": CPU_COUNT,
        "memoryMB": memory_mb,
        "diskSizeMB": disk_mb,
        "metadata": sandbox.metadata,
        "state": sandbox.state,
        "envdVersion": ENVD_VERSION,
    }


def detail(sandbox: E2BSandbox, memory_mb: int, disk_mb: int) -> dict[str, Any]:
    return {
        **listed(sandbox, memory_mb, disk_mb),
        "envdAccessToken": sandbox.access_token,
        "domain": None,
        "allowInternetAccess": sandbox.allow_internet,
        "lifecycle": {"autoResume": False, "onTimeout": "pause" if sandbox.auto_pause else "kill"},
        # (not E2B's: says what a resume brings back)
        "pauseMode": "filesystem",
        "note": MEMORY_NOTE,
    }
