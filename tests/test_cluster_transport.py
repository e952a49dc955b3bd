"""The one cluster transport, in process: control of another replica's executions.

A real ClusterApp (the cluster listener's app) under a real uvicorn on a loopback port, a real
ChannelClient and ControlChannel on the calling side, the shared store in memory; the
executions are stand-ins (no sandbox), so these run without bwrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest
import uvicorn

from sandbox_runtime.domain.models import ExecutionInfo, ExecutionStatus
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import (
    ExecutionFinishedError,
    ExecutionNotFoundError,
    InvalidRequestError,
    OwnerUnavailableError,
)
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.server.heads import HeadTimeoutProtocol
from sandbox_runtime.sessions import control as control_module
from sandbox_runtime.sessions import listener as listener_module
from sandbox_runtime.sessions import signing
from sandbox_runtime.sessions.channel import CALL_PATH, CONTROL_PATH, ChannelClient, HomeMovedError
from sandbox_runtime.sessions.control import ControlChannel
from sandbox_runtime.sessions.listener import MAX_QUEUED_PROGRESS, ClusterApp
from sandbox_runtime.sessions.signing import ClusterSigner
from sandbox_runtime.state.store import Beat, MemoryStore
from sandbox_runtime.supervisor import Supervisor

# (A real uvicorn on a loopback port for each test: integration, out of the `-m unit` loop.)
pytestmark = pytest.mark.integration

SECRET = "the-cluster-secret-of-these-tests"
OWNER = Owner("alice", "s:one")
INCARNATION = "a0" * 16  # replica A's process, in its heartbeat
HEAD_TIMEOUT = 0.5  # the listener's, shortened for these tests


@dataclass
class FakeExecution:
    info: ExecutionInfo
    owner: Owner
    stdin: list[str] = field(default_factory=list)
    cancelled: list[bool] = field(default_factory=list)


class FakeCluster:
    """What ControlChannel waits on: the mirror's write of an execution (here at once)."""

    def __init__(self) -> None:
        self.waited: list[str] = []  # the execution ids a control call waited to be written

    async def written(self, execution: FakeExecution, within: float) -> None:
        assert within > 0
        self.waited.append(execution.info.execution_id)


class FakeManager:
    """What ControlChannel uses of an ExecutionManager, with executions that need no sandbox."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.metrics = Metrics()
        self.supervisor = Supervisor()
        self.executions: dict[str, FakeExecution] = {}
        self.cancel_takes = 0.0
        self.cluster = FakeCluster()

    def start(self, owner: Owner = OWNER) -> FakeExecution:
        info = info_on(self.replica_id, owner)
        execution = FakeExecution(info, owner)
        self.executions[info.execution_id] = execution
        return execution

    def get(self, owner: Owner, execution_id: str) -> FakeExecution:
        execution = self.executions.get(execution_id)
        if execution is None or execution.owner != owner:
            raise ExecutionNotFoundError(f"execution {execution_id} not found")
        return execution

    async def write_stdin(self, execution: FakeExecution, data: str, close: bool) -> int:
        if len(data) > 10:
            raise InvalidRequestError(f"input_data is {len(data)} bytes; at most 10 per call")
        execution.stdin.append(data)
        if close:
            execution.info.stdin_open = False
        return len(data.encode())

    async def cancel_local(self, execution: FakeExecution, force: bool) -> bool:
        await asyncio.sleep(self.cancel_takes)
        was_finished = execution.info.status.finished
        execution.cancelled.append(force)
        execution.info.status = ExecutionStatus.CANCELLED
        return was_finished


def info_on(replica_id: str, owner: Owner = OWNER) -> ExecutionInfo:
    return ExecutionInfo(
        execution_id=uuid.uuid4().hex,
        status=ExecutionStatus.RUNNING,
        principal=owner.principal,
        session_id=owner.session_id,
        replica_id=replica_id,
        command="cat",
        timeout_seconds=30,
        created_at=time.time(),
        interactive=True,
        stdin_open=True,
    )


@dataclass
class Served:
    """The cluster listener's side of replica A (what the Router gives it)."""

    signer: ClusterSigner | None
    control: ControlChannel | None

    async def serve_forwarded(self, call: dict[str, Any], progress: Any) -> dict[str, Any]:
        for seq in range(int(call.get("progress", 0) and call.get("lines", 0))):
            await progress(seq, "x" * 100)  # (all at once: the caller has read none yet)
        return {"echo": call.get("op")}


