"""stdin and cancel for an execution another replica runs: signed messages through Redis.

Each replica pops its own control list (`replica:{rid}:control`) and answers on a per-request
reply list. Requests and replies carry a proof made with the cluster secret (signing.py): a
message written into Redis by anyone else, or a copy of a real one played again, is dropped
and counted, never acted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any

from loguru import logger

from sandbox_runtime.domain.models import ExecutionInfo
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import (
    DiskFullError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    FileAccessError,
    FileMissingError,
    InvalidRequestError,
    LimitExceededError,
    OwnerUnavailableError,
    PolicyViolationError,
    SandboxRuntimeError,
    SandboxSpawnError,
    SandboxUnavailableError,
    WorkspaceDamagedError,
    WorkspaceFullError,
)
from sandbox_runtime.sessions.signing import ClusterSigner, SignatureError
from sandbox_runtime.state.store import StateStore

if TYPE_CHECKING:
    from sandbox_runtime.execution.manager import ExecutionManager

CONTROL_WAIT_SECONDS = 5.0  # how long a forwarded stdin/cancel waits for the owner's answer

# Errors a replica may answer with, by name (control replies and forwarded calls).
ERRORS: dict[str, type[SandboxRuntimeError]] = {
    cls.__name__: cls
    for cls in (
        DiskFullError,
        ExecutionFinishedError,
        ExecutionNotFoundError,
        FileAccessError,
        FileMissingError,
        InvalidRequestError,
        LimitExceededError,
        OwnerUnavailableError,
        PolicyViolationError,
        SandboxRuntimeError,
        SandboxSpawnError,
        SandboxUnavailableError,
        WorkspaceDamagedError,
        WorkspaceFullError,
    )
}


def error_reply(exc: SandboxRuntimeError) -> dict[str, Any]:
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)}


def raise_error_reply(reply: dict[str, Any]) -> None:
    """Raise the domain error a replica answered with (unknown names: the root error)."""
    error = ERRORS.get(str(reply.get("error")), SandboxRuntimeError)
    raise error(str(reply.get("message", "the owning replica refused the request")))


SERVE_LOOP = "control requests"


class ControlChannel:
    """Sends control requests to other replicas and serves the ones sent to this replica."""

    def __init__(
        self,
        store: StateStore,
        manager: ExecutionManager,
        signer: ClusterSigner | None,
    ) -> None:
        self.store = store
        self.manager = manager
        self.signer = signer
        self.replica_id = manager.replica_id
        self.metrics = manager.metrics
        self._serving = False
        self._answering: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.manager.supervisor.run(SERVE_LOOP, self._serve_forever)
        self._serving = True

    async def aclose(self) -> None:
        if self._serving:
            await self.manager.supervisor.stop(SERVE_LOOP)
            self._serving = False
        for task in self._answering:
            task.cancel()
        if self._answering:
            await asyncio.wait(self._answering, timeout=2)

    # -- sending ------------------------------------------------------------------------------

    async def send(self, info: ExecutionInfo, request: dict[str, Any], owner: Owner) -> dict:
        """Send a control request to the replica that runs `info`; its answer, or raises the
        error it answered with, or OwnerUnavailableError."""
        if info.status.finished:
            raise ExecutionFinishedError(
                f"execution {info.execution_id} has already finished ({info.status.value})"
            )
        op = str(request["op"])
        if self.signer is None:
            self.metrics.control.labels(op, "no_secret").inc()
            raise OwnerUnavailableError(
                f"execution {info.execution_id} runs on replica {info.replica_id}, and this "
                "replica has no SANDBOX_CLUSTER_SECRET to reach it with"
            )
        request_id = uuid.uuid4().hex
        message = self.signer.sign_message(
            info.replica_id,
            {
                **request,
                "request_id": request_id,
                "execution_id": info.execution_id,
                "principal": owner.principal,
                "session_id": owner.session_id,
                "from_replica": self.replica_id,
                "to_replica": info.replica_id,
                "deadline": time.time() + CONTROL_WAIT_SECONDS,
            },
        )
        try:
            reply = await self.store.send_control(info.replica_id, message, CONTROL_WAIT_SECONDS)
        except Exception as exc:  # the store failed: not the caller's fault
            self.metrics.control.labels(op, "store_error").inc()
            raise OwnerUnavailableError(
                f"could not reach replica {info.replica_id} through the shared store "
                f"({type(exc).__name__}); retry shortly"
            ) from exc
        if reply is not None:
            try:
                self.signer.verify_message(reply)
                if reply.get("request_id") != request_id:
                    raise SignatureError("a reply to another request")
            except SignatureError as exc:
                self.metrics.control.labels(op, "bad_reply").inc()
                logger.warning("control reply from {} refused: {}", info.replica_id, exc)
                reply = None
        if reply is None:
            self.metrics.control.labels(op, "no_answer").inc()
            raise OwnerUnavailableError(
                f"replica {info.replica_id}, which runs execution {info.execution_id}, did not "
                f"answer within {CONTROL_WAIT_SECONDS:g} s"
            )
        self.metrics.control.labels(op, "ok" if reply.get("ok") else "refused").inc()
        if not reply.get("ok"):
            raise_error_reply(reply)
        return reply

    # -- serving ------------------------------------------------------------------------------

    async def _serve_forever(self) -> None:
        while True:
            try:
                request = await self.store.next_control(self.replica_id, 1.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis down: the heartbeat loop reports it
                await asyncio.sleep(1.0)
                continue
            if request is None:
                continue
            if not self._accept(request):
                continue
            task = asyncio.get_running_loop().create_task(self._answer(request))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    def _accept(self, request: Any) -> bool:
        """Whether a popped request is genuine, fresh, for us and still wanted."""
        reason = None
        if self.signer is None:
            reason = "this replica has no cluster secret"
        else:
            try:
                self.signer.verify_message(request)
            except SignatureError as exc:
                reason = str(exc)
        if reason is None and request.get("to_replica") != self.replica_id:
            reason = "addressed to another replica"
        if reason is not None:
            self.metrics.control_refused.inc()
            logger.warning("control message refused: {}", reason)
            return False
        deadline = request.get("deadline")
        return isinstance(deadline, int | float) and deadline >= time.time()

    async def _answer(self, request: dict[str, Any]) -> None:
        try:
            reply = await self._handle(request)
        except Exception as exc:  # answer with the error rather than leave the caller waiting
            logger.exception("control request failed")
            reply = {"ok": False, "error": "SandboxRuntimeError", "message": str(exc)}
        assert self.signer is not None
        reply = self.signer.sign_message(
            str(request.get("from_replica")), {**reply, "request_id": request["request_id"]}
        )
        with contextlib.suppress(Exception):
            await self.store.reply_control(str(request["request_id"]), reply)

    async def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer a stdin/cancel request forwarded by another replica."""
        owner = Owner(str(request.get("principal")), str(request.get("session_id")))
        execution_id = str(request.get("execution_id"))
        op = request.get("op")
        self.metrics.control_served.labels(str(op)).inc()
        try:
            execution = self.manager.get(owner, execution_id)
            if op == "stdin":
                written = await self.manager.write_stdin(
                    execution, str(request.get("data", "")), bool(request.get("close"))
                )
                return {
                    "ok": True,
                    "bytes_written": written,
                    "info": execution.info.model_dump(mode="json"),
                }
            if op == "cancel":
                was_finished = await self.manager.cancel_local(
                    execution, bool(request.get("force"))
                )
                return {
                    "ok": True,
                    "was_finished": was_finished,
                    "info": execution.info.model_dump(mode="json"),
                }
            raise InvalidRequestError(f"unknown control operation {op!r}")
        except SandboxRuntimeError as exc:
            return error_reply(exc)
