"""One contract for both session stores (in-memory and a real redis-server), plus the Redis
layout of a session record."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_harness import RedisServer

from sandbox_runtime.sessions.models import SessionRecord
from sandbox_runtime.sessions.redis_store import RedisSessionStore
from sandbox_runtime.sessions.store import Lookup, MemorySessionStore, SessionStore
from sandbox_runtime.state.keys import session_key

pytestmark = pytest.mark.integration

TTL = 60
LEASE = 30.0


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield MemorySessionStore()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    server.cli("flushall")  # a fresh key space for every test
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        yield RedisSessionStore(client)
    finally:
        await client.aclose()


async def set_heartbeat(store: SessionStore, replica_id: str, payload: dict[str, Any]) -> None:
    """What a live replica publishes, in the form each store reads it."""
    if isinstance(store, MemorySessionStore):
        store.heartbeats[replica_id] = payload
    else:
        assert isinstance(store, RedisSessionStore)
        await store.redis.set(f"replica:{replica_id}", json.dumps(payload))


def make_record(
    session_id: str = "s:one",
    home: str = "r1",
    principal: str = "alice",
    generation: int = 1,
    now: float | None = None,
) -> SessionRecord:
    now = time.time() if now is None else now
    return SessionRecord(
        principal=principal,
        session_id=session_id,
        home=home,
        home_started_at=now - 100,
        created_at=now,
        last_used_at=now,
        generation=generation,
    )


async def look(store: SessionStore, record: SessionRecord, replica_id: str) -> Lookup:
    return await store.lookup(record.key, replica_id, time.time(), TTL, take=True)


# -- lookup and claim --------------------------------------------------------------------------


async def test_lookup_of_an_unknown_session_finds_no_record(store: SessionStore) -> None:
    found = await store.lookup(session_key("alice", "s:nothing"), "r1", time.time(), TTL)
    assert found == Lookup(record=None)
    assert found.home_heartbeat is None and not found.touched


async def test_new_session_is_claimed_once_and_then_exists(store: SessionStore) -> None:
    record = make_record()
    assert await store.claim(record, None, 10, TTL) == "claimed"
    assert await store.claim(make_record(home="r2"), None, 10, TTL) == "exists"
    found = await look(store, record, "r3")
    assert found.record is not None and found.record.home == "r1", "the first claim stands"


async def test_claimed_record_reads_back_unchanged(store: SessionStore) -> None:
    record = make_record(session_id="s:with:colons")
    assert record.key == "alice:s:with:colons"
    assert await store.claim(record, None, 10, TTL) == "claimed"
    found = await look(store, record, "another-replica")
    assert found.record == record
    assert found.record is not record


async def test_lookup_by_the_home_touches_the_session(store: SessionStore) -> None:
    record = make_record()
    assert await store.claim(record, None, 10, TTL) == "claimed"
    later = record.last_used_at + 5.25
    found = await store.lookup(record.key, "r1", later, TTL)
    assert found.touched
    assert found.home_heartbeat is None
    assert found.record is not None and found.record.last_used_at == later
    again = await look(store, record, "r2")
    assert again.record is not None and again.record.last_used_at == later, "stored, not only told"


async def test_lookup_by_another_replica_returns_the_homes_heartbeat(store: SessionStore) -> None:
    record = make_record()
    assert await store.claim(record, None, 10, TTL) == "claimed"
    beat = {"replica_id": "r1", "cluster_address": "10.0.0.1:9000", "started_at": 1.5}
    await set_heartbeat(store, "r1", beat)
    found = await store.lookup(record.key, "r2", record.last_used_at + 5, TTL)
    assert not found.touched
    assert found.home_heartbeat == beat
    assert found.record is not None
    assert found.record.last_used_at == record.last_used_at, "another replica touches nothing"


async def test_lookup_by_another_replica_without_a_home_heartbeat(store: SessionStore) -> None:
    record = make_record()
    assert await store.claim(record, None, 10, TTL) == "claimed"
    await set_heartbeat(store, "some-other-replica", {"replica_id": "some-other-replica"})
    found = await look(store, record, "r2")
    assert not found.touched
    assert found.record is not None and found.record.home == "r1"
    assert found.home_heartbeat is None


# -- re-homing ---------------------------------------------------------------------------------


async def test_rehoming_with_the_stored_generation_moves_the_session(store: SessionStore) -> None:
    first = make_record(home="r1")
    assert await store.claim(first, None, 10, TTL) == "claimed"
    moved = make_record(home="r2", generation=2)
    assert await store.claim(moved, 1, 10, TTL, previous_home="r1") == "claimed"
    at_new_home = await look(store, moved, "r2")
    assert at_new_home.touched
    assert at_new_home.record is not None
    assert at_new_home.record.home == "r2" and at_new_home.record.generation == 2
    at_old_home = await look(store, moved, "r1")
    assert not at_old_home.touched


async def test_taking_from_a_dead_home_that_came_back_is_moved(store: SessionStore) -> None:
    """A re-homing decided on a home without a heartbeat is refused if the home beats again
    before the claim (a frozen replica resumed between the lookup and the claim): one home."""
    assert await store.claim(make_record(home="r1"), None, 10, TTL) == "claimed"
    await set_heartbeat(store, "r1", {"replica_id": "r1", "incarnation": "back"})
    taking = make_record(home="r2", generation=2)
    outcome = await store.claim(taking, 1, 10, TTL, "r1", previous_dead=True)
    assert outcome == "moved"
    found = await look(store, taking, "r1")
    assert found.touched and found.record is not None and found.record.generation == 1
    assert await store.claim(taking, 1, 10, TTL, "r1") == "claimed"  # (released: no check)


async def test_rehoming_with_a_stale_generation_is_moved(store: SessionStore) -> None:
    assert await store.claim(make_record(home="r1"), None, 10, TTL) == "claimed"
    assert await store.claim(make_record(home="r2", generation=2), 1, 10, TTL, "r1") == "claimed"
    late = make_record(home="r3", generation=2)
    assert await store.claim(late, 1, 10, TTL, "r1") == "moved"
    found = await look(store, late, "r9")
    assert found.record is not None
    assert found.record.home == "r2" and found.record.generation == 2


async def test_rehoming_a_session_without_a_record_is_moved(store: SessionStore) -> None:
    assert await store.claim(make_record(home="r2", generation=2), 1, 10, TTL, "r1") == "moved"
    assert (await look(store, make_record(), "r2")).record is None


async def test_rehomed_session_is_not_released_with_its_previous_home(
    store: SessionStore,
) -> None:
    assert await store.claim(make_record(home="r1"), None, 10, TTL) == "claimed"
    moved = make_record(home="r2", generation=2)
    assert await store.claim(moved, 1, 10, TTL, previous_home="r1") == "claimed"
    assert await store.release_replica("r1", "home_stopped", time.time()) == 0
    found = await look(store, moved, "r9")
    assert found.record is not None and found.record.state == "active"


# -- sessions per principal --------------------------------------------------------------------


async def test_third_session_of_a_principal_hits_the_limit_of_two(store: SessionStore) -> None:
    assert await store.claim(make_record("s:1"), None, 2, TTL) == "claimed"
    assert await store.claim(make_record("s:2"), None, 2, TTL) == "claimed"
    assert await store.claim(make_record("s:3"), None, 2, TTL) == "session_limit"
    assert (await look(store, make_record("s:3"), "r1")).record is None, "nothing stored"
    assert await store.claim(make_record("s:1", home="r2"), None, 2, TTL) == "exists"


async def test_session_limit_of_one_principal_leaves_another_alone(store: SessionStore) -> None:
    assert await store.claim(make_record("s:1"), None, 2, TTL) == "claimed"
    assert await store.claim(make_record("s:2"), None, 2, TTL) == "claimed"
    assert await store.claim(make_record("s:3"), None, 2, TTL) == "session_limit"
    assert await store.claim(make_record("s:1", principal="bob"), None, 2, TTL) == "claimed"
    assert await store.claim(make_record("s:2", principal="bob"), None, 2, TTL) == "claimed"


async def test_rehoming_at_the_session_limit_is_allowed(store: SessionStore) -> None:
    assert await store.claim(make_record("s:1"), None, 2, TTL) == "claimed"
    assert await store.claim(make_record("s:2"), None, 2, TTL) == "claimed"
    moved = make_record("s:1", home="r2", generation=2)
    assert await store.claim(moved, 1, 2, TTL, previous_home="r1") == "claimed"
    assert await store.claim(make_record("s:3"), None, 2, TTL) == "session_limit", "still two"


async def test_expired_session_frees_its_principals_slot(store: SessionStore) -> None:
    assert await store.claim(make_record("s:1"), None, 1, 1) == "claimed"
    assert await store.claim(make_record("s:2"), None, 1, 1) == "session_limit"
    await asyncio.sleep(1.2)
    assert (await look(store, make_record("s:1"), "r2")).record is None
    assert await store.claim(make_record("s:2"), None, 1, TTL) == "claimed"


# -- releasing a stopping replica's sessions ---------------------------------------------------


async def test_release_marks_only_that_replicas_sessions(store: SessionStore) -> None:
    one, two = make_record("s:1", home="r1"), make_record("s:2", home="r1")
    elsewhere = make_record("s:3", home="r2")
    for record in (one, two, elsewhere):
        assert await store.claim(record, None, 10, TTL) == "claimed"
    assert await store.release_replica("r1", "home_stopped", time.time()) == 2
    for record in (one, two):
        found = await look(store, record, "r2")
        assert found.record is not None
        assert found.record.state == "released"
        assert found.record.released_reason == "home_stopped"
        assert found.record.home == "r1" and found.record.generation == 1
    other = await look(store, elsewhere, "r2")
    assert other.touched
    assert other.record is not None and other.record.state == "active"
    assert other.record.released_reason is None


async def test_released_session_is_not_touched_by_its_former_home(store: SessionStore) -> None:
    record = make_record(home="r1")
    assert await store.claim(record, None, 10, TTL) == "claimed"
    assert await store.release_replica("r1", "home_stopped", time.time()) == 1
    found = await store.lookup(record.key, "r1", record.last_used_at + 5, TTL)
    assert not found.touched
    assert found.record is not None and found.record.state == "released"
    assert found.record.last_used_at == record.last_used_at


async def test_release_counts_each_session_once(store: SessionStore) -> None:
    assert await store.claim(make_record(home="r1"), None, 10, TTL) == "claimed"
    assert await store.release_replica("r1", "home_stopped", time.time()) == 1
    assert await store.release_replica("r1", "home_stopped", time.time()) == 0
    assert await store.release_replica("r-without-sessions", "home_stopped", time.time()) == 0


async def test_released_session_can_be_rehomed(store: SessionStore) -> None:
    assert await store.claim(make_record(home="r1"), None, 10, TTL) == "claimed"
    assert await store.release_replica("r1", "home_stopped", time.time()) == 1
    moved = make_record(home="r2", generation=2)
    assert await store.claim(moved, 1, 10, TTL, previous_home="r1") == "claimed"
    found = await look(store, moved, "r2")
    assert found.touched
    assert found.record is not None
    assert found.record.state == "active" and found.record.released_reason is None


async def test_release_includes_sessions_kept_alive_by_lookups(store: SessionStore) -> None:
    """Every lookup of the home extends the record's life by `ttl`; when the home stops it
    must still find the session, however long ago the session was claimed."""
    ttl = 2  # the same retention for every call, as the router passes it
    record = make_record(home="r1")
    assert await store.claim(record, None, 10, ttl) == "claimed"
    await asyncio.sleep(1.2)
    assert (await store.lookup(record.key, "r1", time.time(), ttl)).touched  # now lives to ~3.2 s
    await asyncio.sleep(1.2)  # 2.4 s after the claim: past the claim's ttl, not the lookup's
    assert (await store.lookup(record.key, "r1", time.time(), ttl)).touched, "still alive"
    assert await store.release_replica("r1", "home_stopped", time.time()) == 1
    found = await look(store, record, "r2")
    assert found.record is not None and found.record.state == "released"


# -- running executions per principal ----------------------------------------------------------


async def test_reserve_running_grants_up_to_the_limit(store: SessionStore) -> None:
    now = 1_000.0
    assert await store.reserve_running("alice", "e1", 2, LEASE, now)
    assert await store.reserve_running("alice", "e2", 2, LEASE, now)
    assert not await store.reserve_running("alice", "e3", 2, LEASE, now)
    assert await store.reserve_running("bob", "e3", 2, LEASE, now), "per principal"


async def test_reserving_the_same_execution_again_is_granted(store: SessionStore) -> None:
    now = 1_000.0
    assert await store.reserve_running("alice", "e1", 2, LEASE, now)
    assert await store.reserve_running("alice", "e2", 2, LEASE, now)
    assert await store.reserve_running("alice", "e1", 2, LEASE, now + 1), "idempotent"
    assert not await store.reserve_running("alice", "e3", 2, LEASE, now + 1), "not counted twice"


async def test_release_running_frees_a_slot(store: SessionStore) -> None:
    now = 1_000.0
    assert await store.reserve_running("alice", "e1", 1, LEASE, now)
    assert not await store.reserve_running("alice", "e2", 1, LEASE, now)
    await store.release_running("alice", "e1")
    assert await store.reserve_running("alice", "e2", 1, LEASE, now)
    await store.release_running("alice", "never-reserved")  # harmless


async def test_expired_lease_frees_a_slot(store: SessionStore) -> None:
    now = 1_000.0
    assert await store.reserve_running("alice", "e1", 1, LEASE, now)
    assert not await store.reserve_running("alice", "e2", 1, LEASE, now + LEASE - 1)
    assert await store.reserve_running("alice", "e2", 1, LEASE, now + LEASE)
    assert not await store.reserve_running("alice", "e3", 1, LEASE, now + LEASE + 1)


async def test_tiny_lease_frees_a_slot(store: SessionStore) -> None:
    assert await store.reserve_running("alice", "e1", 1, 0.05, time.time())
    await asyncio.sleep(0.1)
    assert await store.reserve_running("alice", "e2", 1, LEASE, time.time())


async def test_renew_running_extends_a_lease(store: SessionStore) -> None:
    now = 1_000.0
    assert await store.reserve_running("alice", "e1", 1, 10, now)
    assert await store.reserve_running("bob", "e1", 1, 10, now)
    await store.renew_running([("alice", "e1")], 10, now + 8)
    assert not await store.reserve_running("alice", "e2", 1, 10, now + 15), "renewed to 1018"
    assert await store.reserve_running("bob", "e2", 1, 10, now + 15), "not renewed: lapsed"
    assert await store.reserve_running("alice", "e2", 1, 10, now + 18)


async def test_renew_running_counts_an_execution_the_store_had_not_seen(
    store: SessionStore,
) -> None:
    """An execution that started while the store was unreachable was never reserved: its
    replica's renewal counts it from then on (the limit holds again after an outage)."""
    now = 1_000.0
    await store.renew_running([("alice", "started-offline")], LEASE, now)
    assert not await store.reserve_running("alice", "e2", 1, LEASE, now + 1)
    await store.release_running("alice", "started-offline")
    assert await store.reserve_running("alice", "e2", 1, LEASE, now + 2)


