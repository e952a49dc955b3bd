"""Split roles (2 api + 2 workers) against all-in-one replicas, and a worker's death.

Both deployments run side by side on this machine, each with its own redis-server and nginx:
(a) 2 all-in-one replicas behind the shipped session-affine nginx config (running_topology)
and (b) 2 api replicas + 2 workers behind deploy/nginx/split.conf's round robin
(running_split). Both protocol eras, in the same run:

1. `execute_code echo hi` p50/p95 in one named session through nginx (/s/{session}/mcp),
   back to back, after a warm-up; calls/s with concurrent clients, each its own session.
2. The api hop: workers have no MCP port, so it is the p50 through an api replica directly
   minus the p50 on an all-in-one replica directly (the session homed there).
3. A worker's death (SIGKILL), two ways: (i) the worker homing a session dies: the time until
   that session's next call (retried) succeeds on the other worker, which waits for the dead
   one's heartbeat to expire (SANDBOX_HEARTBEAT_TTL=3); (ii) a new session's placement
   request is read by a worker that dies before answering (both workers SIGSTOPped, the
   request sent, its holder SIGKILLed, the other SIGCONTed): the time until the other worker
   reclaims it (XAUTOCLAIM once idle 5 s) and the call is answered. Each killed worker is
   replaced (its start-up not timed).

The timed calls of 1 and 2 are interleaved (a, b, and both direct clients, in rotating
order), so drift on this shared machine falls on all of them alike.

    .venv/bin/python bench/bench_split.py [--calls 200] [--clients 10] [--duration 10]
        [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import redis.asyncio as aioredis
from mcp_harness import Conn, Mode, ServerProcess, alive, open_client
from split_harness import TOKEN as SPLIT_TOKEN
from split_harness import Split, running_split
from topology_harness import TOKEN as TOPO_TOKEN
from topology_harness import Topology, running_topology

from sandbox_runtime.sessions.queue import GROUP, READ_BLOCK_MS, RECLAIM_IDLE_SECONDS
from sandbox_runtime.workspaces.images import mounts_under, umount

PRINCIPAL = "default"  # the principal of both harnesses' bearer tokens
STREAM = "srt:placements"  # PlacementQueue.stream (no key prefix)
WARMUP = 5
HOP_TARGET_MS = 2.0
HEARTBEAT_TTL = 3  # both harnesses' SANDBOX_HEARTBEAT_TTL
RETRY_SECONDS = 0.05  # between a refused call and the next, after a worker's death
SETTINGS = {"SANDBOX_LOG_LEVEL": "WARNING", "SANDBOX_ACCESS_LOG": "false"}
# (A placement held by a dead worker is answered after >= 5 s: well within this wait.)
SPLIT_SETTINGS = {**SETTINGS, "SANDBOX_PLACEMENT_WAIT_SECONDS": "30"}
MODES: tuple[Mode, ...] = ("auto", "legacy")
ERA = {"auto": "2026-07-28 (auto)", "legacy": "2025-11-25 (legacy)"}
FORWARDED = "srt_forwarded_calls_total"


class BenchFailure(Exception):
    """Something the benchmark relies on did not hold (not a missed target)."""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def stdout_of(out: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in out.get("output", []) if e.get("type") == "stdout")


async def echo(conn: Conn, session: str) -> dict[str, Any]:
    """`echo hi` in `session`; its structured result."""
    out = await conn.ok("execute_code", command="echo hi", session=session)
    if out.get("exit_code") != 0 or stdout_of(out) != "hi\n":
        raise BenchFailure(f"echo in session {session!r} returned {out}")
    return out


def split_session_url(split: Split, session: str) -> str:
    return f"http://127.0.0.1:{split.nginx.port}/s/{session}/mcp"


def home_of(redis_cli: Callable[..., str], session: str) -> str:
    return redis_cli("hget", f"session:{PRINCIPAL}:s:{session}:home", "home").strip()


def rid(server: ServerProcess) -> str:
    return server.settings["SANDBOX_REPLICA_ID"]


# -- 1 and 2: latency, interleaved ------------------------------------------------------------


async def latency(topo: Topology, split: Split, mode: Mode, calls: int) -> dict[str, list[float]]:
    """`calls` timed calls in each of four sessions, one per route, interleaved."""
    tag = f"{mode}-{uuid.uuid4().hex[:6]}"
    sessions = {k: f"lat-{k}-{tag}" for k in ("nginx_a", "nginx_b", "direct_a", "direct_b")}
    direct_rid, direct = next(iter(topo.replicas.items()))
    urls = {
        "nginx_a": (topo.session_url(sessions["nginx_a"]), TOPO_TOKEN),
        "nginx_b": (split_session_url(split, sessions["nginx_b"]), SPLIT_TOKEN),
        "direct_a": (direct.url, TOPO_TOKEN),
        "direct_b": (split.apis[0].url, SPLIT_TOKEN),
    }
    async with AsyncExitStack() as stack:
        conns = {
            k: await stack.enter_async_context(open_client(url, token, mode))
            for k, (url, token) in urls.items()
        }
        for _ in range(WARMUP):  # (the first call homes each session)
            for k, conn in conns.items():
                await echo(conn, sessions[k])
        home = await asyncio.to_thread(topo.home_of, PRINCIPAL, sessions["direct_a"])
        if home != direct_rid:
            raise BenchFailure(f"direct session homed on {home!r}, not on {direct_rid!r}")
        forwarded_before = await topo_forwarded(topo)
        times: dict[str, list[float]] = {k: [] for k in conns}
        kinds = list(conns)
        for i in range(calls):
            for k in kinds[i % 4 :] + kinds[: i % 4]:
                started = time.perf_counter()
                await echo(conns[k], sessions[k])
                times[k].append(time.perf_counter() - started)
        forwarded = await topo_forwarded(topo) - forwarded_before
    if forwarded:  # (a)'s calls must all run where they arrive: the session's home
        raise BenchFailure(f"{mode}: {forwarded:g} calls of (a) were forwarded between replicas")
    workers = {rid(w) for w in split.workers}
    for k in ("nginx_b", "direct_b"):
        home = await asyncio.to_thread(home_of, split.redis.cli_raw, sessions[k])
        if home not in workers:
            raise BenchFailure(f"session {sessions[k]!r} of (b) homed on {home!r}, not a worker")
    return times


async def topo_forwarded(topo: Topology) -> float:
    values = await asyncio.gather(
        *(asyncio.to_thread(topo.metric, r, FORWARDED) for r in topo.replicas)
    )
    return sum(values)


async def throughput(
    url: Callable[[str], str], token: str, mode: Mode, clients: int, duration: float
) -> tuple[float, list[str]]:
    """(calls/s, the sessions) of `clients` clients calling in a loop, each in its session."""
    sessions = [f"tp-{mode}-{i}-{uuid.uuid4().hex[:6]}" for i in range(clients)]
    async with AsyncExitStack() as stack:
        conns = [
            await stack.enter_async_context(open_client(url(s), token, mode)) for s in sessions
        ]

        async def warm(conn: Conn, session: str) -> None:
            for _ in range(WARMUP):
                await echo(conn, session)

        await asyncio.gather(*(warm(c, s) for c, s in zip(conns, sessions, strict=True)))
        done = 0
        stop = time.perf_counter() + duration

        async def loop(conn: Conn, session: str) -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await echo(conn, session)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(loop(c, s) for c, s in zip(conns, sessions, strict=True)))
        elapsed = time.perf_counter() - started
    return done / elapsed, sessions


# -- 3: a worker's death ----------------------------------------------------------------------


class Workers:
    """The split's workers: which live, which are stopped; kills and replacements; what a
    killed worker left running (its sandboxes), killed by pid at the end."""

    def __init__(self, split: Split, redis: aioredis.Redis) -> None:
        self.split = split
        self.redis = redis
        self.stopped: set[int] = set()
        self.leftovers: list[tuple[int, str]] = []
        self.added = 0
        self.suffix = uuid.uuid4().hex[:4]

    def live(self) -> list[ServerProcess]:
        return [w for w in self.split.workers if w.proc is not None and w.proc.poll() is None]

    def by_id(self, replica_id: str) -> ServerProcess:
        for w in self.live():
            if rid(w) == replica_id:
                return w
        raise BenchFailure(f"no live worker {replica_id!r}")

    def stop(self, worker: ServerProcess) -> None:
        os.kill(worker.pid, signal.SIGSTOP)
        self.stopped.add(worker.pid)

    def cont(self, worker: ServerProcess) -> None:
        os.kill(worker.pid, signal.SIGCONT)
        self.stopped.discard(worker.pid)

    def kill(self, worker: ServerProcess) -> float:
        """SIGKILL `worker`; the perf_counter just after."""
        self.leftovers += worker.descendants()
        assert worker.proc is not None
        worker.proc.kill()
        killed = time.perf_counter()
        self.stopped.discard(worker.pid)
        return killed

    def reap(self) -> None:
        """Let stopped workers go on; kill what killed ones left running (their sandboxes)."""
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()
        for pid, start_time in self.leftovers:
            if alive(pid, start_time):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.leftovers = [(p, s) for p, s in self.leftovers if alive(p, s)]

    async def replace(self) -> None:
        """Start workers until two live, each heartbeating."""
        await asyncio.to_thread(self.reap)
        while len(self.live()) < 2:
            self.added += 1
            name = f"wk-r{self.added}{self.suffix}"
            server = await asyncio.to_thread(self.split.add_worker, name, **SPLIT_SETTINGS)
            deadline = time.monotonic() + 10
            while not await self.redis.exists(f"replica:{rid(server)}"):
                if time.monotonic() > deadline:
                    raise BenchFailure(f"worker {name} did not heartbeat")
                await asyncio.sleep(0.05)


async def homed_session_failover(workers: Workers, mode: Mode) -> dict[str, float]:
    """(i) The worker homing a session is SIGKILLed; its next call is retried until it
    succeeds, on the other worker."""
    split, redis = workers.split, workers.redis
    session = f"fo-{mode}-{uuid.uuid4().hex[:6]}"
    async with open_client(split_session_url(split, session), SPLIT_TOKEN, mode) as conn:
        for _ in range(WARMUP):
            await echo(conn, session)
        home = await asyncio.to_thread(home_of, split.redis.cli_raw, session)
        victim = workers.by_id(home)
        others = [rid(w) for w in workers.live() if w is not victim]
        killed = workers.kill(victim)
        ttl_ms = await redis.pttl(f"replica:{home}")
        expired = time.perf_counter() + max(ttl_ms, 0) / 1000
        refused = 0
        while True:
            started = time.perf_counter()
            try:
                result = await conn.call("execute_code", command="echo hi", session=session)
                ok = not result.is_error
            except Exception:  # (counted as refused as well)
                ok = False
            if ok:
                break
            refused += 1
            if started - killed > 60:
                raise BenchFailure(f"session {session!r} did not move within 60 s")
            await asyncio.sleep(RETRY_SECONDS)
        succeeded = time.perf_counter()
    out = dict(result.structured_content or {})
    reset = out.get("session_reset") or {}
    new_home = await asyncio.to_thread(home_of, split.redis.cli_raw, session)
    if new_home not in others or reset.get("reason") != "home_lost" or stdout_of(out) != "hi\n":
        raise BenchFailure(f"session {session!r} after its home died: on {new_home!r}, {out}")
    await workers.replace()
    return {
        "total": succeeded - killed,
        "expiry": expired - killed,
        "after": succeeded - expired,
        "last_call": succeeded - started,
        "refused": refused,
    }


async def held_placement_failover(workers: Workers, mode: Mode) -> dict[str, float] | None:
    """(ii) Both workers SIGSTOPped; a new session's placement request is read by one of them
    (its XREADGROUP was blocked in Redis); that one is SIGKILLed, the other SIGCONTed: the
    time until the other reclaims the request and the call is answered. None: no worker's
    read was blocked when the request came (try again)."""
    split, redis = workers.split, workers.redis
    session = f"fq-{mode}-{uuid.uuid4().hex[:6]}"
    pair = workers.live()
    async with open_client(split_session_url(split, session), SPLIT_TOKEN, mode) as conn:

        async def call() -> tuple[dict[str, Any], float]:
            out = await echo(conn, session)
            return out, time.perf_counter()

        for worker in pair:
            workers.stop(worker)
        try:
            sent = time.perf_counter()
            task = asyncio.create_task(call())
            holder, idle_ms, seen = None, 0, 0.0
            while time.perf_counter() - sent < READ_BLOCK_MS / 1000 + 0.5 and not task.done():
                pending = await redis.xpending_range(STREAM, GROUP, min="-", max="+", count=10)
                if pending:
                    seen = time.perf_counter()
                    holder = pending[0]["consumer"]
                    idle_ms = pending[0]["time_since_delivered"]
                    break
                await asyncio.sleep(0.005)
            if holder is None:
                for worker in pair:
                    workers.cont(worker)
                await task
                return None
            victim = workers.by_id(holder)
            (other,) = (w for w in pair if w is not victim)
            delivered = seen - idle_ms / 1000
            killed = workers.kill(victim)
            workers.cont(other)
        finally:
            for worker in pair:
                if worker.pid in workers.stopped:
                    workers.cont(worker)
        acked = None  # (the other worker acknowledges the request once it has replied)
        while not task.done() and acked is None:
            if not await redis.xpending_range(STREAM, GROUP, min="-", max="+", count=10):
                acked = time.perf_counter()
            await asyncio.sleep(0.005)
        out, answered = await task
        acked = answered if acked is None else acked
    new_home = await asyncio.to_thread(home_of, split.redis.cli_raw, session)
    if new_home != rid(other) or out.get("session_reset"):
        raise BenchFailure(f"held session {session!r}: homed on {new_home!r}, {out}")
    await workers.replace()
    return {
        "total": answered - killed,
        "delivered_to_kill": killed - delivered,
        "reclaimed": acked - killed,
        "after_reply": answered - acked,
        "call": answered - sent,
    }


# -- the table --------------------------------------------------------------------------------


def p50_p95(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.2f} / {pct(values, 0.95) * 1000:.2f}"


def spread(values: list[float], digits: int = 2) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


async def run_all(topo: Topology, split: Split, args: argparse.Namespace) -> None:
    lat: dict[str, dict[str, list[float]]] = {}
    cps: dict[tuple[str, str], float] = {}
    homes: dict[tuple[str, str], Counter[str]] = {}
    for mode in MODES:
        print(f"  {mode}: {args.calls} interleaved calls on each of 4 routes ...", flush=True)
        lat[mode] = await latency(topo, split, mode, args.calls)
    for mode in MODES:
        for setup in ("a", "b"):
            print(
                f"  {mode}: ({setup}) {args.clients} clients, {args.duration:g} s ...", flush=True
            )
            if setup == "a":
                rate, sessions = await throughput(
                    topo.session_url, TOPO_TOKEN, mode, args.clients, args.duration
                )
                cli = topo.redis.cli_raw
            else:
                rate, sessions = await throughput(
                    lambda s: split_session_url(split, s),
                    SPLIT_TOKEN,
                    mode,
                    args.clients,
                    args.duration,
                )
                cli = split.redis.cli_raw
            cps[mode, setup] = rate
            homes[mode, setup] = Counter(
                [await asyncio.to_thread(home_of, cli, s) or "?" for s in sessions]
            )

    redis = aioredis.Redis.from_url(split.redis.url, decode_responses=True)
    workers = Workers(split, redis)
    fo: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    fq: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    misses = 0
    try:
        for r in range(args.rounds):
            for mode in MODES:
                print(f"  {mode}: worker deaths, round {r + 1}/{args.rounds} ...", flush=True)
                fo[mode].append(await homed_session_failover(workers, mode))
                for _ in range(5):
                    held = await held_placement_failover(workers, mode)
                    if held is not None:
                        fq[mode].append(held)
                        break
                    misses += 1
                else:
                    raise BenchFailure("no worker's read held the placement request, 5 times")
    finally:
        await asyncio.to_thread(workers.reap)
        await redis.aclose()

    # -- print ----------------------------------------------------------------------------
    rows: list[tuple[str, list[str], str]] = []

    def section(title: str) -> None:
        rows.append((title, [], ""))

    def row(label: str, values: list[str], target: str = "") -> None:
        rows.append(("  " + label, values, target))

    section(
        f"execute_code 'echo hi', one named session via nginx, ms p50 / p95 ({args.calls} calls)"
    )
    row("(a) 2 all-in-one replicas, session-affine", [p50_p95(lat[m]["nginx_a"]) for m in MODES])
    row("(b) 2 api + 2 workers, round robin", [p50_p95(lat[m]["nginx_b"]) for m in MODES])
    section(f"calls/s, {args.clients} clients each its own session via nginx ({args.duration:g} s)")
    row("(a) 2 all-in-one replicas", [f"{cps[m, 'a']:.1f}" for m in MODES])
    row("(b) 2 api + 2 workers", [f"{cps[m, 'b']:.1f}" for m in MODES])
    section("the same call sent to one replica directly (no nginx), ms p50 / p95")
    row("all-in-one replica, the session homed on it", [p50_p95(lat[m]["direct_a"]) for m in MODES])
    row("api replica -> the session's worker", [p50_p95(lat[m]["direct_b"]) for m in MODES])
    hops, verdicts = [], []
    for m in MODES:
        hop = (statistics.median(lat[m]["direct_b"]) - statistics.median(lat[m]["direct_a"])) * 1000
        hops.append(f"{hop:.2f}")
        verdicts.append("PASS" if hop <= HOP_TARGET_MS else "MISS")
    row(
        "api hop = api p50 - all-in-one p50",
        hops,
        f"<= {HOP_TARGET_MS:g} ms p50: {' / '.join(verdicts)}",
    )
    section(f"worker SIGKILLed -> its work runs elsewhere, s: median (min-max) of {args.rounds}")

    def death(label: str, runs: dict[str, list[dict[str, float]]], key: str) -> None:
        digits = 0 if key == "refused" else 2
        row(label, [spread([x[key] for x in runs[m]], digits) for m in MODES])

    death("(i) homed session: kill -> its next call succeeds", fo, "total")
    death("    kill -> its heartbeat expired (PTTL at kill)", fo, "expiry")
    death("    expired -> call succeeded", fo, "after")
    death("    of which the successful call itself", fo, "last_call")
    death("    calls refused meanwhile (retried every 50 ms)", fo, "refused")
    death("(ii) held placement: kill -> the call answered", fq, "total")
    death("    request delivered to the victim -> kill", fq, "delivered_to_kill")
    death("    kill -> the other worker reclaimed and answered it", fq, "reclaimed")
    death("    its reply -> the call answered (api -> worker)", fq, "after_reply")
    death("    the whole call (sent -> answered)", fq, "call")

    width = max(len(label) for label, values, _ in rows if values) + 2
    col = max(22, max((len(v) for _, vs, _ in rows for v in vs), default=0) + 2)
    head = f"{'':<{width}}" + "".join(f"{ERA[m]:>{col}}" for m in MODES) + "   target"
    print()
    print(head)
    print("-" * len(head))
    for label, values, target in rows:
        if not values:
            print(label)
            continue
        line = f"{label:<{width}}" + "".join(f"{v:>{col}}" for v in values)
        print(line + (f"   {target}" if target else ""))
    print()
    print("notes:")
    print(
        f"- {os.cpu_count()} cores shared by everything: (a) 2 server processes, (b) 4 (2 api + "
        "2 workers), each deployment with its own redis-server and nginx; both stay up all run "
        "(the idle one costs little), the timed calls of the first and third section interleaved."
    )
    for m in MODES:
        for setup in ("a", "b"):
            spread_homes = " ".join(f"{h}:{n}" for h, n in sorted(homes[m, setup].items()))
            print(f"- {ERA[m]} ({setup}) throughput sessions homed on: {spread_homes}")
    print(
        "- (i): the api forwards the session's call to its home; a refused connection with the "
        "home's heartbeat alive fails the call ('retry then'); once the heartbeat key expires "
        f"(TTL {HEARTBEAT_TTL} s, beaten every {HEARTBEAT_TTL / 3:g} s: 2-3 s after the kill) "
        "the next call re-places the session through the queue on the other worker "
        "(session_reset home_lost, a new workspace) and runs there."
    )
    print(
        f"- (ii): the request's idle clock starts at its delivery; another worker reclaims it "
        f"once idle {RECLAIM_IDLE_SECONDS:g} s, checking only between its blocking reads "
        f"({READ_BLOCK_MS / 1000:g} s): so delivery -> claim is {RECLAIM_IDLE_SECONDS:g}-"
        f"{RECLAIM_IDLE_SECONDS + READ_BLOCK_MS / 1000:g} s; then it claims the session, makes "
        "its workspace, replies and acknowledges the request (the time seen here: the entry "
        "leaves the pending list, polled every 5 ms); the api then forwards the call to it."
        + (f" ({misses} attempts found no blocked reader and were repeated.)" if misses else "")
    )
    print(f"- {workers.added} replacement workers were started (not timed).")


def loadavg() -> str:
    """The host's load (other work on this machine skews every number here)."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=None, help="timed calls per route (200)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--duration", type=float, default=None, help="seconds per rate (10)")
    parser.add_argument("--rounds", type=int, default=None, help="worker deaths per kind (2)")
    parser.add_argument("--quick", action="store_true", help="30 calls, 3 s, 1 round")
    args = parser.parse_args()
    if args.calls is None:
        args.calls = 30 if args.quick else 200
    if args.duration is None:
        args.duration = 3.0 if args.quick else 10.0
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if min(args.calls, args.clients, args.rounds) < 1 or args.duration <= 0:
        parser.error("--calls, --clients, --duration and --rounds must be positive")

    print(
        "bench_split: (a) 2 all-in-one replicas + redis + nginx (session-affine) vs (b) 2 api + "
        f"2 workers + redis + nginx (round robin), side by side, {os.cpu_count()} cores"
    )
    print("replica settings: " + ", ".join(f"{k}={v}" for k, v in SETTINGS.items()))
    print(f"warm-up: {WARMUP} calls per session before timing; {loadavg()}", flush=True)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="srt-bench-split-") as tmp:
            os.chmod(tmp, 0o711)
            try:
                with (
                    running_topology(Path(tmp) / "a", count=2, **SETTINGS) as topo,
                    running_split(Path(tmp) / "b", **SPLIT_SETTINGS) as split,
                ):
                    asyncio.run(run_all(topo, split, args))
            finally:  # (killed workers' workspaces stay mounted)
                for point in mounts_under(Path(tmp)):
                    umount(point)
    except BenchFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"(whole run {time.perf_counter() - started:.0f} s; {loadavg()})")


if __name__ == "__main__":
    main()