@dataclass
class Pair:
    store: MemoryStore
    owner_manager: FakeManager  # replica A: runs the executions
    caller: ControlChannel  # replica B: controls them
    caller_manager: FakeManager
    address: str
    channel: ChannelClient  # replica B's
    clients: list[tuple[str, int]]  # each request's (host, port) at the listener, in order
    cut: list[bool]  # [True]: the listener drops the next request's connection unanswered
    cluster: ClusterApp
    served: Served


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    store = MemoryStore()
    a, b = FakeManager("ra"), FakeManager("rb")
    served_control = ControlChannel(store, a, ChannelClient(ClusterSigner(SECRET, "ra")))  # type: ignore[arg-type]
    # (One signer: its nonces; its process is INCARNATION.)
    served = Served(ClusterSigner(SECRET, "ra", INCARNATION), served_control)
    cluster = ClusterApp(lambda: served)
    clients: list[tuple[str, int]] = []
    cut: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            clients.append(tuple(scope["client"]))
            if cut and cut.pop():  # (as a listener closing its idle connections would)
                for connection in list(server.server_state.connections):
                    connection.transport.abort()
                return
        await cluster(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    protocol = type("ShortHeads", (HeadTimeoutProtocol,), {"head_timeout": HEAD_TIMEOUT})
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", http=protocol))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    await store.write([], Beat("ra", {"cluster_address": address, "incarnation": INCARNATION}, 30))
    channel = ChannelClient(ClusterSigner(SECRET, "rb"))
    caller = ControlChannel(store, b, channel)  # type: ignore[arg-type]
    try:
        yield Pair(store, a, caller, b, address, channel, clients, cut, cluster, served)
    finally:
        await channel.aclose()
        server.should_exit = True
        await serving
        await a.supervisor.aclose()
        sock.close()


def count(manager: FakeManager, op: str, result: str) -> float:
    value = manager.metrics.registry.get_sample_value(
        "srt_control_forwarded_total", {"op": op, "result": result}
    )
    return value or 0.0


async def test_stdin_and_cancel_reach_the_execution_on_the_other_replica(pair: Pair) -> None:
    execution = pair.owner_manager.start()
    reply = await pair.caller.send(execution.info, {"op": "stdin", "data": "hé\n"}, OWNER)
    assert reply["bytes_written"] == len("hé\n".encode())
    assert ExecutionInfo.model_validate(reply["info"]).execution_id == execution.info.execution_id
    assert execution.stdin == ["hé\n"]
    reply = await pair.caller.send(execution.info, {"op": "cancel", "force": True}, OWNER)
    assert reply["was_finished"] is False and execution.cancelled == [True]
    assert ExecutionInfo.model_validate(reply["info"]).status is ExecutionStatus.CANCELLED
    # (answered once the owner's mirror wrote the cancel, so the caller's next read sees it)
    assert pair.owner_manager.cluster.waited == [execution.info.execution_id]
    assert count(pair.caller_manager, "stdin", "ok") == count(pair.caller_manager, "cancel", "ok")
    assert count(pair.caller_manager, "cancel", "ok") == 1


async def test_calls_and_control_go_down_one_kept_alive_connection(pair: Pair) -> None:
    """An answer ends its response in the same write and the caller reads the response to its
    end: the next call reuses the connection (a new one per call cost each forwarded call a
    connect and the listener a new connection)."""
    for n in range(5):
        reply = await pair.channel.call("ra", pair.address, INCARNATION, {"op": f"op{n}"}, None, 5)
        assert reply == {"echo": f"op{n}"}
    execution = pair.owner_manager.start()
    for _ in range(3):
        await pair.caller.send(execution.info, {"op": "stdin", "data": "a"}, OWNER)
    assert execution.stdin == ["a"] * 3
    assert len(pair.clients) == 8
    assert len(set(pair.clients)) == 1, f"{len(set(pair.clients))} connections for 8 calls"


async def test_a_connection_closed_under_a_call_before_it_began_is_retried_once(
    pair: Pair,
) -> None:
    """The listener's side of a kept-alive connection closes as a call goes out on it: no
    response began, so nothing ran; the call is sent once more on a new connection. Twice in
    a row is a clear error, not an unknown outcome."""
    assert await pair.channel.call("ra", pair.address, INCARNATION, {"op": "a"}, None, 5) == {
        "echo": "a"
    }
    pair.cut.append(True)
    assert await pair.channel.call("ra", pair.address, INCARNATION, {"op": "b"}, None, 5) == {
        "echo": "b"
    }
    assert len(pair.clients) == 3 and len(set(pair.clients)) == 2  # (the retry: a new one)
    pair.cut.extend([True, True])
    with pytest.raises(OwnerUnavailableError, match=r"broke off before it began.*retry shortly"):
        await pair.channel.call("ra", pair.address, INCARNATION, {"op": "c"}, None, 5)
    assert await pair.channel.call("ra", pair.address, INCARNATION, {"op": "d"}, None, 5) == {
        "echo": "d"
    }


async def test_progress_a_caller_has_not_read_is_bounded_and_the_answer_still_comes(
    pair: Pair,
) -> None:
    seen: list[int] = []

    async def progress(seq: int, text: str) -> None:
        seen.append(seq)

    call = {"op": "flood", "lines": 1000}
    assert await pair.channel.call("ra", pair.address, INCARNATION, call, progress, 5) == {
        "echo": "flood"
    }
    assert seen == list(range(MAX_QUEUED_PROGRESS))


async def test_the_owners_refusal_is_raised_again_on_the_caller(pair: Pair) -> None:
    execution = pair.owner_manager.start()
    with pytest.raises(InvalidRequestError, match="at most 10 per call"):
        await pair.caller.send(execution.info, {"op": "stdin", "data": "x" * 11}, OWNER)
    with pytest.raises(InvalidRequestError, match="unknown control operation"):
        await pair.caller.send(execution.info, {"op": "kill"}, OWNER)
    assert count(pair.caller_manager, "stdin", "refused") == 1


async def test_another_owners_execution_is_not_found_there(pair: Pair) -> None:
    execution = pair.owner_manager.start(Owner("bob", "s:one"))
    info = execution.info.model_copy(update={"principal": "alice"})
    with pytest.raises(ExecutionNotFoundError, match="not found"):
        await pair.caller.send(info, {"op": "cancel", "force": True}, OWNER)
    assert execution.cancelled == []


async def test_stdin_past_the_limit_is_refused_before_it_is_sent(pair: Pair) -> None:
    execution = pair.owner_manager.start()
    big = "x" * (control_module.MAX_STDIN_BYTES + 1)
    with pytest.raises(InvalidRequestError, match="per call"):
        await pair.caller.send(execution.info, {"op": "stdin", "data": big}, OWNER)
    assert execution.stdin == []


async def test_a_finished_execution_is_not_sent_for(pair: Pair) -> None:
    info = info_on("ra").model_copy(update={"status": ExecutionStatus.COMPLETED})
    with pytest.raises(ExecutionFinishedError, match="already finished"):
        await pair.caller.send(info, {"op": "cancel"}, OWNER)


async def test_a_replica_without_a_cluster_listener_is_named(pair: Pair) -> None:
    await pair.store.write([], Beat("rnolistener", {"cluster_address": ""}, 30))
    with pytest.raises(OwnerUnavailableError, match="has no cluster listener"):
        await pair.caller.send(info_on("rnolistener"), {"op": "cancel"}, OWNER)
    assert count(pair.caller_manager, "cancel", "no_address") == 1
    with pytest.raises(OwnerUnavailableError, match="has no heartbeat"):
        await pair.caller.send(info_on("rgone"), {"op": "cancel"}, OWNER)


async def test_without_a_secret_nothing_is_sent(pair: Pair) -> None:
    alone = ControlChannel(pair.store, pair.caller_manager, None)  # type: ignore[arg-type]
    with pytest.raises(OwnerUnavailableError, match="no SANDBOX_CLUSTER_SECRET"):
        await alone.send(info_on("ra"), {"op": "cancel"}, OWNER)


async def test_an_unreachable_replica_is_unavailable_not_not_found(pair: Pair) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    await pair.store.write([], Beat("rdown", {"cluster_address": f"127.0.0.1:{port}"}, 30))
    with pytest.raises(OwnerUnavailableError, match="does not answer"):
        await pair.caller.send(info_on("rdown"), {"op": "cancel"}, OWNER)
    assert count(pair.caller_manager, "cancel", "no_answer") == 1


async def test_the_wait_is_bounded_and_a_cancel_runs_to_its_end_anyway(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_module, "CONTROL_WAIT_SECONDS", 0.3)
    pair.owner_manager.cancel_takes = 1.0
    execution = pair.owner_manager.start()
    started = time.monotonic()
    with pytest.raises(OwnerUnavailableError, match=r"did not answer within 0.3 s"):
        await pair.caller.send(execution.info, {"op": "cancel", "force": True}, OWNER)
    assert time.monotonic() - started < 1.0
    for _ in range(100):  # the caller left; the cancel on the owner still ends
        if execution.cancelled:
            break
        await asyncio.sleep(0.05)
    assert execution.cancelled == [True]


async def post(address: str, path: str, body: bytes, header: str | None) -> httpx2.Response:
    headers = {"x-srt-cluster-signature": header} if header else {}
    async with httpx2.AsyncClient(trust_env=False, timeout=5) as http:
        return await http.post(f"http://{address}{path}", content=body, headers=headers)


def answer_of(response: httpx2.Response) -> dict[str, Any]:
    last = [line for line in response.text.splitlines() if line][-1]
    return dict(json.loads(json.loads(last)["answer"]))


async def test_forged_stale_misdirected_or_replayed_control_calls_are_refused(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    execution = pair.owner_manager.start()
    call = {
        "op": "cancel",
        "force": True,
        "execution_id": execution.info.execution_id,
        "principal": OWNER.principal,
        "session_id": OWNER.session_id,
    }
    body = json.dumps(call).encode()
    signer = ClusterSigner(SECRET, "intruder")
    real = time.time()
    with monkeypatch.context() as m:  # signed ten minutes ago
        m.setattr(signing.time, "time", lambda: real - 600)
        stale = signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, body)
    refused = [
        None,
        "v1,1,abc,def",
        signer.sign_call("ra", INCARNATION, "PUT", CONTROL_PATH, body),
        signer.sign_call("ra", "an-earlier-process", "POST", CONTROL_PATH, body),
        ClusterSigner("a-different-secret-0123456789", "x").sign_call(
            "ra", INCARNATION, "POST", CONTROL_PATH, body
        ),
        signer.sign_call("another-replica", INCARNATION, "POST", CONTROL_PATH, body),
        signer.sign_call(
            "ra", INCARNATION, "POST", CALL_PATH, body
        ),  # a forwarded call's proof, not a control's
        signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, body.replace(b"true", b"false")),
        stale,
    ]
    for header in refused:
        response = await post(pair.address, CONTROL_PATH, body, header)
        assert response.status_code == 403, (header, response.text)
    assert (await post(pair.address, CONTROL_PATH, body, stale)).text.startswith("clock-skew ")
    earlier = signer.sign_call("ra", "an-earlier-process", "POST", CONTROL_PATH, body)
    assert (await post(pair.address, CONTROL_PATH, body, earlier)).text == "restarted\n"
    assert execution.cancelled == [], "a refused call was acted on"
    refusals = pair.owner_manager.metrics.registry.get_sample_value("srt_control_refused_total")
    assert refusals == len(refused) + 2
    genuine = signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, body)
    first = await post(pair.address, CONTROL_PATH, body, genuine)
    assert first.status_code == 200 and answer_of(first)["result"]["was_finished"] is False
    replayed = await post(pair.address, CONTROL_PATH, body, genuine)
    assert replayed.status_code == 403
    assert execution.cancelled == [True], "the replayed cancel was acted on"
    # Another owner's genuine call learns nothing: its id reads as unknown.
    other = json.dumps({**call, "principal": "mallory"}).encode()
    response = await post(
        pair.address,
        CONTROL_PATH,
        other,
        signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, other),
    )
    assert answer_of(response)["error"]["error"] == "ExecutionNotFoundError"


