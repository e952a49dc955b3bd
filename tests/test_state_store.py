"""One contract for both state stores (in-memory and a real redis-server), plus the key layout."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_harness import RedisServer

from sandbox_runtime.domain.models import EventType, ExecutionInfo, ExecutionStatus, OutputEvent
from sandbox_runtime.errors import ReplicaIdInUseError
from sandbox_runtime.state.keys import Keys
from sandbox_runtime.state.redis_store import RedisStore
from sandbox_runtime.state.store import Beat, MemoryStore, Snapshot, StateStore

pytestmark = pytest.mark.integration


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield MemoryStore(ttl_seconds=60, max_events=50)
        return
    redis_store = RedisStore(redis_server.url, ttl_seconds=60, max_events=50)
    try:
        yield redis_store
    finally:
        await redis_store.aclose()


def make_info(
    status: ExecutionStatus = ExecutionStatus.RUNNING, replica: str = "r1"
) -> ExecutionInfo:
    return ExecutionInfo(
        execution_id=uuid.uuid4().hex,
        status=status,
        principal="alice",
        session_id="s:one",
        replica_id=replica,
        command="echo hi",
        timeout_seconds=30,
        created_at=time.time(),
    )


def make_events(first: int, count: int) -> list[OutputEvent]:
    return [
        OutputEvent(seq=s, type=EventType.STDOUT, ts=time.time(), data=f"line {s}\n")
        for s in range(first, first + count)
    ]


async def test_written_execution_reads_back_with_its_events(store: StateStore) -> None:
    info = make_info()
    info.last_seq = 3
    await store.write([Snapshot(info, "alice:s:one", make_events(1, 3))])
    got = await store.get_execution(info.execution_id)
    assert got is not None and got.execution_id == info.execution_id
    assert got.status is ExecutionStatus.RUNNING
    events = await store.get_events(info.execution_id, 0, 10)
    assert [e.seq for e in events] == [1, 2, 3]
    assert events[1].data == "line 2\n"
    assert [e.seq for e in await store.get_events(info.execution_id, 1, 1)] == [2]


async def test_retried_flush_never_duplicates_events(store: StateStore) -> None:
    info = make_info()
    await store.write([Snapshot(info, "alice:s:one", make_events(1, 3))])
    await store.write([Snapshot(info, "alice:s:one", make_events(2, 4))])  # 2,3 again; 4,5 new
    events = await store.get_events(info.execution_id, 0, 100)
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]


async def test_output_list_stops_at_the_cap(store: StateStore) -> None:
    info = make_info()
    await store.write([Snapshot(info, "alice:s:one", make_events(1, 80))])
    events = await store.get_events(info.execution_id, 0, 1000)
    assert len(events) == store.max_events == 50
    assert events[-1].seq == 50


async def test_session_lists_its_executions_only(store: StateStore) -> None:
    a, b, other = make_info(), make_info(), make_info()
    await store.write(
        [
            Snapshot(a, "alice:s:one", []),
            Snapshot(b, "alice:s:one", []),
            Snapshot(other, "bob:s:one", []),
        ]
    )
    ids = {i.execution_id for i in await store.session_executions("alice:s:one")}
    assert {a.execution_id, b.execution_id} <= ids
    assert other.execution_id not in ids


async def test_unknown_execution_is_none(store: StateStore) -> None:
    assert await store.get_execution("does-not-exist") is None
    assert await store.get_events("does-not-exist", 0, 10) == []


async def test_running_execution_of_a_dead_replica_is_marked_lost_once(store: StateStore) -> None:
    info = make_info(replica="gone-replica")
    info.last_seq = 2
    await store.write([Snapshot(info, "alice:s:one", make_events(1, 2))])
    first, second = await asyncio.gather(
        store.mark_lost(info.execution_id, time.time()),
        store.mark_lost(info.execution_id, time.time()),
    )
    assert first is not None and second is not None
    assert first.status is ExecutionStatus.LOST and second.status is ExecutionStatus.LOST
    events = await store.get_events(info.execution_id, 0, 100)
    assert [e.type for e in events] == ["stdout", "stdout", "error"], "one lost event, once"
    assert [e.seq for e in events] == [1, 2, 3]


async def test_execution_of_a_live_replica_is_not_marked_lost(store: StateStore) -> None:
    info = make_info(replica="alive-replica")
    await store.heartbeat("alive-replica", {"replica_id": "alive-replica"}, 30)
    await store.write([Snapshot(info, "alice:s:one", [])])
    got = await store.mark_lost(info.execution_id, time.time())
    assert got is not None and got.status is ExecutionStatus.RUNNING
    assert await store.replica_alive("alive-replica")
    await store.drop_replica("alive-replica")
    assert not await store.replica_alive("alive-replica")


async def test_execution_of_an_earlier_process_under_the_same_replica_id_is_lost(
    store: StateStore,
) -> None:
    """Liveness is per process: a heartbeat of the replica id from a process started after
    the execution was created (a fast restart) does not keep it running; one from an earlier
    process (the new one has not beaten yet) says nothing against a newer execution."""
    replica = f"r-{uuid.uuid4().hex[:6]}"
    old = make_info(replica=replica)
    old.incarnation = "old-process"
    await store.heartbeat(
        replica, {"incarnation": "old-process", "started_at": time.time() - 60}, 30
    )
    await store.write([Snapshot(old, "alice:s:one", make_events(1, 1))])
    assert [i.execution_id for i in await store.replica_running(replica)] == [old.execution_id]
    got = await store.mark_lost(old.execution_id, time.time())
    assert got is not None and got.status is ExecutionStatus.RUNNING, "its process still beats"
    new = make_info(replica=replica)
    new.incarnation = "new-process"
    await store.write([Snapshot(new, "alice:s:one", [])])
    got = await store.mark_lost(new.execution_id, time.time())
    assert got is not None and got.status is ExecutionStatus.RUNNING, "not beaten yet"
    beat = {"incarnation": "new-process", "started_at": time.time()}
    with pytest.raises(ReplicaIdInUseError):  # (the id is exclusive while the old one beats)
        await store.heartbeat(replica, beat, 30)
    await store.drop_replica(replica)  # as its heartbeat expiring (the old process died)
    await store.heartbeat(replica, beat, 30)
    got = await store.mark_lost(old.execution_id, time.time())
    assert got is not None and got.status is ExecutionStatus.LOST
    assert [e.type for e in await store.get_events(old.execution_id, 0, 10)] == [
        "stdout",
        "error",
    ]
    got = await store.mark_lost(new.execution_id, time.time())
    assert got is not None and got.status is ExecutionStatus.RUNNING
    assert [i.execution_id for i in await store.replica_running(replica)] == [new.execution_id]
    new.status = ExecutionStatus.COMPLETED
    await store.write([Snapshot(new, "alice:s:one", [])])
    assert await store.replica_running(replica) == []


async def test_a_lost_execution_is_final_and_another_incarnations_is_never_overwritten(
    store: StateStore,
) -> None:
    """A process back from a freeze past its heartbeat writes `running`, then `completed`,
    over an execution the cluster marked lost meanwhile: the store refuses both (listed as
    fenced) and keeps `lost` with its events; a write by another incarnation is refused too;
    the rest of the batch is written."""
    replica = f"r-{uuid.uuid4().hex[:6]}"
    frozen = make_info(replica=replica)
    frozen.incarnation = "frozen"
    frozen.last_seq = 1
    await store.heartbeat(replica, {"incarnation": "frozen", "started_at": time.time()}, 30)
    await store.write([Snapshot(frozen, "alice:s:one", make_events(1, 1))])
    await store.drop_replica(replica)  # (its heartbeat expired while it was frozen)
    marked = await store.mark_lost(frozen.execution_id, time.time())
    assert marked is not None and marked.status is ExecutionStatus.LOST
    other = make_info(replica=replica)
    other.incarnation = "frozen"
    written = await store.write(
        [Snapshot(frozen, "alice:s:one", make_events(2, 3)), Snapshot(other, "alice:s:one")]
    )
    assert written.fenced == [frozen.execution_id]
    frozen.status, frozen.last_seq = ExecutionStatus.COMPLETED, 5
    written = await store.write([Snapshot(frozen, "alice:s:one", make_events(2, 4))])
    assert written.fenced == [frozen.execution_id]
    got = await store.get_execution(frozen.execution_id)
    assert got is not None and got.status is ExecutionStatus.LOST
    assert [e.type for e in await store.get_events(frozen.execution_id, 0, 10)] == [
        "stdout",
        "error",
    ]
    assert (await store.get_execution(other.execution_id)) is not None
    impostor = other.model_copy()
    impostor.incarnation = "another"
    impostor.status = ExecutionStatus.COMPLETED
    written = await store.write([Snapshot(impostor, "alice:s:one")])
    assert written.fenced == [other.execution_id]
    got = await store.get_execution(other.execution_id)
    assert got is not None and got.status is ExecutionStatus.RUNNING


async def test_a_replica_id_is_held_by_one_incarnation_at_a_time(store: StateStore) -> None:
    """The heartbeat is a compare-and-set on the incarnation: a second process with the same
    id is refused while the first beats (nothing written), takes it once the first's has
    gone, and the first is then refused in turn; dropping is only the holder's."""
    replica = f"r-{uuid.uuid4().hex[:6]}"
    first = {"incarnation": "first", "started_at": time.time(), "cluster_address": "a:1"}
    second = {"incarnation": "second", "started_at": time.time(), "cluster_address": "b:2"}
    assert await store.heartbeat(replica, first, 30) is False
    with pytest.raises(ReplicaIdInUseError, match="a:1"):
        await store.heartbeat(replica, second, 30)
    beat = await store.replica_beat(replica)
    assert beat is not None and beat["incarnation"] == "first"
    await store.drop_replica(replica, "second")  # (not the holder: nothing)
    assert await store.replica_alive(replica)
    assert await store.heartbeat(replica, first, 30) is True
    await store.drop_replica(replica, "first")
    assert await store.heartbeat(replica, second, 30) is False
    with pytest.raises(ReplicaIdInUseError, match="b:2"):
        await store.heartbeat(replica, first, 30)


