"""The Redis StateStore: readable JSON under the keys of state/keys.py, TTLs refreshed."""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import WatchError

from sandbox_runtime.domain.models import ExecutionInfo, OutputEvent
from sandbox_runtime.state.keys import Keys
from sandbox_runtime.state.store import (
    Beat,
    Snapshot,
    Written,
    incarnation_gone,
    lost_event,
    mark_info_lost,
)

# Appends only the events that continue the list (seq == LLEN + 1), so a retried flush never
# duplicates and list index = seq - 1 always holds; the list stops growing at the cap. Keeps
# the execution in its replica's set of running ones while it is not finished (ARGV[6]).
WRITE_SCRIPT = """
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[1])
local n = redis.call('LLEN', KEYS[2])
local cap = tonumber(ARGV[3])
local first = tonumber(ARGV[4])
for i = 7, #ARGV do
  local seq = first + i - 7
  if seq == n + 1 and n < cap then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    n = n + 1
  end
end
if n > 0 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
redis.call('SADD', KEYS[3], ARGV[5])
redis.call('EXPIRE', KEYS[3], ARGV[1])
if ARGV[6] == '1' then
  redis.call('SADD', KEYS[4], ARGV[5])
  redis.call('EXPIRE', KEYS[4], ARGV[1])
else
  redis.call('SREM', KEYS[4], ARGV[5])
end
return n
"""


