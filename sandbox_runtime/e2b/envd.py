"""envd (sandbox port 49983): `GET /health`, `/files`, and the Connect services
`process.Process` and `filesystem.Filesystem`, over the sandbox's session of ours."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from sandbox_runtime.e2b import connect
from sandbox_runtime.e2b.files import FilesEndpoint
from sandbox_runtime.e2b.filesystem import FilesystemService
from sandbox_runtime.e2b.process import ProcessService
from sandbox_runtime.e2b.sandboxes import E2BSandbox


class Envd:
    def __init__(self, services: Any, files: ASGIApp) -> None:
        self.services = services
        self.files = files
        self.methods: dict[str, connect.Method] = {
            **ProcessService(services).methods(),
            **FilesystemService(services).methods(),
        }
        self.files_endpoint = FilesEndpoint(services, files)

    async def __call__(self, request: Request, path: str, sandbox: E2BSandbox) -> Any:
        if path == "/health":
            return Response(status_code=204)
        if path == "/files":
            return await self.files_endpoint(request, sandbox)
        method = self.methods.get(path)
        if method is not None:
            return await connect.serve(request, method, sandbox)
        if path.startswith(("/process.Process/", "/filesystem.Filesystem/")):
            return connect.error_response("unimplemented", f"{path[1:]} is not implemented")
        return Response(f"no such envd endpoint: {path}\n", status_code=404)
