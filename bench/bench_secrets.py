"""Secrets at the egress proxy: what terminating TLS, setting a header and re-making TLS to the
real host costs, against a blind CONNECT tunnel to the same origin (the network lab's, no
internet). One server; a secret rule binds `bound.allowed.test`, none `blind.allowed.test`;
both resolve to the lab's origin, which has one certificate for both.

1) requests/s and latency of a small request (`/hello`) from ONE sandbox: a python3 script
   with `requests` (keep-alive: one connection, --requests requests) and with a new
   connection each request (--requests / 4: a TLS handshake, twice for the bound host).
2) a 100 MB download (`/bytes/104857600`) and a 100 MB upload (PUT, chunked, to /echo) with
   curl, median MB/s of --runs, each way (bound: terminated + re-encrypted + masked; blind:
   bytes copied).

    SRT_TEST_RUNTIME_DIR=/work/main/.runtime .venv/bin/python bench/bench_secrets.py
        [--runs 3] [--requests 400]

Needs root (the lab's network namespace, the sandboxes).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_egress import BenchFailure, pct, run_in_sandbox
from mcp_harness import client_in_task, running_server
from netlab import NetLab

TOKEN = "bench-secrets-token-0123456789"
SIZE = 100 * 1024 * 1024
KEY = "sk-bench-" + secrets.token_hex(16)
RULES = """
[[rule]]
name = "bench"
secret = "bench"
hosts = ["bound.allowed.test"]
headers = { Authorization = "Bearer {{secret:bench}}" }
"""

REQUESTS_SCRIPT = r"""
import json, sys, time, requests
host, count = sys.argv[1], int(sys.argv[2])
url = f"https://{host}/hello"
verify = "/workspace/both.pem"
s = requests.Session()
for _ in range(10):
    s.get(url, verify=verify).raise_for_status()
started = time.perf_counter()
times = []
for _ in range(count):
    t = time.perf_counter()
    s.get(url, verify=verify).raise_for_status()
    times.append((time.perf_counter() - t) * 1000)
