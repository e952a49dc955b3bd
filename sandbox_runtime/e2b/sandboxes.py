"""E2B sandboxes: what the E2B API calls a sandbox, as a record over one session of ours.

A sandbox is a named session (`s:e2b-<id>`) of the API key's principal: its commands are our
executions, its files the session's workspace, its pause our snapshot. What E2B keeps beside
that (template, metadata, env vars, the end of its life, the envd access token, running or
paused) is this record, kept where every replica sees it: in Redis with a cluster (key
`e2b:sandbox:{id}`, and a per-principal sorted set scored by the end of life), else in memory.

`E2BSandbox` is the interface the envd and code-interpreter handlers get: `sandbox_id`, and
`owner`, the `Owner` through which they call the session router
(`services.router.run(sandbox.owner, "run_code", args, sink)`, `services.router.executions`
...), so limits, egress, the Redis mirror, replicas and roles hold unchanged; `env_vars`, the
environment its code gets; `sandbox_config()`, what its code's `sandbox_config` must be.
"""

from __future__ import annotations

import json
import secrets
import string
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from sandbox_runtime.domain.owner import Owner

ID_ALPHABET = string.ascii_lowercase + string.digits
SESSION_PREFIX = "e2b-"
PAUSED_KEEP_SECONDS = 30 * 86400  # how long a paused sandbox's record is kept (E2B: 30 days)
MAX_METADATA = 64  # entries of metadata / envVars a sandbox keeps
MAX_VALUE_CHARS = 4096


def new_sandbox_id() -> str:
    """An unguessable id of E2B's shape (lowercase letters and digits, 20 characters)."""
    return "i" + "".join(secrets.choice(ID_ALPHABET) for _ in range(19))


def valid_sandbox_id(text: str) -> bool:
    return 1 <= len(text) <= 64 and all(c in ID_ALPHABET for c in text)


@dataclass
class E2BSandbox:
    """One E2B sandbox: its id, the owner (principal + session) it runs as, and its state."""

    sandbox_id: str
    principal: str
    template: str
    alias: str
    access_token: str
    started_at: float
    end_at: float
    timeout: int
    state: Literal["running", "paused"] = "running"
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    snapshot_id: str | None = None  # the pause's snapshot, while paused
    # False (allow_internet_access=false): its code runs with sandbox_config network false;
    # true: the server's egress policy applies, as to any session.
    allow_internet: bool = True
    # What E2B's code-interpreter SDKs send (E2B-Traffic-Access-Token) to port 49999, where
    # they send no X-Access-Token (/contexts): either token opens the interpreter, nothing
    # else does. ("" in a record an older server wrote: connect mints one.)
    traffic_token: str = ""

    @property
    def owner(self) -> Owner:
        """The session of ours the sandbox is: router calls go through this."""
        return Owner(self.principal, f"s:{SESSION_PREFIX}{self.sandbox_id}")

    def sandbox_config(self) -> dict[str, object] | None:
        """The `sandbox_config` its executions and interpreter calls run with."""
        return None if self.allow_internet else {"network": False}

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> E2BSandbox:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def expired(self, now: float | None = None) -> bool:
        return self.state == "running" and self.end_at <= (now or time.time())


class SandboxStore(Protocol):
    """Where the sandboxes' records live (memory alone; Redis with a cluster)."""

    async def get(self, sandbox_id: str) -> E2BSandbox | None: ...

    async def put(self, sandbox: E2BSandbox) -> None: ...

    async def replace(self, sandbox: E2BSandbox) -> bool:
        """Write the record only if it is still there (not killed meanwhile); whether it was."""
        ...

    async def add(self, sandbox: E2BSandbox, limit: int) -> bool:
        """Write a new record unless its principal has `limit` already; whether it was."""
        ...

    async def claim(self, sandbox_id: str, owner: str, seconds: int) -> bool:
        """Take the sandbox's transition (a pause or resume under way) for `owner` unless
        another holds it; it lapses after `seconds`."""
        ...

    async def release(self, sandbox_id: str, owner: str) -> None: ...

    async def delete(self, sandbox: E2BSandbox) -> bool:
        """Remove the record; whether this call removed it (one of several racing callers)."""
        ...

    async def of_principal(self, principal: str) -> list[E2BSandbox]: ...

    async def count(self, principal: str) -> int: ...

    async def expired(self, now: float, limit: int) -> list[E2BSandbox]: ...


class MemorySandboxStore:
    """The records of a server with no cluster."""

    def __init__(self) -> None:
        self._records: dict[str, E2BSandbox] = {}
        self._claims: dict[str, tuple[str, float]] = {}

    async def claim(self, sandbox_id: str, owner: str, seconds: int) -> bool:
        held = self._claims.get(sandbox_id)
        if held is not None and held[1] > time.monotonic():
            return False
        self._claims[sandbox_id] = (owner, time.monotonic() + seconds)
        return True

    async def release(self, sandbox_id: str, owner: str) -> None:
        if self._claims.get(sandbox_id, ("", 0.0))[0] == owner:
            del self._claims[sandbox_id]

    async def get(self, sandbox_id: str) -> E2BSandbox | None:
        found = self._records.get(sandbox_id)
        return E2BSandbox.from_json(found.to_json()) if found is not None else None

    async def put(self, sandbox: E2BSandbox) -> None:
        self._records[sandbox.sandbox_id] = E2BSandbox.from_json(sandbox.to_json())

    async def add(self, sandbox: E2BSandbox, limit: int) -> bool:
        if await self.count(sandbox.principal) >= limit:  # (no await between: atomic)
            return False
        await self.put(sandbox)
        return True

    async def replace(self, sandbox: E2BSandbox) -> bool:
        if sandbox.sandbox_id not in self._records:
            return False
        await self.put(sandbox)
        return True

    async def delete(self, sandbox: E2BSandbox) -> bool:
        return self._records.pop(sandbox.sandbox_id, None) is not None

    async def of_principal(self, principal: str) -> list[E2BSandbox]:
        mine = [s for s in self._records.values() if s.principal == principal]
        return [E2BSandbox.from_json(s.to_json()) for s in mine]

    async def count(self, principal: str) -> int:
        return sum(1 for s in self._records.values() if s.principal == principal)

    async def expired(self, now: float, limit: int) -> list[E2BSandbox]:
        return [s for s in self._records.values() if s.expired(now)][:limit]


