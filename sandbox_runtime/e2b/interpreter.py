"""The code interpreter's HTTP API (sandbox port 49999): `POST /execute` and `/contexts`.

The wire is E2B's (template/server in e2b-dev/code-interpreter): `POST /execute {code,
context_id?, language?, env_vars?}` answers NDJSON as the call runs (interpreter_stream);
`POST /contexts {language, cwd}` -> `{id, language, cwd}`, `GET /contexts`, `DELETE
/contexts/{id}`, `POST /contexts/{id}/restart`; errors are plain text with E2B's statuses
(the SDKs raise NotFound for a 404, and put the text of any other in their error).

Every call is a `run_code` of ours on the sandbox's session, through the router (so it runs
on the session's home, under its limits, mirrored and listed like any execution); contexts map
onto our interpreters as interpreter_contexts says. Around the user's code run short calls of
the edge's own, queued on the same interpreter in order: a context's setup when it starts (its
working directory, the sandbox's environment variables, E2B's display formatters) and, after a
call with `env_vars`, the variables' removal (E2B's last one call). A Python one takes its own
count back, so the user's cells are numbered as E2B numbers them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from loguru import logger
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sandbox_runtime.e2b.interpreter_contexts import (
    MAX_CWD_CHARS,
    CodeContext,
    ContextRegistry,
    cleanup_code,
    normalize_language,
    setup_code,
)
from sandbox_runtime.e2b.interpreter_stream import (
    KEEPALIVE_SECONDS,
    read_page,
    stream_call,
    timestamp,
)
from sandbox_runtime.e2b.paths import HOME
from sandbox_runtime.e2b.process import E2B_ENV
from sandbox_runtime.e2b.sandboxes import E2BSandbox
from sandbox_runtime.errors import (
    ExecutionNotFoundError,
    InvalidRequestError,
    LimitExceededError,
    PolicyViolationError,
    SandboxRuntimeError,
)
from sandbox_runtime.sandbox import validate_env

MAX_BODY_BYTES = 2 * 1024 * 1024  # code (at most 1 MiB) and env_vars, as JSON
SETUP_TIMEOUT = 60.0
STATUSES = {
    InvalidRequestError: 400,
    PolicyViolationError: 403,
    ExecutionNotFoundError: 404,
    LimitExceededError: 429,
}


def text(status: int, message: str) -> PlainTextResponse:
    return PlainTextResponse(message, status_code=status)


async def read_json(request: Request) -> dict[str, Any] | Response:
    """The request's JSON object, read within MAX_BODY_BYTES (a 413 past it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return text(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return text(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        return text(400, "the request body is not JSON")
    if not isinstance(parsed, dict):
        return text(400, "the request body must be a JSON object")
    return parsed