# -- the Redis layout --------------------------------------------------------------------------


async def test_redis_record_is_a_hash_with_a_ttl(redis_server: RedisServer) -> None:
    redis_server.cli("flushall")
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        store = RedisSessionStore(client)
        record = make_record(session_id="s:one", home="r1")
        assert await store.claim(record, None, 10, 120) == "claimed"
        key = "session:alice:s:one:home"
        lines = redis_server.cli_raw("hgetall", key).splitlines()
        fields = dict(zip(lines[::2], lines[1::2], strict=True))
        assert fields == {
            "principal": "alice",
            "session_id": "s:one",
            "home": "r1",
            "home_started_at": repr(record.home_started_at),
            "created_at": repr(record.created_at),
            "last_used_at": repr(record.last_used_at),
            "generation": "1",
            "state": "active",
            "holds": "workspace",
        }
        assert SessionRecord.from_fields(fields) == record
        assert 0 < int(redis_server.cli_raw("ttl", key)) <= 120
        assert (await store.release_replica("r1", "home_stopped", time.time())) == 1
        lines = redis_server.cli_raw("hgetall", key).splitlines()
        fields = dict(zip(lines[::2], lines[1::2], strict=True))
        assert fields["state"] == "released" and fields["released_reason"] == "home_stopped"
        assert 0 < int(redis_server.cli_raw("ttl", key)) <= 120
    finally:
        await client.aclose()


