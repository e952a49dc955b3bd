"""What a new client costs, measured with the official mcp client over HTTP: bench_mcp.py's
first table.

Four servers in the same run, in alternating rounds: ours (`srt-mcp-server`, default
settings), the library's floor (floor_server.py: a minimal FastMCP server with one no-op tool,
which answers every step; "lowlevel": the same tool on the mcp SDK's low-level server, under
FastMCP) and the earlier server (srt-mcp-server 0.2 from PyPI, in a venv of
its own with mcp<2; its `execute_code` and `list_executions`).

Per server and protocol era, new clients one after another, each:

- connect: create its HTTP client and connect (initialize in the legacy era; in the
  2026-07-28 era `server/discover`): the client's own cost, mostly;
- list: `tools/list`, as frameworks do on connecting (the official client lists by itself
  before its first result otherwise);
- first: the first `execute_code echo hi` of the new client. The official client compiles
  the tool's output schema on a tool's first result; "compile" is that (client-side) part;
- later: 3 more calls; read: `list_executions` (a read, no sandbox: its default page);
  status: `get_execution_status` of the last one;
- fresh: (ours) the first call in a session no one has used.

Then 10 workers for a few seconds, each opening a new client, making 5 calls and leaving, over
and over: calls/s. Unnamed calls share the `default` session, which runs 4 executions at most:
each worker names its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mcp.client.session as client_session
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

HERE = Path(__file__).resolve().parent
EARLIER = "sandbox-runtime[server]==0.2.0"
STEPS = ("connect", "list", "first", "compile", "later", "read", "status", "fresh")

# The client's own compile of an output schema, timed where the client does it.
_compiling: list[float] = []
_compile = client_session.ClientSession._output_schema_validator


def _timed_compile(self: Any, name: str, schema: dict[str, Any]) -> Any:
    if name in self._tool_output_validators:
        return _compile(self, name, schema)
    started = time.perf_counter()
    try:
        return _compile(self, name, schema)
    finally:
        _compiling.append(time.perf_counter() - started)


client_session.ClientSession._output_schema_validator = _timed_compile  # type: ignore[method-assign]


@dataclass
class Steps:
    """Latencies (s) of each step over every client."""

    times: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STEPS})
    cps: float = 0.0

    def median(self, step: str) -> float:
        values = self.times[step]
        return statistics.median(values) * 1000 if values else float("nan")


@dataclass(frozen=True)
class Target:
    """A server as this benchmark calls it: its URL, token and the tools of each step."""

    url: str
    token: str
    call: tuple[str, dict[str, Any]]
    read: tuple[str, dict[str, Any]]
    sessions: bool = True  # its call takes a `session` argument


async def _call(c: Client, tool: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    result = await c.call_tool(*tool)
    if result.is_error:
        raise RuntimeError(f"{tool[0]}: {result.content[0]}")
    if isinstance(result.structured_content, dict):
        return result.structured_content
    return json.loads(result.content[0].text)  # type: ignore[union-attr,no-any-return]


def _client(target: Target, mode: str) -> tuple[Any, Client]:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {target.token}"})
    return http, Client(streamable_http_client(target.url, http_client=http), mode=mode)


async def one_client(target: Target, mode: str, steps: Steps, later: int = 3) -> None:
    t = steps.times
    started = time.perf_counter()
    http, client = _client(target, mode)
    async with http, client as c:
        t["connect"].append(time.perf_counter() - started)
        began = time.perf_counter()
        await c.list_tools()
        t["list"].append(time.perf_counter() - began)
        compiled = len(_compiling)
        began = time.perf_counter()
        await _call(c, target.call)
        t["first"].append(time.perf_counter() - began)
        t["compile"].append(sum(_compiling[compiled:]))
        for _ in range(later):
            began = time.perf_counter()
            done = await _call(c, target.call)
            t["later"].append(time.perf_counter() - began)
        began = time.perf_counter()
        await _call(c, target.read)
        t["read"].append(time.perf_counter() - began)
        status = ("noop", {})
        if "execution_id" in done:
            status = ("get_execution_status", {"execution_id": done["execution_id"]})
        began = time.perf_counter()
        await _call(c, status)
        t["status"].append(time.perf_counter() - began)
        if target.sessions and target.call[0] != "noop":
            name, args = target.call
            fresh = (name, {**args, "session": f"fresh-{uuid.uuid4().hex[:12]}"})
            began = time.perf_counter()
            await _call(c, fresh)
            t["fresh"].append(time.perf_counter() - began)


async def churn(target: Target, mode: str, workers: int, seconds: float) -> float:
    """calls/s of `workers` concurrent loops of: a new client, 5 calls, leave."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        nonlocal done
        name, args = target.call
        call = (name, {**args, "session": f"churn-{i}"}) if target.sessions else target.call
        while time.perf_counter() < stop:
            http, client = _client(target, mode)
            async with http, client as c:
                for _ in range(5):
                    await _call(c, call)
                    done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(workers)))
    return done / (time.perf_counter() - started)


MODES = {"modern": "auto", "legacy": "legacy"}


