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
    id_in_use,
    incarnation_gone,
    lost_event,
    mark_info_lost,
)

# Appends only the events that continue the list (seq == LLEN + 1), so a retried flush never
# duplicates and list index = seq - 1 always holds; the list stops growing at the cap. Keeps
# the execution in its replica's set of running ones while it is not finished (ARGV[6]).
# Writes nothing (returns -1) over an execution stored as `lost` (final: readers were told so)
# or as another incarnation's (ARGV[7]): a process back from a freeze or a partition past its
# heartbeat never undoes what the cluster decided meanwhile.
WRITE_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if raw then
  local ok, stored = pcall(cjson.decode, raw)
  if ok and type(stored) == 'table' then
    if stored['status'] == 'lost' then return -1 end
    local theirs = stored['incarnation']
    if type(theirs) == 'string' and ARGV[7] ~= '' and theirs ~= ARGV[7] then return -1 end
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[1])
local n = redis.call('LLEN', KEYS[2])
local cap = tonumber(ARGV[3])
local first = tonumber(ARGV[4])
for i = 8, #ARGV do
  local seq = first + i - 8
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

# A compare-and-set of a replica's heartbeat on its incarnation. KEYS: the heartbeat, the set
# of replicas. ARGV: payload, ttl, incarnation ('' = an older writer: no check), now, the
# set's score, its horizon. Returns {existed, nil} or {-1, the other's payload}.
HEARTBEAT_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if raw and ARGV[3] ~= '' then
  local ok, beat = pcall(cjson.decode, raw)
  if ok and type(beat) == 'table' and type(beat['incarnation']) == 'string'
     and beat['incarnation'] ~= ARGV[3] then
    return {-1, raw}
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
return {raw and 1 or 0, false}
"""

# KEYS: the heartbeat, the set of replicas. ARGV: replica id, incarnation ('' = any).
DROP_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if raw and ARGV[2] ~= '' then
  local ok, beat = pcall(cjson.decode, raw)
  if ok and type(beat) == 'table' and type(beat['incarnation']) == 'string'
     and beat['incarnation'] ~= ARGV[2] then
    return 0
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
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
        self._heartbeat = self.redis.register_script(HEARTBEAT_SCRIPT)
        self._drop = self.redis.register_script(DROP_SCRIPT)

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
                        snap.info.incarnation or "",
                        *(json.dumps(e.wire(), ensure_ascii=False) for e in snap.events),
                    ],
                    client=pipe,
                )
            results = await pipe.execute()
        lengths = [int(n) for n in results[-len(batch) :]]
        stored: dict[str, int] = {}
        fenced: list[str] = []
        for snap, n in zip(batch, lengths, strict=True):
            if n < 0:
                fenced.append(snap.info.execution_id)
            else:
                stored[snap.info.execution_id] = n
        return Written(stored, beat is not None and bool(results[0]), fenced)

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
        existed, other = await self._heartbeat(
            keys=[self.keys.replica(replica_id), self.keys.replicas()],
            args=[
                json.dumps(payload),
                ttl,
                str(payload.get("incarnation") or ""),
                repr(now - 3600),
                repr(now + ttl),
                replica_id,
            ],
        )
        if int(existed) < 0:
            raise id_in_use(replica_id, _beat(other) or {})
        return bool(existed)

    async def drop_replica(self, replica_id: str, incarnation: str | None = None) -> None:
        await self._drop(
            keys=[self.keys.replica(replica_id), self.keys.replicas()],
            args=[replica_id, incarnation or ""],
        )

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