async def test_heartbeat_says_whether_the_store_still_had_it(store: StateStore) -> None:
    replica = f"r-{uuid.uuid4().hex[:6]}"
    assert await store.heartbeat(replica, {"replica_id": replica}, 30) is False
    assert await store.heartbeat(replica, {"replica_id": replica}, 30) is True
    await store.drop_replica(replica)  # as a store that lost it
    assert await store.heartbeat(replica, {"replica_id": replica}, 30) is False


async def test_replica_beats_lists_heartbeats_until_they_are_dropped(store: StateStore) -> None:
    replica = f"beats-{uuid.uuid4().hex[:6]}"
    await store.heartbeat(replica, {"replica_id": replica, "last_seen": 1.5}, 30)
    assert (await store.replica_beats())[replica]["last_seen"] == 1.5
    await store.drop_replica(replica)
    assert replica not in await store.replica_beats()


async def test_a_write_publishes_its_replicas_heartbeat_only_where_missing(
    store: StateStore,
) -> None:
    """After a store restarted empty, the first write brings back the writer's heartbeat with
    it: its running execution is never readable while its replica looks dead."""
    replica = f"r-{uuid.uuid4().hex[:6]}"
    info = make_info(replica=replica)
    beat = Beat(replica, {"replica_id": replica, "from": "write"}, 30)
    written = await store.write([Snapshot(info, "alice:s:one", make_events(1, 1))], beat)
    assert written.beat_restored and written.stored == {info.execution_id: 1}
    assert await store.replica_alive(replica)
    assert (await store.live_replicas())[replica]["from"] == "write"
    got = await store.mark_lost(info.execution_id, time.time())
    assert got is not None and got.status is ExecutionStatus.RUNNING
    await store.heartbeat(replica, {"replica_id": replica, "from": "heartbeat"}, 30)
    written = await store.write([Snapshot(info, "alice:s:one", make_events(2, 1))], beat)
    assert not written.beat_restored and written.stored == {info.execution_id: 2}
    assert (await store.live_replicas())[replica]["from"] == "heartbeat"
    assert [e.seq for e in await store.get_events(info.execution_id, 0, 10)] == [1, 2]


