"""Placing sessions on workers through a Redis Stream (split roles: DESIGN §16).

An api replica never homes a session. A session that has no live home is put on the stream
`placements` as a request; the workers read it through one consumer group, each only while it
has room for another session (pull: a full worker takes nothing, so the load spreads by
capacity, with no scheduler). The worker that reads a request claims the session (or finds it
claimed meanwhile) and answers on the request's reply list, which the api replica waits on
with a blocking pop, a bounded time: no worker answering within SANDBOX_PLACEMENT_WAIT_SECONDS
is "no worker capacity". A request a worker read and never acknowledged (it died) is claimed
by another worker once it has been idle RECLAIM_IDLE_SECONDS; a request whose caller has
given up is dropped unanswered.

A request's age is read on one clock, Redis's (`TIME`): the api replica stamps it with the
store's time and its wait, the worker compares with the store's time, so replicas' clocks
that differ do not drop requests. With the cluster secret a request carries a proof
(signing.py) and a worker refuses one without a valid proof; with or without it, a request
whose principal or session the MCP edge could not have named is refused. Both are logged and
make no home.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from loguru import logger
from prometheus_client import CollectorRegistry, Gauge

from sandbox_runtime.domain.owner import Owner, valid_owner
from sandbox_runtime.errors import LimitExceededError, OwnerUnavailableError
from sandbox_runtime.sessions.clock import redis_time
from sandbox_runtime.sessions.signing import ClusterSigner, SignatureError

GROUP = "srt-workers"
RECLAIM_IDLE_SECONDS = 5.0
MAX_QUEUED = 10_000  # the stream's length, trimmed approximately
REPLY_TTL_SECONDS = 60
READ_BLOCK_MS = 2000
# The signed parts of a request, in order (the proof is in `mac`).
SIGNED_FIELDS = ("principal", "session", "reply", "issued", "wait", "from")

Take = Callable[[Owner], Awaitable[str]]


class QueueMetrics:
    """What an autoscaler reads: the queue (on api replicas) and the room (on workers)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.depth = Gauge("srt_placement_queue_depth", "New sessions waiting for a worker "
                           "(unread or being placed).", registry=r)  # fmt: skip
        self.oldest = Gauge("srt_placement_queue_oldest_seconds", "Age of the oldest waiting "
                            "placement request.", registry=r)  # fmt: skip
        self.sessions = Gauge("srt_worker_sessions", "Sessions homed on this worker.",
                              registry=r)  # fmt: skip
        self.capacity = Gauge("srt_worker_capacity_sessions", "Sessions this worker takes at "
                              "most (SANDBOX_WORKER_MAX_SESSIONS).", registry=r)  # fmt: skip