class CodeInterpreter:
    """The interpreter API of every sandbox this replica serves (one per process)."""

    def __init__(self, services: Any) -> None:
        self.services = services
        self.router = services.router
        self.contexts = ContextRegistry(HOME)

    async def __call__(self, request: Request, path: str, sandbox: E2BSandbox) -> Response:
        method = request.method
        try:
            if path == "/health" and method == "GET":
                return JSONResponse("OK")
            if path == "/execute" and method == "POST":
                return await self.execute(request, sandbox)
            if path == "/contexts" and method == "POST":
                return await self.create_context(request, sandbox)
            if path == "/contexts" and method == "GET":
                listed = self.contexts.of(sandbox.sandbox_id).listed()
                return JSONResponse([c.wire() for c in listed])
            parts = path.strip("/").split("/")
            if len(parts) in (2, 3) and parts[0] == "contexts":
                context = self.contexts.of(sandbox.sandbox_id).by_id.get(parts[1])
                if context is None:
                    return text(404, f"Context {parts[1]} not found")
                if len(parts) == 2 and method == "DELETE":
                    return await self.remove_context(sandbox, context)
                if parts[2:] == ["restart"] and method == "POST":
                    return await self.restart_context(sandbox, context)
            return text(404, f"no {method} {path} on the code interpreter")
        except SandboxRuntimeError as exc:
            status = next((s for t, s in STATUSES.items() if isinstance(exc, t)), 503)
            return text(status, str(exc))

    # -- execute --------------------------------------------------------------------------

    async def execute(self, request: Request, sandbox: E2BSandbox) -> Response:
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        code, context_id, language = body.get("code"), body.get("context_id"), body.get("language")
        if not isinstance(code, str):
            return text(400, "code must be a string")
        if context_id and language:
            return text(400, "Only one of context_id or language can be provided")
        contexts = self.contexts.of(sandbox.sandbox_id)
        if context_id:
            context = contexts.by_id.get(context_id) if isinstance(context_id, str) else None
            if context is None:
                return text(404, f"Context {context_id} not found")
        else:
            name = normalize_language(language)
            await self.check_language(sandbox, name)
            context = contexts.default(name)
        env = validate_env(body.get("env_vars") or None)
        first: list[dict[str, Any]] = []
        if not context.prepared or env:
            full = not context.prepared
            reset = await self.queue(sandbox, context, self.setup(sandbox, context, env))
            # (an interpreter that started afresh under an env-only setup lacks the rest)
            context.prepared = full or reset is None
            if reset not in (None, "first_call"):
                first.append(reset_note(reset))
        started = await self.call(sandbox, context, code, self.services.settings.max_timeout)
        if env:  # (queued behind the call: it runs whatever becomes of the stream)
            restore = cleanup_code(context.language, env, sandbox_env(sandbox))
            try:
                await self.queue(sandbox, context, restore)
            except SandboxRuntimeError as exc:  # (the call itself is queued: stream it)
                logger.warning("e2b env_vars not taken back: {}", exc)
        reset = (started.get("state_reset") or {}).get("reason")
        if reset is not None:  # (it started afresh under the call: set up again next time)
            context.prepared = False
            first.append(reset_note(reset))
        execution_id = started["execution_id"]
        executions = self.router.executions
        owner = sandbox.owner

        async def refuse_input() -> None:
            await executions.cancel(owner, execution_id)

        def abandoned() -> None:
            logger.info("e2b execute stream abandoned: interrupting {}", execution_id)
            self.services.supervisor.spawn(
                f"interrupt abandoned e2b call {execution_id}", self.interrupt(owner, execution_id)
            )

        wait = min(KEEPALIVE_SECONDS, self.services.settings.max_wait)
        lines = stream_call(
            executions.read_output, owner, execution_id, first, refuse_input, abandoned, wait
        )
        return StreamingResponse(lines, media_type="application/x-ndjson")

    async def interrupt(self, owner: Any, execution_id: str) -> None:
        try:
            await self.router.executions.cancel(owner, execution_id)
        except SandboxRuntimeError as exc:
            logger.info("interrupting abandoned call {} failed: {}", execution_id, exc)

    def setup(self, sandbox: E2BSandbox, context: CodeContext, env: dict[str, str]) -> str:
        """A context's setup (all of it when it has not run in its interpreter yet), with
        this call's environment variables."""
        variables = {**sandbox_env(sandbox), **env}
        return setup_code(context, variables, full=not context.prepared)

    async def call(
        self, sandbox: E2BSandbox, context: CodeContext, code: str, seconds: float
    ) -> dict[str, Any]:
        """Queue `code` on the context's interpreter; run_code's answer (no waiting)."""
        args = {
            "code": code,
            "language": context.interpreter,
            "timeout_seconds": seconds,
            "sandbox_config": sandbox.sandbox_config(),  # (no network: allow_internet_access)
        }
        return await self.router.run(sandbox.owner, "run_code", args)

    async def queue(self, sandbox: E2BSandbox, context: CodeContext, code: str) -> str | None:
        """Queue one of the edge's own calls; the interpreter's state_reset reason, if any."""
        if not code:
            return None
        started = await self.call(sandbox, context, code, SETUP_TIMEOUT)
        return (started.get("state_reset") or {}).get("reason")

    async def check_language(self, sandbox: E2BSandbox, language: str) -> None:
        """Raises InvalidRequestError for a language this server's runtime lacks."""
        known = [entry["language"] for entry in self.services.interpreters.languages(sandbox.owner)]
        if known and language not in known:
            raise InvalidRequestError(
                f"language {language!r} is not available on this server; one of "
                f"{', '.join(sorted(known))}"
            )

    # -- contexts -------------------------------------------------------------------------

    async def create_context(self, request: Request, sandbox: E2BSandbox) -> Response:
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        language = normalize_language(body.get("language"))
        cwd = body.get("cwd") or HOME
        if not isinstance(cwd, str) or len(cwd) > MAX_CWD_CHARS or "\x00" in cwd:
            return text(400, f"cwd must be a path of at most {MAX_CWD_CHARS} characters")
        await self.check_language(sandbox, language)
        try:
            context = self.contexts.create(sandbox.sandbox_id, language, cwd)
        except ValueError as exc:
            return text(429, str(exc))
        failed = await self.start(sandbox, context)
        if failed is not None:
            self.contexts.of(sandbox.sandbox_id).by_id.pop(context.context_id, None)
            await self.stop(sandbox, context)
            return text(500, f"Failed to set working directory: {failed}")
        return JSONResponse(context.wire())

    async def start(self, sandbox: E2BSandbox, context: CodeContext) -> str | None:
        """Run a context's setup in its interpreter and wait for it; why it failed, or None."""
        code = setup_code(context, sandbox_env(sandbox), full=True)
        started = await self.call(sandbox, context, code, SETUP_TIMEOUT)
        executions, owner = self.router.executions, sandbox.owner
        after, error = 0, None
        while True:
            page = await read_page(
                executions.read_output, owner, started["execution_id"], after, 5.0
            )
            for event in page.events:
                if event.type == "exception" and error is None:
                    error = f"{event.name}: {event.value}"
            after = max(after, page.next_cursor)
            if page.info.status.finished and not page.has_more:
                break
        if error is None and page.info.status.value != "completed":
            error = page.info.error or page.info.status.value
        context.prepared = error is None
        return error

    async def stop(self, sandbox: E2BSandbox, context: CodeContext) -> None:
        await self.router.run(sandbox.owner, "stop_interpreter", {"language": context.interpreter})

    async def remove_context(self, sandbox: E2BSandbox, context: CodeContext) -> Response:
        await self.stop(sandbox, context)
        contexts = self.contexts.of(sandbox.sandbox_id)
        contexts.by_id.pop(context.context_id, None)
        if contexts.defaults.get(context.language) == context.context_id:
            del contexts.defaults[context.language]
        return JSONResponse(None)

    async def restart_context(self, sandbox: E2BSandbox, context: CodeContext) -> Response:
        args = {"language": context.interpreter, "sandbox_config": sandbox.sandbox_config()}
        await self.router.run(sandbox.owner, "restart_interpreter", args)
        context.prepared = False
        failed = await self.start(sandbox, context)
        if failed is not None:
            return text(500, f"Failed to restart context {context.context_id}: {failed}")
        return JSONResponse(None)


def sandbox_env(sandbox: E2BSandbox) -> dict[str, str]:
    """What every context of the sandbox has in its environment: what E2B's sandboxes set
    (HOME=/home/user, USER=user, as its commands here), then the sandbox's own variables."""
    try:
        return {**E2B_ENV, **validate_env(sandbox.env_vars or None)}
    except InvalidRequestError:
        return dict(E2B_ENV)


def reset_note(reason: str) -> dict[str, Any]:
    """A stderr line telling the caller that the context's state is gone (E2B has no field
    for it; its own kernels do not restart under a caller)."""
    return {
        "type": "stderr",
        "text": f"[sandbox: this context's interpreter started afresh ({reason}): variables "
        "and imports of earlier calls are gone]\n",
        "timestamp": timestamp(time.time()),
    }