# One record's write, atomic with its check: `replace` only while the record is there (a
# kill between a check and the write cannot be undone by it), `add` only while the principal
# has fewer than ARGV[8] (creates racing on several replicas cannot pass the cap together).
WRITE_SCRIPT = """
if ARGV[7] == 'replace' and redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[7] == 'add' then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[9])
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[8]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[5])
if ARGV[6] ~= '' then redis.call('ZADD', KEYS[3], ARGV[6], ARGV[3])
else redis.call('ZREM', KEYS[3], ARGV[3]) end
return 1
"""

RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


class RedisSandboxStore:
    """The records in the cluster's Redis: `e2b:sandbox:{id}` (JSON, expiring a while after
    the sandbox's end), `e2b:principal:{p}:sandboxes` (ids by end of life) and `e2b:ends`
    (running sandboxes by end of life: whichever replica takes one out first ends it);
    `e2b:transition:{id}` while a pause or resume of it runs (lapsing)."""

    def __init__(self, redis: Any, prefix: str = "") -> None:
        self.redis = redis
        self.prefix = prefix

    def _key(self, sandbox_id: str) -> str:
        return f"{self.prefix}e2b:sandbox:{sandbox_id}"

    def _principal(self, principal: str) -> str:
        return f"{self.prefix}e2b:principal:{principal}:sandboxes"

    def _ends(self) -> str:
        return f"{self.prefix}e2b:ends"

    def _claim(self, sandbox_id: str) -> str:
        return f"{self.prefix}e2b:transition:{sandbox_id}"

    async def claim(self, sandbox_id: str, owner: str, seconds: int) -> bool:
        return bool(await self.redis.set(self._claim(sandbox_id), owner, nx=True, ex=seconds))

    async def release(self, sandbox_id: str, owner: str) -> None:
        await self.redis.eval(RELEASE_SCRIPT, 1, self._claim(sandbox_id), owner)

    async def get(self, sandbox_id: str) -> E2BSandbox | None:
        raw = await self.redis.get(self._key(sandbox_id))
        return E2BSandbox.from_json(raw) if raw else None

    async def put(self, sandbox: E2BSandbox) -> None:
        await self._write(sandbox, "put")

    async def replace(self, sandbox: E2BSandbox) -> bool:
        return await self._write(sandbox, "replace")

    async def add(self, sandbox: E2BSandbox, limit: int) -> bool:
        return await self._write(sandbox, "add", limit)

    async def _write(self, sandbox: E2BSandbox, mode: str, limit: int = 0) -> bool:
        keep = PAUSED_KEEP_SECONDS if sandbox.state == "paused" else 3600
        ttl = max(60, int(sandbox.end_at - time.time()) + keep)
        score = sandbox.end_at if sandbox.state == "running" else time.time() + keep
        keys = [self._key(sandbox.sandbox_id), self._principal(sandbox.principal), self._ends()]
        args = [
            sandbox.to_json(),
            ttl,
            sandbox.sandbox_id,
            score,
            PAUSED_KEEP_SECONDS,
            sandbox.end_at if sandbox.state == "running" else "",
            mode,
            limit,
            time.time() - 3600,  # (what count() prunes first)
        ]
        return bool(await self.redis.eval(WRITE_SCRIPT, len(keys), *keys, *args))

    async def delete(self, sandbox: E2BSandbox) -> bool:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self._key(sandbox.sandbox_id))
        pipe.zrem(self._principal(sandbox.principal), sandbox.sandbox_id)
        pipe.zrem(self._ends(), sandbox.sandbox_id)
        removed, _, _ = await pipe.execute()
        return bool(removed)

    async def of_principal(self, principal: str) -> list[E2BSandbox]:
        key = self._principal(principal)
        await self.redis.zremrangebyscore(key, "-inf", time.time() - 3600)
        ids = [
            i.decode() if isinstance(i, bytes) else i for i in await self.redis.zrange(key, 0, -1)
        ]
        if not ids:
            return []
        raws = await self.redis.mget([self._key(i) for i in ids])
        return [E2BSandbox.from_json(r) for r in raws if r]

    async def count(self, principal: str) -> int:
        key = self._principal(principal)
        await self.redis.zremrangebyscore(key, "-inf", time.time() - 3600)
        return int(await self.redis.zcard(key))

    async def expired(self, now: float, limit: int) -> list[E2BSandbox]:
        ids = await self.redis.zrangebyscore(self._ends(), "-inf", now, start=0, num=limit)
        out = []
        for raw_id in ids:
            sandbox_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
            # Taken out of the set by one replica only: that one ends the sandbox.
            if not await self.redis.zrem(self._ends(), sandbox_id):
                continue
            found = await self.get(sandbox_id)
            if found is not None and found.expired(now):
                out.append(found)
            elif found is not None and found.state == "running":
                await self.redis.zadd(self._ends(), {sandbox_id: found.end_at})  # (extended)
        return out