async def test_redis_lookup_by_the_home_refreshes_the_ttl(redis_server: RedisServer) -> None:
    redis_server.cli("flushall")
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        store = RedisSessionStore(client)
        record = make_record(home="r1")
        assert await store.claim(record, None, 10, 30) == "claimed"
        key = "session:alice:s:one:home"
        assert 0 < int(redis_server.cli_raw("ttl", key)) <= 30
        assert (await store.lookup(record.key, "r2", time.time(), 500)).touched is False
        assert 0 < int(redis_server.cli_raw("ttl", key)) <= 30, "not by another replica"
        assert (await store.lookup(record.key, "r1", time.time(), 500)).touched
        assert 30 < int(redis_server.cli_raw("ttl", key)) <= 500
    finally:
        await client.aclose()


# -- the store's epoch -------------------------------------------------------------------------


async def test_the_epoch_holds_until_the_store_loses_its_data(store: SessionStore) -> None:
    first = await store.epoch(None)
    assert not first.restarted and first.age >= 0
    again = await store.epoch(first.epoch_id)
    assert again.epoch_id == first.epoch_id and not again.restarted
    assert await store.claim(make_record(), None, 10, TTL, epoch=first.epoch_id) == "claimed"
    other = make_record(session_id="s:two")
    assert await store.claim(other, None, 10, TTL, epoch="an-earlier-epoch") == "moved"
    assert (await look(store, other, "r1")).record is None