async def measure(
    targets: dict[str, Target], clients: int, rounds: int, seconds: float
) -> dict[tuple[str, str], Steps]:
    out = {(label, era): Steps() for label in targets for era in MODES}
    for target in targets.values():  # (warm up: imports, pools, the first sessions)
        for mode in MODES.values():
            await one_client(target, mode, Steps())
    for _ in range(rounds):
        for label, target in targets.items():
            for era, mode in MODES.items():
                for _ in range(max(1, clients // rounds)):
                    await one_client(target, mode, out[(label, era)])
    for label, target in targets.items():
        for era, mode in MODES.items():
            slow = label == "earlier"  # (~2 calls/s: a few seconds show it)
            out[(label, era)].cps = await churn(target, mode, 10, seconds * (0.5 if slow else 1))
    return out


def report(rows: dict[tuple[str, str], Steps]) -> None:
    print(
        "\nnew clients (median ms per step; calls/s: 10 workers each opening a client, making 5 "
        "echo calls, leaving)"
    )
    head = "".join(f"{s:>9}" for s in STEPS)
    print(f"{'server':<9} {'era':<7}{head}{'calls/s':>9}")
    for (label, era), steps in rows.items():
        cells = "".join(f"{steps.median(s):>9.1f}" for s in STEPS)
        print(f"{label:<9} {era:<7}{cells}{steps.cps:>9.0f}")
    if not any(label == "ours" for label, _ in rows):
        return
    print("targets (ours against the floor's no-op and the earlier server, same run):")
    for era in MODES:
        ours, floor = rows[("ours", era)], rows[("floor", era)]
        if ("lowlevel", era) in rows:
            below = rows[("lowlevel", era)].median("later")
            print(f"  {era:<7} fastmcp's no-op {floor.median('later'):.1f} ms, the SDK's "
                  f"low-level server's {below:.1f} ms")  # fmt: skip
        noop = floor.median("later")
        first_server = ours.median("first") - ours.median("compile")
        checks = [
            ("connect <= floor + 3 ms", ours.median("connect"), floor.median("connect") + 3),
            ("first <= 1.2x later", ours.median("first"), 1.2 * ours.median("later")),
            ("first - compile <= 1.2x later", first_server, 1.2 * ours.median("later")),
            ("read (list) <= 2x floor no-op", ours.median("read"), 2 * noop),
            ("read (status) <= 2x floor no-op", ours.median("status"), 2 * noop),
            ("echo <= 2.5x floor no-op", ours.median("later"), 2.5 * noop),
        ]
        for name, got, bound in checks:
            verdict = "OK" if got <= bound else "MISS"
            print(f"  {era:<7} {name:<30} {got:7.1f} vs {bound:7.1f}  {verdict}")
        print(
            f"  {era:<7} {'10 new clients x 5 >= 120/s':<30} {ours.cps:7.0f} "
            f"(floor {floor.cps:.0f})  {'OK' if ours.cps >= 120 else 'MISS'}"
        )
        if ("earlier", era) in rows:
            ratio = rows[("earlier", era)].median("later") / ours.median("later")
            print(
                f"  {era:<7} {'echo >= 60x faster than 0.2':<30} {ratio:7.1f}x"
                f"{'':>12}{'OK' if ratio >= 60 else 'MISS'}"
            )


# -- the floor and the earlier server ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def floor_server(token: str, lowlevel: bool = False) -> Iterator[Target]:
    port = _free_port()
    cmd = [sys.executable, str(HERE / "floor_server.py"), str(port), token]
    cmd += ["--lowlevel"] if lowlevel else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc)
        yield Target(f"http://127.0.0.1:{port}/mcp", token, ("noop", {}), ("noop", {}))
    finally:
        _stop(proc)


def ensure_earlier(venv: Path) -> Path:
    """The venv of srt-mcp-server 0.2 (made with pip when missing: a minute, from PyPI)."""
    server = venv / "bin" / "srt-mcp-server"
    if not server.exists():
        print(f"installing {EARLIER} (mcp<2) into {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "-q", EARLIER, "mcp<2", "httpx"]
        subprocess.run(pip, check=True)
    return server


@contextmanager
def earlier_server(venv: Path, token: str, work: Path) -> Iterator[Target]:
    server = ensure_earlier(venv)
    port = _free_port()
    # (not PYTHONPATH: a checkout's sandbox_runtime on it would shadow 0.2's own)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.pop("PYTHONPATH", None)
    env |= {
        "SANDBOX_AUTH_TOKEN": token,
        "SANDBOX_PORT": str(port),
        "SANDBOX_LOG_FILE": str(work / "earlier.log"),
    }
    out = subprocess.DEVNULL
    proc = subprocess.Popen([str(server)], cwd=work, env=env, stdout=out, stderr=out)
    try:
        _wait_port(port, proc)
        call = ("execute_code", {"command": "echo hi"})
        yield Target(f"http://127.0.0.1:{port}/mcp", token, call, ("list_executions", {}), False)
    finally:
        _stop(proc)