async def test_finished_execution_is_never_marked_lost(store: StateStore) -> None:
    info = make_info(status=ExecutionStatus.COMPLETED, replica="gone")
    await store.write([Snapshot(info, "alice:s:one", [])])
    got = await store.mark_lost(info.execution_id, time.time())
    assert got is not None and got.status is ExecutionStatus.COMPLETED


async def test_redis_keys_are_readable_with_redis_cli(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, ttl_seconds=120, max_events=100)
    try:
        info = make_info()
        info.last_seq = 2
        await store.write([Snapshot(info, "alice:s:one", make_events(1, 2))])
        execution_id = info.execution_id
        meta = json.loads(redis_server.cli_raw("get", f"execution:{execution_id}"))
        assert meta["execution_id"] == execution_id and meta["status"] == "running"
        lines = redis_server.cli_raw("lrange", f"execution:{execution_id}:output", "0", "-1")
        events = [json.loads(line) for line in lines.splitlines()]
        assert [e["seq"] for e in events] == [1, 2]
        assert events[0]["type"] == "stdout" and events[0]["data"] == "line 1\n"
        members = redis_server.cli_raw("smembers", "session:alice:s:one:executions").split()
        assert execution_id in members
        for key in (
            f"execution:{execution_id}",
            f"execution:{execution_id}:output",
            "session:alice:s:one:executions",
        ):
            ttl = int(redis_server.cli_raw("ttl", key))
            assert 0 < ttl <= 120, key
        await store.heartbeat("r9", {"replica_id": "r9"}, 10)
        assert json.loads(redis_server.cli_raw("get", "replica:r9"))["replica_id"] == "r9"
        assert 0 < int(redis_server.cli_raw("ttl", "replica:r9")) <= 10
    finally:
        await store.aclose()


