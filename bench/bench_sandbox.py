"""Spawn latency of our full sandbox against plain bubblewrap with the same namespaces.

Run as root (the backend drops to its unprivileged sandbox user):

    .venv/bin/python bench/bench_sandbox.py [--seq 100] [--conc 200] [--width 8]

Every latency is one process tree from "start it" to "it has exited and been reaped, its
stdout/stderr drained to EOF"; with N at a time, "start it" is when the batch of N arrived,
for every variant (a Popen-based launcher blocks the event loop while it forks, so timing
from each coroutine's own start would leave out the queueing behind the requests ahead).
Variants, measured in the same process and run, alternating:

- ours:          BubblewrapBackend.spawn + wait (+ aclose): the spawner (already the sandbox
                 uid) starts bwrap and sets its rlimits, a (pooled) cgroup joined, seccomp,
                 generated /etc and /dev (bwrap --dev only where nodes cannot be made), workspace,
                 read-only root, status pipe.
- ours/ahead:    the same sandbox started ahead of need (BubblewrapBackend.prestart, untimed,
                 before the run or the batch), then handed its command (launch) + wait: what
                 a call that finds one waiting in its workspace's pool pays.
- plain/popen:   bwrap with the same namespaces, started with subprocess.Popen and waited for
                 through a pidfd on the event loop, which is how the backend does it.
- plain/asyncio: the same bwrap through asyncio.create_subprocess_exec (child watcher thread).

The backend is a child subreaper and reaps zombie bwraps of its sandbox uid; a plain run
whose exit status it took anyway is counted in the "stolen" column (its latency still counts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_runtime.sandbox import (
    BackendConfig,
    BubblewrapBackend,
    SandboxLimits,
    SandboxProcess,
    SandboxSpec,
)
from sandbox_runtime.sandbox.backend import StartedSandbox, _children

COMMANDS = {
    "true": ["/usr/bin/true"],
    "python3 -c pass": ["/usr/bin/python3", "-c", "pass"],
}
TARGET_RATIO = 1.3
TARGET_TRUE_P50_MS = 15.0


def plain_bwrap_argv(bwrap: str, command: list[str]) -> list[str]:
    args = [
        bwrap,
        "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--die-with-parent", "--new-session",
        "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = f"/{top}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", *command]
    return args


@dataclass
class Samples:
    latencies_ms: list[float] = field(default_factory=list)
    failures: int = 0
    stolen: int = 0

    def p(self, q: float) -> float:
        data = sorted(self.latencies_ms)
        if not data:
            return float("nan")
        if len(data) == 1:
            return data[0]
        return statistics.quantiles(data, n=100, method="inclusive")[int(q) - 1]


class Bench:
    def __init__(self, backend: BubblewrapBackend, workspace: Path, bwrap: str) -> None:
        self.backend = backend
        self.workspace = workspace
        self.bwrap = bwrap
        self.ahead: list[StartedSandbox] = []

    async def ours(self, command: list[str], samples: Samples, arrived: float | None) -> None:
        started = time.perf_counter() if arrived is None else arrived
        proc = await self.backend.spawn(self.spec(command))
        await self.finish(proc, samples, started)

    def spec(self, command: list[str]) -> SandboxSpec:
        return SandboxSpec(
            argv=command, workspace=self.workspace, limits=self.backend.config.limits
        )

    @staticmethod
    async def finish(proc: SandboxProcess, samples: Samples, started: float) -> None:
        """Drain and wait for `proc`; record its latency from `started` and its failure."""
        try:
            _, _, outcome = await asyncio.gather(
                proc.stdout.read(), proc.stderr.read(), proc.wait()
            )
        finally:
            await proc.aclose()
        samples.latencies_ms.append((time.perf_counter() - started) * 1000)
        samples.failures += outcome.exit_code != 0

    async def prepare_ahead(self, count: int) -> None:
        """Start `count` sandboxes ahead (untimed) for the next runs of `ours_ahead`."""
        limits = self.backend.config.limits
        self.ahead += await asyncio.gather(
            *(self.backend.prestart(self.workspace, limits) for _ in range(count))
        )
        await asyncio.sleep(0.05)  # (their stubs are waiting: a pool's would have been)

    async def ours_ahead(self, command: list[str], samples: Samples, arrived: float | None) -> None:
        started = time.perf_counter() if arrived is None else arrived
        proc = self.backend.launch(self.ahead.pop(), self.spec(command))
        await self.finish(proc, samples, started)

    async def plain_popen(
        self, command: list[str], samples: Samples, arrived: float | None
    ) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter() if arrived is None else arrived
        popen = subprocess.Popen(
            plain_bwrap_argv(self.bwrap, command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        PLAIN_LAUNCHED.add(popen.pid)
        popen.returncode = 0  # never let Popen wait on it: we do, below
        exited: asyncio.Future[int | None] = loop.create_future()
        pidfd = os.pidfd_open(popen.pid)

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            try:
                exited.set_result(os.waitstatus_to_exitcode(os.waitpid(popen.pid, 0)[1]))
            except ChildProcessError:  # the backend's orphan reaper got there first
                exited.set_result(None)

        loop.add_reader(pidfd, on_exit)
        assert popen.stdout is not None and popen.stderr is not None
        out = await _drain(loop, popen.stdout)
        err = await _drain(loop, popen.stderr)
        code, _, _ = await asyncio.gather(exited, out, err)
        samples.latencies_ms.append((time.perf_counter() - started) * 1000)
        PLAIN_LAUNCHED.discard(popen.pid)
        reap_plain_orphans(self.backend)
        if code is None:
            samples.stolen += 1
        else:
            samples.failures += code != 0

    async def plain_asyncio(
        self, command: list[str], samples: Samples, arrived: float | None
    ) -> None:
        started = time.perf_counter() if arrived is None else arrived
        proc = await asyncio.create_subprocess_exec(
            *plain_bwrap_argv(self.bwrap, command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        PLAIN_LAUNCHED.add(proc.pid)
        await proc.communicate()
        samples.latencies_ms.append((time.perf_counter() - started) * 1000)
        PLAIN_LAUNCHED.discard(proc.pid)
        reap_plain_orphans(self.backend)
        # asyncio reports 255 when someone else reaped its child (and logs a warning)
        if proc.returncode == 255:
            samples.stolen += 1
        else:
            samples.failures += proc.returncode != 0


PLAIN_LAUNCHED: set[int] = set()  # outer bwraps of plain runs: their runners wait for them


def reap_plain_orphans(backend: BubblewrapBackend) -> None:
    """Reap the reparented inits of the plain-bwrap runs (root-owned, so the backend, which
    reaps only its own sandbox uid's, leaves them): zombies piling up in this process would
    slow every variant down."""
    for pid in _children(os.getpid()):
        if pid in PLAIN_LAUNCHED:
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "\nState:\tZ" in status and status.startswith("Name:\tbwrap"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


async def _drain(loop: asyncio.AbstractEventLoop, pipe: object) -> asyncio.Future[bytes]:
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)

    async def read_all() -> bytes:
        try:
            return await reader.read()
        finally:
            transport.close()

    return asyncio.ensure_future(read_all())


# (command, samples, arrival time of its batch or None): records one latency in samples.
Runner = Callable[[list[str], Samples, float | None], Awaitable[None]]


# Untimed work before a variant's run or batch of `count` (starting sandboxes ahead).
Preparer = Callable[[int], Awaitable[None]]
PREPARE: dict[str, Preparer] = {}


async def sequential(variants: dict[str, Runner], command: list[str], runs: int) -> dict:
    results = {name: Samples() for name in variants}
    names = list(variants)
    for i in range(runs):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate who goes first
        for name in order:
            if name in PREPARE:
                await PREPARE[name](1)
            await variants[name](command, results[name], None)
    return results


async def concurrent(
    variants: dict[str, Runner], command: list[str], runs: int, width: int
) -> dict:
    """`runs` per variant, `width` in flight at once, variants alternating batch by batch."""
    results = {name: Samples() for name in variants}
    names = list(variants)
    for batch in range(-(-runs // width)):
        order = names[batch % len(names) :] + names[: batch % len(names)]
        for name in order:
            n = min(width, runs - batch * width)
            if name in PREPARE:
                await PREPARE[name](n)
            # Latency counts from the batch's arrival for every request in it: a launcher that
            # blocks the loop (Popen) would otherwise hide the wait of the requests behind it.
            arrived = time.perf_counter()
            await asyncio.gather(
                *(variants[name](command, results[name], arrived) for _ in range(n))
            )
    return results


def fmt(x: float) -> str:
    return f"{x:7.1f}"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=100, help="sequential runs per variant")
    parser.add_argument("--conc", type=int, default=200, help="concurrent runs per variant")
    parser.add_argument("--width", type=int, default=8, help="runs in flight at once")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    bwrap = shutil.which("bwrap")
    if bwrap is None:
        print("bwrap is not installed", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="srt-bench-"))
    os.chmod(tmp, 0o711)  # the sandbox user must reach its workspace
    backend = BubblewrapBackend(
        BackendConfig(
            workspace_root=tmp / "workspaces", limits=SandboxLimits(), group_name="srt-bench"
        )
    )
    backend.start()
    if backend.unavailable_reason is not None:
        print(f"sandbox unavailable: {backend.unavailable_reason}", file=sys.stderr)
        return 2
    try:
        bench = Bench(backend, backend.create_workspace("bench"), bwrap)
        variants: dict[str, Runner] = {
            "ours": bench.ours,
            "ours/ahead": bench.ours_ahead,
            "plain/popen": bench.plain_popen,
            "plain/asyncio": bench.plain_asyncio,
        }
        PREPARE["ours/ahead"] = bench.prepare_ahead
        print(f"host: {os.cpu_count()} cpus, cgroups {backend.cgroups.describe()}, {bwrap}")
        for command in COMMANDS.values():
            await sequential(variants, command, args.warmup)

        rows = []
        for label, command in COMMANDS.items():
            seq = await sequential(variants, command, args.seq)
            rows.append((label, f"seq x{args.seq}", seq))
            conc = await concurrent(variants, command, args.conc, args.width)
            rows.append((label, f"{args.width}-wide x{args.conc}", conc))
        report(rows)
        return 0 if all(verdict(label, mode, r)[0] for label, mode, r in rows) else 1
    finally:
        await backend.aclose()
        shutil.rmtree(tmp, ignore_errors=True)


def verdict(label: str, mode: str, results: dict[str, Samples]) -> tuple[bool, str]:
    ours = results["ours"].p(50)
    plain = min(results["plain/popen"].p(50), results["plain/asyncio"].p(50))
    problems = []
    if results["ours/ahead"].p(50) >= ours:
        problems.append("started ahead is not faster than started for the call")
    if ours / plain > TARGET_RATIO:
        problems.append(f"p50 ratio {ours / plain:.2f} > {TARGET_RATIO}")
    if label == "true" and mode.startswith("seq") and ours > TARGET_TRUE_P50_MS:
        problems.append(f"p50 {ours:.1f} ms > {TARGET_TRUE_P50_MS} ms")
    return (not problems, "ok" if not problems else "MISS: " + "; ".join(problems))


def report(rows: list[tuple[str, str, dict[str, Samples]]]) -> None:
    header = (
        f"{'command':<16} {'mode':<12} {'variant':<14} {'n':>4} {'p50 ms':>7} {'p95 ms':>7}"
        f" {'fail':>4} {'stolen':>6}  {'ours/this p50':>13} {'p95':>5}"
    )
    print()
    print(header)
    print("-" * len(header))
    for label, mode, results in rows:
        ours = results["ours"]
        for name, s in results.items():
            ratio = ""
            if name != "ours":
                ratio = f"{ours.p(50) / s.p(50):13.2f} {ours.p(95) / s.p(95):5.2f}"
            print(
                f"{label:<16} {mode:<12} {name:<14} {len(s.latencies_ms):>4} {fmt(s.p(50))}"
                f" {fmt(s.p(95))} {s.failures:>4} {s.stolen:>6}  {ratio}"
            )
        _, text = verdict(label, mode, results)
        print(f"{'':<16} {'':<12} {'verdict':<14} {text}")
        print()
    print(
        f"targets: ours/plain p50 <= {TARGET_RATIO} against the faster plain launcher (every row);"
        f" `true` p50 <= {TARGET_TRUE_P50_MS:.0f} ms (sequential); ours/ahead faster than ours"
    )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