class PlacementQueue:
    def __init__(
        self,
        redis: Any,
        prefix: str,
        replica_id: str,
        wait_seconds: float,
        signer: ClusterSigner | None = None,
    ) -> None:
        self.redis = redis
        self.signer = signer  # (None: no cluster secret; requests are neither signed nor checked)
        self.stream = f"{prefix}srt:placements"
        self.replies = f"{prefix}srt:placement-reply:"
        self.replica_id = replica_id
        self.wait_seconds = wait_seconds
        self.served = 0
        self.refused = 0  # requests dropped as forged or malformed

    # -- the api's side ----------------------------------------------------------------------

    async def place(self, owner: Owner) -> str:
        """Ask the workers to home `owner`'s session: the worker that did. Raises
        LimitExceededError (no worker took it in time), OwnerUnavailableError (no store)."""
        request = secrets.token_hex(12)
        reply = self.replies + request
        try:
            fields = {
                "principal": owner.principal,
                "session": owner.session_id,
                "reply": reply,
                "issued": f"{await self._store_time():.6f}",  # (the store's clock: see above)
                "wait": f"{self.wait_seconds:g}",
                "from": self.replica_id,
            }
            if self.signer is not None:
                fields["mac"] = self.signer.sign_placement(tuple(fields[k] for k in SIGNED_FIELDS))
            await self.redis.xadd(self.stream, fields, maxlen=MAX_QUEUED, approximate=True)
            answer = await self.redis.blpop([reply], timeout=self.wait_seconds)
        except Exception as exc:  # the store failed
            raise OwnerUnavailableError(
                f"the shared store is unavailable ({type(exc).__name__}); retry shortly"
            ) from exc
        if answer is None:
            raise LimitExceededError(
                f"no worker capacity: no worker took this session within {self.wait_seconds:g} s "
                "(SANDBOX_PLACEMENT_WAIT_SECONDS); retry shortly"
            )
        body = json.loads(answer[1])
        if "error" in body:
            raise LimitExceededError(str(body["error"]))
        return str(body["home"])

    async def depth(self) -> tuple[int, float]:
        """(requests waiting or being placed, age in seconds of the oldest): for autoscalers."""
        try:
            info = await self.redis.xinfo_groups(self.stream)
        except Exception:
            return 0, 0.0
        lag = 0
        for group in info:
            if _text(group.get("name")) == GROUP:
                lag = int(group.get("lag") or 0) + int(group.get("pending") or 0)
        oldest = 0.0
        if lag:
            first = await self.redis.xrange(self.stream, count=1)
            if first:
                millis = int(_text(first[0][0]).split("-")[0])  # (an entry id: MILLIS-SEQ)
                oldest = max(0.0, await self._store_time() - millis / 1000)
        return lag, oldest

    # -- the worker's side -------------------------------------------------------------------

    async def _group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except Exception as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def serve(self, take: Take, has_room: Callable[[], bool]) -> None:
        """Take placement requests while there is room, until cancelled (a worker's loop)."""
        await self._group()
        while True:
            if not has_room():
                await asyncio.sleep(0.2)
                continue
            entries = await self._reclaimed()
            if not entries:
                read = await self.redis.xreadgroup(
                    GROUP, self.replica_id, {self.stream: ">"}, count=1, block=READ_BLOCK_MS
                )
                entries = [e for _, stream_entries in read or [] for e in stream_entries]
            for entry_id, fields in entries:
                if not has_room():  # (stopping, or full, since the read: another worker's)
                    await self._requeue(entry_id, fields)
                    continue
                await self._answer(take, entry_id, fields)

    async def _requeue(self, entry_id: Any, fields: dict[Any, Any]) -> None:
        """Put back a request read by a worker that can no longer take it: a blocked read
        is handed an entry even after its worker began to stop (SIGTERM: draining)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.stream, fields, maxlen=MAX_QUEUED, approximate=True)
        pipe.xack(self.stream, GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        await pipe.execute()

    async def _reclaimed(self) -> list[Any]:
        """Requests another worker read and never acknowledged (it died), idle long enough."""
        found = await self.redis.xautoclaim(
            self.stream,
            GROUP,
            self.replica_id,
            min_idle_time=int(RECLAIM_IDLE_SECONDS * 1000),
            start_id="0-0",
            count=1,
        )
        claimed = found[1] if isinstance(found, list | tuple) and len(found) > 1 else []
        if claimed:
            logger.info("placement: took over a request another worker left unanswered")
        return list(claimed)

    async def _store_time(self) -> float:
        return await redis_time(self.redis)

    def _refusal(self, fields: dict[str, str]) -> str | None:
        """Why a request must not make a home (None: it may). Raises KeyError (malformed)."""
        parts = tuple(fields[k] for k in SIGNED_FIELDS)
        if self.signer is not None:
            try:
                self.signer.verify_placement(parts, fields.get("mac", ""))
            except SignatureError:
                return "no valid proof of the cluster secret" if "mac" in fields else "unsigned"
        if not fields["reply"].startswith(self.replies):
            return "a reply key outside the queue's"  # (it must not name any other key)
        if not valid_owner(Owner(fields["principal"], fields["session"])):
            return "a principal or session the MCP edge does not accept"
        return None

    async def _answer(self, take: Take, entry_id: Any, raw: dict[Any, Any]) -> None:
        fields = {_text(k): _text(v) for k, v in raw.items()}
        try:
            refusal = self._refusal(fields)
            if refusal is not None:
                logger.warning(
                    "placement: a request from {!r} for principal {!r} session {!r} was refused "
                    "({}); no home made",
                    fields.get("from", "")[:64],
                    fields["principal"][:64],
                    fields["session"][:140],
                    refusal,
                )
                self.refused += 1
                return
            if not float(fields["issued"]) + float(fields["wait"]) >= await self._store_time():
                return  # (its caller has given up; or no time at all)
            owner = Owner(fields["principal"], fields["session"])
            try:
                body: dict[str, str] = {"home": await take(owner)}
            except Exception as exc:  # this worker cannot: say why
                body = {"error": str(exc)}
            self.served += 1
            pipe = self.redis.pipeline(transaction=False)
            pipe.lpush(fields["reply"], json.dumps(body))
            pipe.expire(fields["reply"], REPLY_TTL_SECONDS)
            await pipe.execute()
        except (KeyError, ValueError):
            logger.warning("placement: a malformed request was dropped")
            self.refused += 1
        finally:
            await self.redis.xack(self.stream, GROUP, entry_id)
            await self.redis.xdel(self.stream, entry_id)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
