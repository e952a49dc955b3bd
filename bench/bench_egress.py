"""Egress through the proxy: what the hop sandbox -> relay -> unix socket -> host proxy costs,
against the same traffic straight from the host, all to the network lab's origin (no internet).

1) a 100 MB download (`/bytes/104857600`) with curl, median of --runs: plain HTTP and TLS
   (CONNECT through the proxy; the lab CA via --cacert), from the host directly and from ONE
   sandbox through the proxy (one execute_code runs curl in a loop: the sandbox's start is not
   counted; curl's own -w numbers). Also the CPU each 100 MB costs the host proxy process
   (/proc/<pid>/stat before/after), the relay (the sandbox's pid 1, read inside) and curl.
2) the latency of a small request (`/hello`), --requests sequential ones, a new connection each
   (as a proxy request needs: the proxy closes after one plain-HTTP request), by one python3
   script with http.client: inside a sandbox through the proxy (to the name, resolved by the
   proxy every time, and to the origin's address), and on the host directly to the origin.

    SRT_TEST_RUNTIME_DIR=/work/main/.runtime .venv/bin/python bench/bench_egress.py
        [--runs 5] [--requests 200]

Needs root (the lab's network namespace, the sandboxes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mcp_harness import (
    Conn,
    ServerProcess,
    client_in_task,
    proc_cmdline,
    process_tree,
    running_server,
    runtime_dir,
)
from netlab import NetLab

TOKEN = "bench-egress-token-0123456789"
SIZE = 100 * 1024 * 1024  # 104857600 bytes
WARMUP_REQUESTS = 10
EXEC_TIMEOUT = 240
TICK = os.sysconf("SC_CLK_TCK")
PROXY_MARK = "sandbox_runtime.egress.proxy"

# One request after another, a new connection each; prints the times (ms) as a JSON list.
LATENCY_SCRIPT = """
import http.client, json, sys, time
host, port, target, host_header = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
count, warmup = int(sys.argv[5]), int(sys.argv[6])
times = []
for i in range(warmup + count):
    started = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", target, headers={"Host": host_header})
    reply = conn.getresponse()
    body = reply.read()
    conn.close()
    if reply.status != 200 or not body.startswith(b"hello"):
        sys.exit(f"request {i}: {reply.status} {body[:200]!r}")
    if i >= warmup:
        times.append((time.perf_counter() - started) * 1000)
