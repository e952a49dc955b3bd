"""The cluster listener and the placement queue against a hostile network and a hostile Redis
writer, and against replicas whose clocks differ (issue 40: findings 3, 4, 5, 9 and the slow
heads), in a real split topology: a redis-server, an api replica and a worker (libfaketime for
a skewed clock).

- A worker 15 s ahead or behind takes every placement (the age of a request is read on
  Redis's clock), and its /ready says how far off its clock is.
- Unsigned or forged calls of every size are refused before any body is sent, and 100 of them
  announcing 16 MiB leave the worker's memory flat.
- A head trickled in is cut by the head timeout.
- A captured signed call played again after the worker's SIGKILL and restart is refused: the
  command ran once.
- Forged placement requests in the stream (a bad principal, a bad session, a bad or no MAC)
  make no home, and the worker logs each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from mcp_harness import CLUSTER_SECRET, ServerProcess, eventually, memory_of, open_client
from split_harness import TOKEN, Split, running_split

from sandbox_runtime.server.heads import HEAD_TIMEOUT_SECONDS
from sandbox_runtime.sessions.signing import ClusterSigner

pytestmark = pytest.mark.e2e

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW = 15  # past the placement wait (10 s), inside what signed calls allow (30 s)
PLACEMENT_WAIT = 10
BIG = 16 * 2**20  # MAX_CALL_BYTES
QUICK = {"SANDBOX_INTERPRETER_WARM": ""}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def rid(server: ServerProcess) -> str:
    return server.settings["SANDBOX_REPLICA_ID"]


def beat_of(split: Split, server: ServerProcess) -> dict[str, str]:
    return dict(json.loads(split.redis.cli_raw("get", f"replica:{rid(server)}")))


def rss_kib(server: ServerProcess) -> int:
    return memory_of(server.pid)["VmRSS"] // 1024


@contextlib.contextmanager
def split_with_worker(tmp_path: Path, **worker: str) -> Iterator[tuple[Split, ServerProcess]]:
    """An api replica and one worker (its own settings: `worker`), started."""
    with running_split(tmp_path, apis=1, workers=0, **QUICK) as split:
        server = split.add_worker(unique("wk"), **QUICK, **worker)
        yield split, server


# -- 3: clocks that differ ----------------------------------------------------------------------


@pytest.mark.parametrize("skew", [SKEW, -SKEW], ids=["ahead", "behind"])
async def test_a_worker_with_a_skewed_clock_takes_every_placement_and_says_so(
    tmp_path: Path, skew: int
) -> None:
    if not LIBFAKETIME.exists():  # noqa: ASYNC240
        pytest.fail(f"{LIBFAKETIME} is missing: apt-get install faketime (scripts/test does)")
    faketime = {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{skew:+d}s",
        "FAKETIME_ONLY_CMDS": "python,python3",  # the server, not its mkfs, mount, bwrap, ...
    }
    with split_with_worker(tmp_path, **faketime) as (split, worker):
        sessions = [unique("skew") for _ in range(8)]
        async with open_client(split.apis[0].url, TOKEN, "auto") as conn:
            for session in sessions:  # (each new: placed through the queue)
                result = await conn.ok("execute_code", command="echo placed", session=session)
                assert result["status"] == "completed", result
        for session in sessions:
            home = split.redis.cli_raw("hget", f"session:default:s:{session}:home", "home")
            assert home.strip() == rid(worker)

        def unready() -> dict[str, object] | None:
            resp = httpx2.get(f"{worker.base_url}/ready", timeout=5)
            return resp.json() if resp.status_code == 503 else None

        body = await eventually(unready, 15, "the skewed worker's /ready to say so")
        reason = " ".join(body["reasons"])  # type: ignore[arg-type]
        direction = "ahead of" if skew > 0 else "behind"
        assert "clock is 1" in reason and f"s {direction} the shared store's" in reason, body
        health = worker.health()
        assert abs(health["store_clock_skew_seconds"] - skew) < 2, health
        assert health["status"] == "degraded", health
        assert httpx2.get(f"{split.apis[0].base_url}/ready", timeout=5).status_code == 200


# -- 4: bodies without the secret ---------------------------------------------------------------


def forged_header(incarnation: str, length: int) -> str:
    """A fresh time, a made-up MAC: what passed the old header check."""
    nonce = secrets.token_hex(16)
    return f"v2,{time.time():.6f},{nonce},{incarnation},{length},{'0' * 64},{'1' * 64}"


async def refused_unread(address: str, length: int, header: str | None) -> bytes:
    """A POST's head announcing `length` bytes of body, then, until the worker answers, none of
    the body: the worker's answer (the connection closed after it)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    signature = f"x-srt-cluster-signature: {header}\r\n" if header is not None else ""
    try:
        writer.write(
            f"POST /cluster/v1/call HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{signature}\r\n".encode()
        )
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)  # (to the end: it closes)
    finally:
        writer.close()