async def test_redis_restarted_empty_begins_a_new_epoch_that_says_so(
    redis_server: RedisServer,
) -> None:
    """A replica that knew the earlier epoch marks the new one restarted (sessions may have
    lost their records); a claim made for the earlier epoch is refused after the loss."""
    redis_server.cli("flushall")
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        store = RedisSessionStore(client)
        before = await store.epoch(None)
        assert not before.restarted
        redis_server.cli("flushall")  # as a restart without persistence
        fresh = await store.epoch(None)  # a replica that knew nothing: no evidence of a loss
        assert fresh.epoch_id != before.epoch_id and not fresh.restarted and fresh.age < 1
        seen = await store.epoch(before.epoch_id)  # one that knew the earlier epoch
        assert seen.epoch_id == fresh.epoch_id and seen.restarted
        assert (await store.epoch(None)).restarted, "it stays so"
        assert await store.claim(make_record(), None, 10, TTL, epoch=before.epoch_id) == "moved"
        assert await store.claim(make_record(), None, 10, TTL, epoch=fresh.epoch_id) == "claimed"
        fields = dict(
            zip(
                *[iter(redis_server.cli_raw("hgetall", "store:epoch").splitlines())] * 2,
                strict=True,
            )
        )
        assert fields["id"] == fresh.epoch_id and fields["restarted"] == "1"
        assert int(redis_server.cli_raw("ttl", "store:epoch")) == -1
    finally:
        await client.aclose()