keep = time.perf_counter() - started
fresh = []
for _ in range(max(1, count // 4)):
    t = time.perf_counter()
    with requests.Session() as one:
        one.get(url, verify=verify).raise_for_status()
    fresh.append((time.perf_counter() - t) * 1000)
print(json.dumps({"rps": count / keep, "keep": times, "fresh": fresh}))
"""

CURL = (
    "curl -sS --cacert /workspace/both.pem -o /dev/null "
    "-w 'XFER %{http_code} %{size_download} %{size_upload} %{speed_download} "
    "%{speed_upload}\\n' "
)


def _speeds(text: str, upload: bool) -> list[float]:
    out = []
    for line in text.splitlines():
        if not line.startswith("XFER "):
            continue
        _, code, down, up, speed_down, speed_up = line.split()
        moved = int(up if upload else down)
        if code != "200" or moved < SIZE or (not upload and moved != SIZE):  # (chunk framing)
            raise BenchFailure(f"a transfer moved {moved} bytes (status {code}): {line}")
        out.append(float(speed_up if upload else speed_down) / 1e6)
    return out


async def run(args: argparse.Namespace, lab: NetLab, tmp: Path) -> dict[str, object]:
    lab.set_dns({"bound.allowed.test": [lab.origin_ip], "blind.allowed.test": [lab.origin_ip]})
    rules = tmp / "secrets.toml"
    rules.write_text(RULES)
    settings = {
        "SANDBOX_STATE_DIR": str(tmp / "server" / "state"),
        "SANDBOX_SECRETS_RULES": str(rules),
        "SANDBOX_SECRETS_KEY": base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")} | settings
    await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sandbox_runtime.cli", "secrets", "set", "bench"],
        input=KEY, text=True, env=env, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server_settings = {
        **settings,
        "SANDBOX_AUTH_TOKEN": TOKEN,
        "SANDBOX_LOG_LEVEL": "WARNING",
        "SANDBOX_ACCESS_LOG": "false",
        "SANDBOX_EGRESS_ALLOW": "*.allowed.test",
        "SANDBOX_EGRESS_ALLOW_CIDRS": f"{lab.origin_ip}/32",
        "SANDBOX_EGRESS_RESOLVER": lab.resolver,
        "SANDBOX_EGRESS_UPSTREAM_CA_FILE": str(lab.ca_path),
        "SANDBOX_EGRESS_MAX_MB": "0",
        "SANDBOX_MAX_WAIT": "300",
        "SANDBOX_TIMEOUT": "600",
        "SANDBOX_MEMORY_MB": "1024",
    }
    results: dict[str, object] = {}
    with running_server(tmp / "server", **server_settings) as server:
        async with client_in_task(server.url, TOKEN, "auto") as conn:
            session = "bench-secrets"
            await conn.ok("write_file", path="lab-ca.pem", content=lab.ca_path.read_text(),
                          session=session)  # fmt: skip
            await conn.ok("write_file", path="req.py", content=REQUESTS_SCRIPT, session=session)
            await run_in_sandbox(
                conn, "cat /etc/ssl/certs/ca-certificates.crt lab-ca.pem > both.pem", session
            )
            for host in ("bound", "blind"):
                print(f"  1) {args.requests} requests to {host}.allowed.test ...", flush=True)
                out = await run_in_sandbox(
                    conn, f"python req.py {host}.allowed.test {args.requests}", session
                )
                results[f"requests_{host}"] = json.loads(out.strip().splitlines()[-1])
            for host in ("bound", "blind"):
                print(f"  2) {args.runs} x 100 MB down and up, {host} ...", flush=True)
                url = f"https://{host}.allowed.test"
                down = " ; ".join([f"{CURL} {url}/bytes/{SIZE}"] * args.runs)
                up = " ; ".join([f"head -c {SIZE} /dev/zero | {CURL} -T - {url}/echo"] * args.runs)
                results[f"down_{host}"] = _speeds(await run_in_sandbox(conn, down, session), False)
                results[f"up_{host}"] = _speeds(await run_in_sandbox(conn, up, session), True)
        log = server.stderr_path.read_text()
        if KEY in log:
            raise BenchFailure("the secret's value is in the server's log")
    return results


def report(args: argparse.Namespace, r: dict[str, object]) -> None:
    print()
    print(f"{'1) /hello from one sandbox, python requests':<46}{'bound':>12}{'blind':>12}"
          f"{'added':>10}")  # fmt: skip
    print("-" * 80)
    bound, blind = r["requests_bound"], r["requests_blind"]
    assert isinstance(bound, dict) and isinstance(blind, dict)
    print(f"{'keep-alive requests/s':<46}{bound['rps']:>12.0f}{blind['rps']:>12.0f}")
    for key, what in (("keep", "keep-alive"), ("fresh", "new connection")):
        for q in (0.5, 0.95):
            b, n = pct(bound[key], q), pct(blind[key], q)
            label = f"{what} latency p{int(q * 100)} (ms)"
            print(f"{label:<46}{b:>12.2f}{n:>12.2f}{b - n:>10.2f}")
    print()
    print(f"{'2) 100 MB, curl, median MB/s (10^6 bytes)':<46}{'bound':>12}{'blind':>12}"
          f"{'bound/blind':>12}")  # fmt: skip
    print("-" * 82)
    for way in ("down", "up"):
        b = statistics.median(r[f"{way}_bound"])  # type: ignore[arg-type]
        n = statistics.median(r[f"{way}_blind"])  # type: ignore[arg-type]
        what = "download" if way == "down" else "upload (PUT, chunked)"
        print(f"{what:<46}{b:>12.0f}{n:>12.0f}{b / n:>12.2f}")
    print(f"({args.runs} runs each; bound: TLS terminated with the deployment CA, the header set,")
    print(" the response masked, TLS re-made to the origin; blind: a CONNECT tunnel)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_secrets needs root (network namespace, sandboxes)", file=sys.stderr)
        return 2
    print(f"bench_secrets: network lab origin, one server; {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.2f}")  # fmt: skip
    started = time.perf_counter()
    try:
        with NetLab() as lab, tempfile.TemporaryDirectory(prefix="srt-bench-secrets-") as tmp:
            os.chmod(tmp, 0o711)
            results = asyncio.run(run(args, lab, Path(tmp)))
    except BenchFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    report(args, results)
    print(f"(whole run {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