async def flood_one(address: str, header: str) -> bytes:
    """Announce 16 MiB and push it as fast as the worker takes it: its answer (b"reset": the
    worker closed the connection with body bytes unread, and the reset beat its answer)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"POST /cluster/v1/call HTTP/1.1\r\nHost: x\r\nContent-Length: {BIG}\r\n"
            f"x-srt-cluster-signature: {header}\r\n\r\n".encode()
        )
        chunk = b"{" + b" " * (2**20 - 1)
        try:
            for _ in range(16):
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 10)
            return await asyncio.wait_for(reader.read(), 10)
        except ConnectionError:
            return b"reset"
    finally:
        writer.close()


async def test_calls_without_the_secret_are_refused_unread_and_memory_stays_flat(
    tmp_path: Path,
) -> None:
    with split_with_worker(tmp_path) as (split, worker):
        incarnation = beat_of(split, worker)["incarnation"]
        address = f"127.0.0.1:{worker.port}"
        for length in (0, 1024, BIG):
            for header in (None, forged_header(incarnation, length)):
                answer = await refused_unread(address, length, header)
                assert answer.startswith(b"HTTP/1.1 403 "), answer[:200]
                assert answer.endswith(b"forbidden\n"), answer[-200:]
        before = rss_kib(worker)
        peak = before

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss_kib(worker))
                await asyncio.sleep(0.05)

        sampler = asyncio.ensure_future(sample())
        try:
            answers = await asyncio.gather(
                *(flood_one(address, forged_header(incarnation, BIG)) for _ in range(100))
            )
        finally:
            sampler.cancel()
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 403 ") or a == b"reset"]
        assert len(refused) == len(answers), {a[:40] for a in answers}
        grown_mb = (peak - before) / 1024
        print(f"worker VmRSS {before / 1024:.0f} MB before, peak {peak / 1024:.0f} MB")
        assert grown_mb < 64, f"the worker grew by {grown_mb:.0f} MB under 100 refused calls"
        assert worker.health()["status"] == "ok"


# -- the slow head ------------------------------------------------------------------------------


async def test_a_head_trickled_in_is_cut_by_the_head_timeout(tmp_path: Path) -> None:
    with split_with_worker(tmp_path) as (_, worker):
        reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
        started = time.monotonic()
        closed_at = None
        try:
            head = b"POST /cluster/v1/call HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: y\r\n" * 50
            for byte in head:
                writer.write(bytes([byte]))
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(1), 0.3) == b"":
                        closed_at = time.monotonic() - started
                        break
        finally:
            writer.close()
        assert closed_at is not None, "the trickled head was held to its end"
        assert HEAD_TIMEOUT_SECONDS <= closed_at < HEAD_TIMEOUT_SECONDS + 3, closed_at


# -- 5: a captured call played again after a restart --------------------------------------------


async def test_a_captured_call_replayed_after_the_workers_restart_is_refused(
    tmp_path: Path,
) -> None:
    with split_with_worker(tmp_path) as (split, worker):
        session = unique("replay")
        async with open_client(split.apis[0].url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="runs.txt", content="", session=session)
        body = json.dumps(
            {
                "op": "execute",
                "principal": "default",
                "session_id": f"s:{session}",
                "args": {"request": {"command": "echo ran >> runs.txt"}, "wait": True},
            }
        ).encode()
        incarnation = beat_of(split, worker)["incarnation"]
        captured = ClusterSigner(CLUSTER_SECRET, "api").sign_call(
            rid(worker), incarnation, "POST", "/cluster/v1/call", body
        )
        url = f"{worker.base_url}/cluster/v1/call"
        headers = {"x-srt-cluster-signature": captured, "content-type": "application/json"}
        async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
            first = await http.post(url, content=body, headers=headers)
            assert first.status_code == 200, first.text
            worker.kill()  # SIGKILL: its nonces die with it
            worker.start()
            await eventually(
                lambda: beat_of(split, worker)["incarnation"] != incarnation,
                15,
                "the restarted worker's heartbeat",
            )
            replayed = await http.post(url, content=body, headers=headers)
        assert replayed.status_code == 403 and replayed.text == "restarted\n", replayed.text
        async with open_client(split.apis[0].url, TOKEN, "auto") as conn:
            runs = await conn.ok("read_file", path="runs.txt", session=session)
        assert runs["content"] == "ran\n", runs


# -- 9: forged placement requests ---------------------------------------------------------------


async def test_forged_placement_requests_make_no_home_and_are_logged(tmp_path: Path) -> None:
    with split_with_worker(tmp_path) as (split, worker):
        redis = split.redis
        signer = ClusterSigner(CLUSTER_SECRET, "forger")

        def request(principal: str, session: str, mac: str | None = "sign") -> str:
            seconds, micros = redis.cli_raw("time").split()
            fields = {
                "principal": principal,
                "session": session,
                "reply": f"srt:placement-reply:{secrets.token_hex(12)}",
                "issued": f"{int(seconds) + int(micros) / 1e6:.6f}",
                "wait": str(PLACEMENT_WAIT),
                "from": "api-forger",
            }
            if mac == "sign":
                mac = signer.sign_placement(tuple(fields.values()))
            if mac is not None:
                fields["mac"] = mac
            redis.cli("xadd", "srt:placements", "*", *[x for kv in fields.items() for x in kv])
            return fields["reply"]

        offset = worker.log_size()
        forged = [
            request("bob\nx", "s:ok", mac=None),  # unsigned, a principal no token has
            request("bob", "s:../../etc", mac=None),
            request("bob", "s:fine", mac="0" * 64),  # a made-up MAC
            request("bob\nx", "s:ok"),  # signed, still named as no MCP caller could be
            request("bob", "s:../../etc"),
            request("bob", "s:" + "x" * 200),
        ]
        genuine = request("bob", "s:fine")
        answer = await eventually(
            lambda: redis.cli_raw("lrange", genuine, "0", "-1").strip(), 20, "the genuine one"
        )
        assert json.loads(answer)["home"] == rid(worker)

        def drained() -> bool:
            groups = redis.cli_raw("xinfo", "groups", "srt:placements")
            return redis.cli_raw("xlen", "srt:placements").strip() == "0" and "lag" in groups

        await eventually(drained, 20, "every request to be read")
        homes = sorted(k for k in redis.cli_raw("keys", "session:*").split("\n") if k)
        assert homes == ["session:bob:s:fine:home"], homes
        assert all(redis.cli_raw("llen", reply).strip() == "0" for reply in forged)
        log = worker.log_since(offset)
        refusals = [line for line in log.splitlines() if "placement: a request" in line]
        assert len(refusals) == len(forged), log
        assert sum("unsigned" in line for line in refusals) == 2, refusals
        assert sum("no valid proof" in line for line in refusals) == 1, refusals
        assert sum("MCP edge does not accept" in line for line in refusals) == 3, refusals
        assert "'bob\\nx'" in log  # (named escaped: a forged name writes no log line of its own)