def _beat(raw: bytes | str | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        beat = json.loads(raw)
    except ValueError:
        return {}  # (there, unreadable: alive, as any heartbeat)
    return beat if isinstance(beat, dict) else {}


def redis_client(url: str, **options: Any) -> aioredis.Redis:
    """A client that sends a command once more, on a new connection, when its connection turns
    out closed (Redis restarted, or dropped an idle client): otherwise every connection pooled
    before a restart fails one call after Redis is back. Only once, and never after a timeout
    (the command may be running; the caller's deadline stands).
    """
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    return aioredis.Redis.from_url(url, retry=retry, **options)


class RedisStore:
    """StateStore on Redis. Raises redis.exceptions.RedisError (and OSError) when Redis fails."""

    def __init__(
        self,
        url: str,
        ttl_seconds: int = 3600,
        max_events: int = 100_000,
        keys: Keys | None = None,
        timeout: float = 2.0,
    ) -> None:
        self.url = url
        self.ttl_seconds = ttl_seconds
        self.max_events = max_events
        self.keys = keys or Keys()
        common: dict[str, Any] = {
            "decode_responses": True,
            "socket_connect_timeout": timeout,
            "health_check_interval": 15,
        }
        self.redis = redis_client(url, socket_timeout=timeout, **common)
        self._write = self.redis.register_script(WRITE_SCRIPT)

    async def write(self, batch: list[Snapshot], beat: Beat | None = None) -> Written:
        if not batch:
            return Written({})
        async with self.redis.pipeline(transaction=False) as pipe:
            if beat is not None:  # only where missing: the heartbeat loop owns its refresh
                pipe.set(
                    self.keys.replica(beat.replica_id),
                    json.dumps(beat.payload),
                    ex=beat.ttl,
                    nx=True,
                )
                pipe.zadd(self.keys.replicas(), {beat.replica_id: time.time() + beat.ttl})
            for snap in batch:
                execution_id = snap.info.execution_id
                first = snap.events[0].seq if snap.events else 0
                await self._write(
                    keys=[
                        self.keys.execution(execution_id),
                        self.keys.output(execution_id),
                        self.keys.session(snap.session_key),
                        self.keys.replica_running(snap.info.replica_id),
                    ],
                    args=[
                        self.ttl_seconds,
                        snap.info.model_dump_json(),
                        self.max_events,
                        first,
                        execution_id,
                        "0" if snap.info.status.finished else "1",
                        *(json.dumps(e.wire(), ensure_ascii=False) for e in snap.events),
                    ],
                    client=pipe,
                )
            results = await pipe.execute()
        lengths = results[-len(batch) :]
        stored = {s.info.execution_id: int(n) for s, n in zip(batch, lengths, strict=True)}
        return Written(stored, beat is not None and bool(results[0]))

    async def get_execution(self, execution_id: str) -> ExecutionInfo | None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.execution(execution_id))
            pipe.expire(self.keys.execution(execution_id), self.ttl_seconds)
            pipe.expire(self.keys.output(execution_id), self.ttl_seconds)
            raw, _, _ = await pipe.execute()
        return ExecutionInfo.model_validate_json(raw) if raw else None

    async def get_events(self, execution_id: str, after: int, limit: int) -> list[OutputEvent]:
        if limit <= 0:
            return []
        raw = await self.redis.lrange(self.keys.output(execution_id), after, after + limit - 1)
        return [OutputEvent.model_validate_json(item) for item in raw]

    async def session_executions(self, session_key: str) -> list[ExecutionInfo]:
        key = self.keys.session(session_key)
        ids = sorted(str(i) for i in await self.redis.smembers(key))
        if not ids:
            return []
        await self.redis.expire(key, self.ttl_seconds)
        raws = await self.redis.mget([self.keys.execution(i) for i in ids])
        return [ExecutionInfo.model_validate_json(r) for r in raws if r]

    async def heartbeat(self, replica_id: str, payload: dict[str, Any], ttl: int) -> bool:
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(self.keys.replica(replica_id))
            pipe.set(self.keys.replica(replica_id), json.dumps(payload), ex=ttl)
            pipe.zadd(self.keys.replicas(), {replica_id: now + ttl})
            pipe.zremrangebyscore(self.keys.replicas(), "-inf", now - 3600)
            existed, *_ = await pipe.execute()
        return bool(existed)

    async def drop_replica(self, replica_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.replica(replica_id))
            pipe.zrem(self.keys.replicas(), replica_id)
            await pipe.execute()

    async def live_replicas(self) -> dict[str, dict[str, Any]]:
        ids = [
            str(i)
            for i in await self.redis.zrangebyscore(self.keys.replicas(), time.time(), "+inf")
        ]
        if not ids:
            return {}
        raws = await self.redis.mget([self.keys.replica(i) for i in ids])
        return {i: json.loads(raw) for i, raw in zip(ids, raws, strict=True) if raw}

    async def replica_beats(self) -> dict[str, dict[str, Any]]:
        ids = [str(i) for i in await self.redis.zrange(self.keys.replicas(), 0, -1)]
        if not ids:
            return {}
        raws = await self.redis.mget([self.keys.replica(i) for i in ids])  # (expired: None)
        return {i: json.loads(raw) for i, raw in zip(ids, raws, strict=True) if raw}

    async def replica_alive(self, replica_id: str) -> bool:
        return bool(await self.redis.exists(self.keys.replica(replica_id)))

    async def replica_beat(self, replica_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self.keys.replica(replica_id))
        return _beat(raw)

    async def replica_running(self, replica_id: str) -> list[ExecutionInfo]:
        ids = sorted(
            str(i) for i in await self.redis.smembers(self.keys.replica_running(replica_id))
        )
        if not ids:
            return []
        raws = await self.redis.mget([self.keys.execution(i) for i in ids])
        return [ExecutionInfo.model_validate_json(r) for r in raws if r]

    async def mark_lost(self, execution_id: str, now: float) -> ExecutionInfo | None:
        meta_key = self.keys.execution(execution_id)
        for _ in range(5):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(meta_key)
                    raw = await pipe.get(meta_key)
                    if not raw:
                        return None
                    info = ExecutionInfo.model_validate_json(raw)
                    running = self.keys.replica_running(info.replica_id)
                    if info.status.finished:
                        await pipe.srem(running, execution_id)
                        return info
                    beat = _beat(await pipe.get(self.keys.replica(info.replica_id)))
                    if not incarnation_gone(info, beat):
                        return info
                    length = await pipe.llen(self.keys.output(execution_id))
                    mark_info_lost(info, now)
                    info.last_seq = length + 1
                    pipe.multi()
                    pipe.srem(running, execution_id)
                    pipe.set(meta_key, info.model_dump_json(), keepttl=True)
                    pipe.rpush(
                        self.keys.output(execution_id),
                        json.dumps(lost_event(length + 1, now).wire()),
                    )
                    pipe.expire(self.keys.output(execution_id), self.ttl_seconds)
                    await pipe.execute()
                    return info
                except WatchError:
                    continue
        return await self.get_execution(execution_id)

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def aclose(self) -> None:
        await self.redis.aclose()