async def test_reading_refreshes_the_ttl(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, ttl_seconds=100, max_events=100)
    try:
        info = make_info()
        await store.write([Snapshot(info, "alice:s:one", make_events(1, 1))])
        key = Keys().execution(info.execution_id)
        redis_server.cli("expire", key, "5")
        redis_server.cli("expire", f"{key}:output", "5")
        assert int(redis_server.cli_raw("ttl", key)) <= 5
        await store.get_execution(info.execution_id)
        assert int(redis_server.cli_raw("ttl", key)) > 50
        assert int(redis_server.cli_raw("ttl", f"{key}:output")) > 50
    finally:
        await store.aclose()


async def test_redis_store_raises_when_redis_is_down(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "down")
    server.start()
    store = RedisStore(server.url, ttl_seconds=60, timeout=0.5)
    try:
        assert await store.ping()
        server.stop()
        with pytest.raises((ConnectionError, OSError, Exception)) as excinfo:
            await store.write([Snapshot(make_info(), "alice:s:one", make_events(1, 1))])
        assert "onnect" in str(excinfo.value) or "refused" in str(excinfo.value).lower()
    finally:
        server.stop()
        await store.aclose()


async def test_redis_store_answers_at_once_after_redis_restarts(tmp_path: Path) -> None:
    """Connections pooled before a restart are dead; the first call on each is sent again on a
    new connection rather than failing (a replica that was idle through the restart)."""
    server = RedisServer(tmp_path / "restart")
    server.start()
    store = RedisStore(server.url, ttl_seconds=60)
    try:
        info = make_info()
        await store.write([Snapshot(info, "alice:s:one", make_events(1, 2))])
        server.stop()
        server.start()
        assert await store.get_execution(info.execution_id) is None  # a new, empty Redis
        await store.write([Snapshot(info, "alice:s:one", make_events(1, 2))])
        assert [e.seq for e in await store.get_events(info.execution_id, 0, 10)] == [1, 2]
        server.stop()
        with pytest.raises(RedisConnectionError):  # down is down: one retry, then the error
            await store.ping()
    finally:
        server.stop()
        await store.aclose()
