"""The SessionStore on Redis: session records as hashes, counts as sorted sets, all atomic."""

from __future__ import annotations

import json
import uuid
from typing import Any

import redis.asyncio as aioredis

from sandbox_runtime.sessions.models import SessionRecord
from sandbox_runtime.sessions.store import ClaimOutcome, Lookup, StoreEpoch
from sandbox_runtime.state.keys import Keys

# KEYS: record, principal's sessions, this replica's sessions. ARGV: me, now, ttl, heartbeat
# key prefix, session key. The active home refreshes the record (and the sets that find it)
# in the same round trip, and takes a reset owed to the session's next call; anyone else
# gets the home's heartbeat with it (nil: not alive).
LOOKUP_SCRIPT = """
local f = redis.call('HMGET', KEYS[1], 'home', 'state')
if not f[1] then return false end
if f[1] == ARGV[1] and f[2] == 'active' then
  redis.call('HSET', KEYS[1], 'last_used_at', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('ZADD', KEYS[2], tonumber(ARGV[2]) + tonumber(ARGV[3]), ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  redis.call('SADD', KEYS[3], ARGV[5])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  local found = redis.call('HGETALL', KEYS[1])
  if ARGV[6] == '1' then redis.call('HDEL', KEYS[1], 'reset_reason', 'reset_from') end
  return {found, 1, false}
end
return {redis.call('HGETALL', KEYS[1]), 0, redis.call('GET', ARGV[4] .. f[1])}
"""

# KEYS: record, principal's sessions, new home's sessions, previous home's sessions, epoch,
# previous home's heartbeat. ARGV: expected generation ('' = new session), max sessions, ttl,
# now, session key, the store's expected epoch ('' = any), '1' if the previous home must have
# no heartbeat (taken from a dead home: one back meanwhile keeps it), then the record's
# field/value pairs.
CLAIM_SCRIPT = """
if ARGV[6] ~= '' and redis.call('HGET', KEYS[5], 'id') ~= ARGV[6] then return 'moved' end
if ARGV[7] == '1' and redis.call('EXISTS', KEYS[6]) == 1 then return 'moved' end
local generation = redis.call('HGET', KEYS[1], 'generation')
if ARGV[1] == '' then
  if generation then return 'exists' end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[2]) then return 'session_limit' end
else
  if generation ~= ARGV[1] then return 'moved' end
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[4], ARGV[5])
end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], tonumber(ARGV[4]) + tonumber(ARGV[3]), ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[5])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 'claimed'
"""

# KEYS: record. ARGV: home, reason, previous home. Only on a first generation not published
# again (started afresh).
OWE_RESET_SCRIPT = """
local f = redis.call('HMGET', KEYS[1], 'home', 'generation', 'reset_reason', 'published_again_at')
if f[1] ~= ARGV[1] or f[2] ~= '1' or f[4] then return 0 end
if not f[3] then
  redis.call('HSET', KEYS[1], 'reset_reason', ARGV[2], 'reset_from', ARGV[3])
end
return 1
"""

# KEYS: the epoch. ARGV: a new epoch id, the epoch the caller knew ('' = none). Times in the
# store's own clock (replicas' clocks may differ); numbers returned as strings.
EPOCH_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local f = redis.call('HMGET', KEYS[1], 'id', 'created_at', 'restarted')
if not f[1] then
  local restarted = ARGV[2] ~= '' and '1' or '0'
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'created_at', tostring(now), 'restarted', restarted)
  f = {ARGV[1], tostring(now), restarted}
elseif ARGV[2] ~= '' and ARGV[2] ~= f[1] and f[3] ~= '1' then
  redis.call('HSET', KEYS[1], 'restarted', '1')
  f[3] = '1'
end
return {f[1], tostring(now - tonumber(f[2])), f[3]}
"""

# KEYS: the replica's sessions. ARGV: replica id, reason, now, record key prefix and suffix.
RELEASE_SCRIPT = """
local n = 0
for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local record = ARGV[4] .. key .. ARGV[5]
  local f = redis.call('HMGET', record, 'home', 'state')
  if f[1] == ARGV[1] and f[2] == 'active' then
    redis.call('HSET', record, 'state', 'released', 'released_reason', ARGV[2])
    n = n + 1
  end
