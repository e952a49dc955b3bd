"""stdin and cancel for an execution another replica runs: a signed call to that replica.

The request goes over the cluster transport (channel.py) to CONTROL_PATH on the cluster
listener of the replica that runs the execution (its address is in its heartbeat), and is
answered there (listener.py) once the execution is found running there for the caller's
owner. The call is signed with the cluster secret for that replica, so a request forged,
copied or played again is refused (403) before it is read; the caller waits at most
CONTROL_WAIT_SECONDS for the answer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from sandbox_runtime.domain.models import ExecutionInfo
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import (
    ExecutionFinishedError,
    InvalidRequestError,
    OwnerUnavailableError,
)
from sandbox_runtime.execution.execution import MAX_STDIN_BYTES
from sandbox_runtime.sessions.answers import raise_error_reply
from sandbox_runtime.sessions.channel import ChannelClient
from sandbox_runtime.sessions.written import WITHIN_SECONDS
from sandbox_runtime.state.store import StateStore
from sandbox_runtime.supervisor import outcome

if TYPE_CHECKING:
    from sandbox_runtime.execution.manager import ExecutionManager

CONTROL_WAIT_SECONDS = 5.0  # how long a forwarded stdin/cancel waits for the owner's answer
SERVE_JOB = "control request"  # one served request: it runs to its end if its caller leaves


class ControlChannel:
    """Sends control requests to other replicas and serves the ones sent to this replica."""

    def __init__(
        self, store: StateStore, manager: ExecutionManager, channel: ChannelClient | None
    ) -> None:
        self.store = store
        self.manager = manager
        self.channel = channel  # None: no cluster secret, no other replica can be reached
        self.replica_id = manager.replica_id
        self.metrics = manager.metrics

    # -- sending ------------------------------------------------------------------------------

    async def send(
        self,
        info: ExecutionInfo,
        request: dict[str, Any],
        owner: Owner,
        wait_seconds: float | None = None,
    ) -> dict:
        """Send a control request to the replica that runs `info`; its answer, or raises the
        error it answered with, or OwnerUnavailableError."""
        if info.status.finished:
            raise ExecutionFinishedError(
                f"execution {info.execution_id} has already finished ({info.status.value})"
            )
        op = str(request["op"])
        if self.channel is None:
            self.metrics.control.labels(op, "no_secret").inc()
            raise OwnerUnavailableError(
                f"execution {info.execution_id} runs on replica {info.replica_id}, and this "
                "replica has no SANDBOX_CLUSTER_SECRET to reach it with"
            )
        data = request.get("data")
        if op == "stdin" and isinstance(data, str):
            size = len(data.encode("utf-8", "surrogatepass"))
            if size > MAX_STDIN_BYTES:  # (refused here as there: the call stays bounded)
                raise InvalidRequestError(
                    f"input_data is {size} bytes; at most {MAX_STDIN_BYTES} per call"
                )
        who = f"replica {info.replica_id}, which runs execution {info.execution_id},"
        address, incarnation = await self._address_of(info, op, who)
        call = {
            **request,
            "execution_id": info.execution_id,
            "principal": owner.principal,
            "session_id": owner.session_id,
        }
        try:
            wait = CONTROL_WAIT_SECONDS if wait_seconds is None else wait_seconds
            peer = (info.replica_id, incarnation)
            reply = await self.channel.control(peer, address, call, wait, who)
        except OwnerUnavailableError:
            self.metrics.control.labels(op, "no_answer").inc()
            raise
        if "result" not in reply:
            self.metrics.control.labels(op, "refused").inc()
            error = reply.get("error")
            raise_error_reply(error if isinstance(error, dict) else {})
        self.metrics.control.labels(op, "ok").inc()
        return dict(reply["result"])

    async def _address_of(self, info: ExecutionInfo, op: str, who: str) -> tuple[str, str]:
        """The cluster address and the incarnation in the heartbeat of the replica that runs
        `info`."""
        try:
            beat = await self.store.replica_beat(info.replica_id)
        except Exception as exc:  # the store failed: not the caller's fault
            self.metrics.control.labels(op, "store_error").inc()
            raise OwnerUnavailableError(
                f"could not look up replica {info.replica_id} in the shared store "
                f"({type(exc).__name__}); retry shortly"
            ) from exc
        if beat is None:  # (it stopped heart-beating since: the execution reads lost soon)
            self.metrics.control.labels(op, "no_answer").inc()
            raise OwnerUnavailableError(f"{who} has no heartbeat: it stopped or died")
        address = str(beat.get("cluster_address") or "")
        if not address:
            self.metrics.control.labels(op, "no_address").inc()
            raise OwnerUnavailableError(
                f"{who} has no cluster listener (it runs without SANDBOX_CLUSTER_SECRET?)"
            )
        return address, str(beat.get("incarnation") or "")

    # -- serving ------------------------------------------------------------------------------

    async def serve(self, call: dict[str, Any]) -> dict[str, Any]:
        """Answer a stdin/cancel request another replica sent (its signature was checked):
        the answer's fields, or raises the domain error to answer with. The work runs to its
        end even if the caller stops waiting (a cancel half done would leave a tree running).
        """
        work = self.manager.supervisor.spawn(SERVE_JOB, outcome(self._handle(call)))
        answer = await asyncio.shield(work)
        if isinstance(answer, Exception):  # (the refusal to answer with: not a failure here)
            raise answer
        return answer

    async def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        owner = Owner(str(request.get("principal")), str(request.get("session_id")))
        execution_id = str(request.get("execution_id"))
        op = request.get("op")
        self.metrics.control_served.labels(str(op)).inc()
        execution = self.manager.get(owner, execution_id)  # running here, and the owner's
        if op == "stdin":
            written = await self.manager.write_stdin(
                execution, str(request.get("data", "")), bool(request.get("close"))
            )
            return {"bytes_written": written, "info": execution.info.model_dump(mode="json")}
        if op == "read":  # (a long-poll: answered from memory as soon as there is news)
            page = await self.manager.read_output(
                owner,
                execution_id,
                request.get("after", 0),
                request.get("limit", 1000),
                request.get("wait", 0),
            )
            if page.info.status.finished:  # (the caller's next read may be from the store)
                await self.manager.cluster.written(execution, WITHIN_SECONDS)
            return {
                "info": page.info.model_dump(mode="json"),
                "events": [event.model_dump(mode="json") for event in page.events],
                "next_cursor": page.next_cursor,
                "has_more": page.has_more,
                "first_available": page.first_available,
            }
        if op == "cancel":
            was_finished = await self.manager.cancel_local(execution, bool(request.get("force")))
            await self.manager.cluster.written(execution, WITHIN_SECONDS)
            return {"was_finished": was_finished, "info": execution.info.model_dump(mode="json")}
        raise InvalidRequestError(f"unknown control operation {op!r}")