async def test_a_reset_owed_to_a_fresh_start_is_told_once_by_its_home(store: SessionStore) -> None:
    """A replica that held a session's state finds it started afresh elsewhere (the store
    lost its record): the new home's next lookup takes the reset, once; a session re-homed
    from a record (generation 2), published again by its home, or homed elsewhere is not
    marked."""
    record = make_record(home="r2")
    assert await store.claim(record, None, 10, TTL) == "claimed"
    assert not await store.owe_reset(record.key, "r3", "store_lost", "r1")
    assert await store.owe_reset(record.key, "r2", "store_lost", "r1")
    assert (await look(store, record, "r1")).record.reset_from == "r1"  # type: ignore[union-attr]
    # The home's background lookups (renewing a running session's record, publishing again)
    # do not take it: only an operation of the session's does.
    for _ in range(2):
        kept = (await store.lookup(record.key, "r2", time.time(), TTL)).record
        assert kept is not None and kept.reset_reason == "store_lost"
    taken = (await look(store, record, "r2")).record
    assert taken is not None and (taken.reset_reason, taken.reset_from) == ("store_lost", "r1")
    again = (await look(store, record, "r2")).record
    assert again is not None and again.reset_reason is None and again.reset_from is None
    moved = make_record(home="r4", generation=2)
    assert await store.claim(moved, 1, 10, TTL, previous_home="r2") == "claimed"
    assert not await store.owe_reset(record.key, "r4", "store_lost", "r1")
    restored = make_record(session_id="s:two", home="r5")
    restored.published_again_at = time.time()
    assert await store.claim(restored, None, 10, TTL) == "claimed"
    assert not await store.owe_reset(restored.key, "r5", "store_lost", "r1"), "it goes on"
