"""The E2B SDK's first command: Sandbox.create() -> commands.run("echo hi") -> kill(), end to
end with the Python `e2b` SDK (the computesdk-style measure; published peers: Daytona 0.11 s
median, E2B 0.44 s). p50/p95/p99 over --sequential cycles one after another and --bursts
bursts of --width at once, against one server (SANDBOX_E2B=true) on this machine.

    SRT_TEST_RUNTIME_DIR=/work/main/.runtime .venv/bin/python bench/bench_e2b.py
        [--sequential 100] [--bursts 10] [--width 10]

The SDK runs in its own venv (SRT_CLIENTS_E2B_PY, default .clients/e2b-py: scripts/_setup.sh's
ensure_clients makes it). Needs what the server needs (bubblewrap, a sandbox user).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bench_bursts import percentiles  # noqa: E402
from mcp_harness import running_server  # noqa: E402

KEY = "e2b_" + "be" * 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequential", type=int, default=100)
    p.add_argument("--bursts", type=int, default=10)
    p.add_argument("--width", type=int, default=10)
    args = p.parse_args()
    python = os.environ.get("SRT_CLIENTS_E2B_PY") or str(ROOT / ".clients/e2b-py/bin/python")
    with tempfile.TemporaryDirectory(prefix="bench-e2b-") as tmp:
        settings = {
            "SANDBOX_E2B": "true",
            "SANDBOX_AUTH_TOKENS": f"bench:{KEY}",
            "SANDBOX_E2B_MAX_SANDBOXES": "1000",
            "SANDBOX_MAX_SESSIONS_PER_PRINCIPAL": "100000",
            "SANDBOX_ACCESS_LOG": "false",
        }
        with running_server(Path(tmp), **settings) as server:
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            env.update(
                E2B_API_URL=f"{server.base_url}/e2b",
                E2B_SANDBOX_URL=f"{server.base_url}/e2b",
                E2B_API_KEY=KEY,
            )
            proc = subprocess.run(
                [
                    python,
                    str(ROOT / "bench" / "e2b_loop.py"),
                    f"--sequential={args.sequential}",
                    f"--bursts={args.bursts}",
                    f"--width={args.width}",
                ],
                env=env,
                capture_output=True,
                text=True,
                check=False,
                timeout=1800,
            )
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            samples = json.loads(proc.stdout.strip().splitlines()[-1])
    report = {
        "measure": 'Sandbox.create() -> commands.run("echo hi") -> kill(), Python e2b SDK',
        "sequential": percentiles(samples["sequential"]),
        f"bursts_of_{args.width}": percentiles(samples["burst"]),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