async def test_a_control_call_that_is_too_big_or_cut_short_is_refused(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listener_module, "BODY_TIMEOUT", 0.5)
    signer = ClusterSigner(SECRET, "intruder")
    big = b"x" * (17 * 2**20)
    for length, header, status in (
        # signed for its 17 MiB: refused for its size before a byte of body is read
        (len(big), signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, big), b" 413 "),
        # signed for 2 bytes, 100 MB announced: not the call signed
        (10**8, signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, b"{}"), b" 403 "),
    ):
        answer, _ = await head_only(pair.address, length, header)
        assert status in answer, answer
    # A body that stops coming: its deadline, then 400.
    body = b'{"op": "cancel"}'
    header = signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, body)
    host, port = pair.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"POST {CONTROL_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"x-srt-cluster-signature: {header}\r\n\r\n".encode()
            + body[:5]
        )
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5)
        assert b" 400 " in status, status
    finally:
        writer.close()


async def head_only(address: str, length: int, header: str | None) -> tuple[bytes, bytes]:
    """Send a POST's head announcing `length` bytes of body and none of them: (the status
    line, what followed until the listener closed the connection)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    signature = f"x-srt-cluster-signature: {header}\r\n" if header else ""
    try:
        writer.write(
            f"POST {CONTROL_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
            f"{signature}\r\n".encode()
        )
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5)
        rest = await asyncio.wait_for(reader.read(), 5)  # (b"" at once: closed)
        return status, rest
    finally:
        writer.close()


@pytest.mark.parametrize("length", [0, 1024, 16 * 2**20])
async def test_unsigned_or_forged_calls_are_refused_before_any_body_is_sent(
    pair: Pair, length: int
) -> None:
    """Without the secret a caller gets a refusal while it has sent no byte of its body, and
    the connection is closed: the listener never waits for, reads or holds a body for it."""
    body = b"x" * min(length, 1024)
    genuine = ClusterSigner(SECRET, "rb").sign_call("ra", INCARNATION, "POST", CONTROL_PATH, body)
    forged = genuine.split(",")
    forged[4], forged[5] = str(length), "0" * 64  # (a fresh time, a made-up MAC)
    for header in (None, ",".join(forged)):
        status, rest = await head_only(pair.address, length, header)
        assert b" 403 " in status, status
        assert rest.endswith(b"forbidden\n"), rest
    assert pair.cluster.budget.held == 0


async def test_bodies_read_at_once_are_bounded_across_connections(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body waits for room among those being read (a signed caller's); past the wait, 503."""
    monkeypatch.setattr(listener_module, "BODY_TIMEOUT", 2.0)
    monkeypatch.setattr(listener_module, "ROOM_WAIT_SECONDS", 0.3)
    pair.cluster.budget.limit = 1000
    signer = ClusterSigner(SECRET, "rb")
    body = json.dumps({"op": "cancel", "pad": "x" * 700}).encode()
    host, port = pair.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:  # a genuine call that sends its head and half its body, then stalls
        header = signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, body)
        writer.write(
            f"POST {CONTROL_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"x-srt-cluster-signature: {header}\r\n\r\n".encode()
            + body[:300]
        )
        await writer.drain()
        for _ in range(100):
            if pair.cluster.budget.held:
                break
            await asyncio.sleep(0.01)
        assert pair.cluster.budget.held == len(body)
        second = signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, body)
        response = await post(pair.address, CONTROL_PATH, body, second)
        assert response.status_code == 503 and "too many call bodies" in response.text
        assert b" 400 " in await asyncio.wait_for(reader.readline(), 5)  # (its own deadline)
    finally:
        writer.close()
    assert pair.cluster.budget.held == 0
    third = signer.sign_call("ra", INCARNATION, "POST", CONTROL_PATH, body)
    assert (await post(pair.address, CONTROL_PATH, body, third)).status_code == 200