end
redis.call('DEL', KEYS[1])
return n
"""

# KEYS: the principal's running set. ARGV: now, limit, execution id, lease.
RESERVE_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[3]) and
   redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[4]), ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[4])) + 60)
return 1
"""


class RedisSessionStore:
    """SessionStore on a Redis connection shared with the execution mirror."""

    def __init__(self, redis: aioredis.Redis, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._lookup = redis.register_script(LOOKUP_SCRIPT)
        self._claim = redis.register_script(CLAIM_SCRIPT)
        self._release = redis.register_script(RELEASE_SCRIPT)
        self._reserve = redis.register_script(RESERVE_SCRIPT)
        self._epoch = redis.register_script(EPOCH_SCRIPT)
        self._owe_reset = redis.register_script(OWE_RESET_SCRIPT)
        # The record key is "<prefix><session key><suffix>": RELEASE builds it from the set.
        self._record_prefix, _, self._record_suffix = self.keys.session_home("\0").partition("\0")

    async def lookup(
        self, key: str, replica_id: str, now: float, ttl: int, take: bool = False
    ) -> Lookup:
        principal = key.partition(":")[0]
        reply = await self._lookup(
            keys=[
                self.keys.session_home(key),
                self.keys.principal_sessions(principal),
                self.keys.replica_sessions(replica_id),
            ],
            args=[replica_id, repr(now), ttl, self.keys.replica(""), key, "1" if take else "0"],
        )
        if not reply:
            return Lookup(None)
        flat, touched, heartbeat = reply
        record = SessionRecord.from_fields(dict(zip(flat[::2], flat[1::2], strict=True)))
        beat: dict[str, Any] | None = json.loads(heartbeat) if heartbeat else None
        return Lookup(record, beat, touched=bool(touched))

    async def claim(
        self,
        record: SessionRecord,
        expected_generation: int | None,
        max_sessions: int,
        ttl: int,
        previous_home: str | None = None,
        epoch: str | None = None,
        previous_dead: bool = False,
    ) -> ClaimOutcome:
        pairs: list[str] = []
        for name, value in record.fields().items():
            pairs += [name, value]
        outcome = await self._claim(
            keys=[
                self.keys.session_home(record.key),
                self.keys.principal_sessions(record.principal),
                self.keys.replica_sessions(record.home),
                self.keys.replica_sessions(previous_home or record.home),
                self.keys.store_epoch(),
                self.keys.replica(previous_home or record.home),
            ],
            args=[
                "" if expected_generation is None else str(expected_generation),
                max_sessions,
                ttl,
                repr(record.last_used_at),
                record.key,
                epoch or "",
                "1" if previous_dead else "0",
                *pairs,
            ],
        )
        return outcome

    async def owe_reset(self, key: str, home: str, reason: str, previous_home: str) -> bool:
        noted = await self._owe_reset(
            keys=[self.keys.session_home(key)], args=[home, reason, previous_home]
        )
        return bool(noted)

    async def epoch(self, known: str | None) -> StoreEpoch:
        epoch_id, age, restarted = await self._epoch(
            keys=[self.keys.store_epoch()], args=[uuid.uuid4().hex, known or ""]
        )
        return StoreEpoch(str(epoch_id), max(0.0, float(age)), restarted == "1")

    async def release_replica(self, replica_id: str, reason: str, now: float) -> int:
        released = await self._release(
            keys=[self.keys.replica_sessions(replica_id)],
            args=[replica_id, reason, repr(now), self._record_prefix, self._record_suffix],
        )
        return int(released)

    async def reserve_running(
        self, principal: str, execution_id: str, limit: int, lease: float, now: float
    ) -> bool:
        granted = await self._reserve(
            keys=[self.keys.principal_running(principal)],
            args=[repr(now), limit, execution_id, lease],
        )
        return bool(granted)

    async def renew_running(self, running: list[tuple[str, str]], lease: float, now: float) -> None:
        if not running:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for principal, execution_id in running:
                key = self.keys.principal_running(principal)
                # Not XX: an execution that started while Redis was away is counted now.
                pipe.zadd(key, {execution_id: now + lease})
                pipe.expire(key, int(lease) + 60)
            await pipe.execute()

    async def release_running(self, principal: str, execution_id: str) -> None:
        await self.redis.zrem(self.keys.principal_running(principal), execution_id)