print(json.dumps(times))
"""


class BenchFailure(Exception):
    """Something the benchmark relies on did not hold."""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stat_fields(text: str) -> list[str]:
    """/proc/PID/stat's fields from the third (state) on: [11] utime, [12] stime, [13] cutime,
    [14] cstime, in clock ticks."""
    return text.rsplit(")", 1)[1].split()


def cpu_ticks(pid: int) -> int:
    fields = stat_fields(Path(f"/proc/{pid}/stat").read_text())
    return int(fields[11]) + int(fields[12])


def proxy_pid(server: ServerProcess) -> int:
    found = [p for p in process_tree(server.pid) if PROXY_MARK in (proc_cmdline(p) or "")]
    if len(found) != 1:
        raise BenchFailure(f"expected one egress proxy below the server, found {found}")
    return found[0]


def stdout_of(result: dict) -> str:
    if result.get("status") != "completed" or result.get("exit_code") != 0:
        events = "".join(e.get("data") or "" for e in result["output"])
        raise BenchFailure(
            f"execution {result.get('status')} exit {result.get('exit_code')} "
            f"({result.get('reason') or result.get('error')}): {events[-1500:]}"
        )
    return "".join(e.get("data") or "" for e in result["output"] if e["type"] == "stdout")


async def run_in_sandbox(conn: Conn, command: str, session: str) -> str:
    result = await conn.ok(
        "execute_code", command=command, session=session, timeout_seconds=EXEC_TIMEOUT
    )
    return stdout_of(result)


# -- 1) throughput ------------------------------------------------------------------------------

CURL_FORMAT = "XFER %{http_code} %{size_download} %{speed_download} %{time_total}\\n"


def parse_transfers(text: str, expected: int) -> list[float]:
    """MB/s of each `XFER` line (curl's speed_download), checking every one moved SIZE."""
    speeds = []
    for line in text.splitlines():
        if line.startswith("XFER "):
            _, code, size, speed, _seconds = line.split()
            if code != "200" or int(size) != SIZE:
                raise BenchFailure(f"a download answered {code} with {size} bytes")
            speeds.append(float(speed) / 1e6)
    if len(speeds) != expected:
        raise BenchFailure(f"{len(speeds)} of {expected} downloads reported:\n{text[-1500:]}")
    return speeds


def direct_curl(lab: NetLab, tls: bool, runs: int) -> list[float]:
    """MB/s of `runs` downloads from the host, straight to the origin (one warm-up first)."""
    if tls:
        target = [
            "--cacert",
            str(lab.ca_path),
            "--resolve",
            f"allowed.test:443:{lab.origin_ip}",
            f"https://allowed.test/bytes/{SIZE}",
        ]
    else:
        target = [f"http://{lab.origin_ip}/bytes/{SIZE}"]
    out = []
    for _ in range(runs + 1):
        done = subprocess.run(
            ["curl", "-sS", "--noproxy", "*", "-o", "/dev/null", "-w", CURL_FORMAT, *target],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise BenchFailure(f"direct curl failed: {done.stderr.strip()}")
        out.append(done.stdout)
    return parse_transfers("".join(out[1:]), runs)


def sandbox_command(lab: NetLab, tls: bool, runs: int) -> str:
    """curl `runs` + 1 times (the first a warm-up) through the proxy, with the relay's (pid 1)
    and the shell's /proc stat lines before and after (the shell's cutime/cstime: curl's CPU)."""
    if tls:
        url = f"--cacert ca.pem https://allowed.test/bytes/{SIZE}"
    else:
        url = f"http://allowed.test/bytes/{SIZE}"
    curl = f"curl -sS -o /dev/null -w '{CURL_FORMAT}' {url}"
    return (
        f"cat > ca.pem <<'PEM'\n{lab.ca_pem.decode()}PEM\n"
        f"{curl} >/dev/null || exit 1\n"
        'echo "RELAY0 $(cat /proc/1/stat)"; echo "SHELL0 $(cat /proc/$$/stat)"\n'
        f"for i in $(seq {runs}); do {curl} || exit 1; done\n"
        'echo "RELAY1 $(cat /proc/1/stat)"; echo "SHELL1 $(cat /proc/$$/stat)"\n'
    )


def sandbox_cpu(text: str) -> tuple[float, float]:
    """(relay, curl) CPU seconds between the 0 and 1 stat lines of sandbox_command."""
    lines = {
        line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in text.splitlines() if " " in line
    }
    try:
        r0, r1 = stat_fields(lines["RELAY0"]), stat_fields(lines["RELAY1"])
        s0, s1 = stat_fields(lines["SHELL0"]), stat_fields(lines["SHELL1"])
    except (KeyError, IndexError) as exc:
        raise BenchFailure(f"no stat lines from the sandbox ({exc}):\n{text[-1500:]}") from None
    relay = sum(int(r1[i]) - int(r0[i]) for i in (11, 12)) / TICK
    curl = sum(int(s1[i]) - int(s0[i]) for i in (13, 14)) / TICK
    return relay, curl


async def through_proxy(
    conn: Conn, server: ServerProcess, lab: NetLab, tls: bool, runs: int
) -> tuple[list[float], dict[str, float]]:
    """MB/s of `runs` downloads in one sandbox, and CPU seconds per download of the proxy,
    the relay and curl (the proxy's also counts the warm-up download, hence runs + 1)."""
    pid = proxy_pid(server)
    before = cpu_ticks(pid)
    text = await run_in_sandbox(conn, sandbox_command(lab, tls, runs), "bench-egress")
    proxy = (cpu_ticks(pid) - before) / TICK / (runs + 1)
    relay, curl = sandbox_cpu(text)
    cpu = {"proxy": proxy, "relay": relay / runs, "curl": curl / runs}
    return parse_transfers(text, runs), cpu


# -- 2) latency ---------------------------------------------------------------------------------


def direct_latency(lab: NetLab, requests: int) -> list[float]:
    """The latency script on the host (the sandboxes' interpreter), straight to the origin."""
    python = runtime_dir() / "bin" / "python3"
    args = [lab.origin_ip, "80", "/hello", "allowed.test", str(requests), str(WARMUP_REQUESTS)]
    done = subprocess.run(
        [str(python if python.exists() else sys.executable), "-c", LATENCY_SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise BenchFailure(f"the direct latency script failed: {done.stderr.strip()}")
    return list(json.loads(done.stdout))


async def proxy_latency(conn: Conn, host: str, requests: int) -> list[float]:
    """The latency script in a sandbox, through the relay and proxy to http://<host>/hello."""
    args = f"127.0.0.1 3128 http://{host}/hello {host} {requests} {WARMUP_REQUESTS}"
    command = f"python3 - {args} <<'PY'\n{LATENCY_SCRIPT}PY\n"
    return list(json.loads(await run_in_sandbox(conn, command, "bench-egress")))


# -- main ---------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, lab: NetLab, tmp: Path) -> None:
    settings = {
        "SANDBOX_AUTH_TOKEN": TOKEN,
        "SANDBOX_LOG_LEVEL": "WARNING",
        "SANDBOX_ACCESS_LOG": "false",
        "SANDBOX_EGRESS_ALLOW": "allowed.test",
        "SANDBOX_EGRESS_ALLOW_CIDRS": f"{lab.origin_ip}/32",
        "SANDBOX_EGRESS_RESOLVER": lab.resolver,
        "SANDBOX_EGRESS_MAX_MB": "0",
        "SANDBOX_MAX_WAIT": "300",
        "SANDBOX_TIMEOUT": str(EXEC_TIMEOUT),
    }
    with running_server(tmp / "server", **settings) as server:
        async with client_in_task(server.url, TOKEN, "auto") as conn:
            hello = await run_in_sandbox(conn, "curl -sS http://allowed.test/hello", "bench-egress")
            if not hello.startswith("hello"):
                raise BenchFailure(f"the sandbox's first request answered {hello!r}")
            print(
                f"  1) {args.runs} x 100 MB, plain HTTP and TLS, host and sandbox ...", flush=True
            )
            speeds: dict[tuple[str, str], list[float]] = {}
            cpu: dict[str, dict[str, float]] = {}
            for kind, tls in (("http", False), ("tls", True)):
                speeds[kind, "direct"] = await asyncio.to_thread(direct_curl, lab, tls, args.runs)
                speeds[kind, "proxy"], cpu[kind] = await through_proxy(
                    conn, server, lab, tls, args.runs
                )
            print(f"  2) {args.requests} sequential /hello, host and sandbox ...", flush=True)
            latency = {
                "direct": await asyncio.to_thread(direct_latency, lab, args.requests),
                "proxy_name": await proxy_latency(conn, "allowed.test", args.requests),
                "proxy_ip": await proxy_latency(conn, lab.origin_ip, args.requests),
            }

    print()
    print(
        f"{'1) 100 MB download, curl (MB = 10^6 bytes)':<44}{'n':>3}{'direct':>10}"
        f"{'proxy':>10}{'proxy/direct':>14}"
    )
    print("-" * 81)
    for kind, what in (("http", "plain HTTP, median MB/s"), ("tls", "TLS (CONNECT), median MB/s")):
        direct = statistics.median(speeds[kind, "direct"])
        proxy = statistics.median(speeds[kind, "proxy"])
        print(f"{what:<44}{args.runs:>3}{direct:>10.0f}{proxy:>10.0f}{proxy / direct:>14.2f}")
        low = f"{min(speeds[kind, 'direct']):.0f}-{max(speeds[kind, 'direct']):.0f}"
        high = f"{min(speeds[kind, 'proxy']):.0f}-{max(speeds[kind, 'proxy']):.0f}"
        print(f"{'  range (min-max)':<44}{'':>3}{low:>10}{high:>10}")
    print()
    print(f"{'CPU seconds per 100 MB through the proxy':<44}{'proxy':>10}{'relay':>10}{'curl':>10}")
    print("-" * 81)
    for kind, what in (("http", "plain HTTP"), ("tls", "TLS (CONNECT)")):
        c = cpu[kind]
        print(f"{what:<44}{c['proxy']:>10.2f}{c['relay']:>10.2f}{c['curl']:>10.2f}")
    print("(proxy: host process, /proc/<pid>/stat; relay: the sandbox's pid 1; curl: the shell's")
    print(" reaped children. One download takes 100 MB / (proxy MB/s) seconds of wall clock.)")
    print()
    print(
        f"{f'2) /hello x {args.requests}, new connection each (ms)':<52}{'p50':>9}{'p95':>9}"
        f"{'+p50':>9}{'+p95':>9}"
    )
    print("-" * 88)
    d50, d95 = pct(latency["direct"], 0.5), pct(latency["direct"], 0.95)
    for key, what in (
        ("direct", "host -> origin_ip:80 (direct)"),
        ("proxy_name", "sandbox -> proxy -> allowed.test (DNS each time)"),
        ("proxy_ip", "sandbox -> proxy -> origin_ip literal (no DNS)"),
    ):
        p50, p95 = pct(latency[key], 0.5), pct(latency[key], 0.95)
        added = "" if key == "direct" else f"{p50 - d50:>9.2f}{p95 - d95:>9.2f}"
        print(f"{what:<52}{p50:>9.2f}{p95:>9.2f}{added}")
    print("(+p50/+p95: added latency, proxy minus direct; python3 http.client, the same")
    print(f" interpreter both sides, {WARMUP_REQUESTS} warm-up requests not counted)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="100 MB downloads per case")
    parser.add_argument("--requests", type=int, default=200, help="small requests per case")
    args = parser.parse_args()
    if min(args.runs, args.requests) < 1:
        parser.error("--runs and --requests must be positive")
    if os.geteuid() != 0:
        print("bench_egress needs root (network namespace, sandboxes)", file=sys.stderr)
        return 2
    print(
        "bench_egress: network lab origin (netns + veth), one server (egress to allowed.test "
        f"and the origin's /32, no byte budget), curl and python3; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    started = time.perf_counter()
    try:
        with NetLab() as lab, tempfile.TemporaryDirectory(prefix="srt-bench-egress-") as tmp:
            os.chmod(tmp, 0o711)
            asyncio.run(run(args, lab, Path(tmp)))
    except BenchFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"(whole run {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