async def test_a_call_made_for_the_process_before_a_restart_is_looked_up_again(
    pair: Pair,
) -> None:
    """A replica that restarted is a new incarnation: a proof naming the one before is refused
    (the caller's lookup predates the restart), and the caller looks the home up again."""
    pair.served.signer = ClusterSigner(SECRET, "ra", "b1" * 16)  # (its nonces are new too)
    with pytest.raises(HomeMovedError, match="restarted since it was looked up"):
        await pair.channel.call("ra", pair.address, INCARNATION, {"op": "x"}, None, 5)
    execution = pair.owner_manager.start()
    with pytest.raises(OwnerUnavailableError, match="restarted since it was looked up"):
        await pair.caller.send(execution.info, {"op": "cancel"}, OWNER)  # (an old heartbeat)
    assert execution.cancelled == []
    # The process before is gone (its heartbeat with it); the new one's first beat is in.
    await pair.store.drop_replica("ra", INCARNATION)
    beat = {"cluster_address": pair.address, "incarnation": "b1" * 16}
    await pair.store.heartbeat("ra", beat, 30)
    await pair.caller.send(execution.info, {"op": "cancel"}, OWNER)
    assert execution.cancelled == [False]


async def test_a_head_sent_too_slowly_is_cut(pair: Pair) -> None:
    host, port = pair.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    started = time.monotonic()
    try:
        for byte in f"POST {CONTROL_PATH} HTTP/1.1\r\nHost: x\r\n".encode():
            if writer.is_closing() or reader.at_eof():
                break
            writer.write(bytes([byte]))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    break  # closed by the listener
        assert time.monotonic() - started < HEAD_TIMEOUT + 1.5
        assert await asyncio.wait_for(reader.read(), 2) == b""
    finally:
        writer.close()
    assert pair.clients == []  # (no request ever reached the app)
    # A kept-alive connection's next head has its own deadline; a prompt one is served.
    assert await pair.channel.call("ra", pair.address, INCARNATION, {"op": "a"}, None, 5)
