#!/usr/bin/env python3
"""Write the nginx config for N replicas from sandbox-runtime.conf.template.

    deploy/nginx/generate.py --listen 8080 r1=replica1:8080 r2=replica2:8080 r3=replica3:8080

Each argument is REPLICA_ID=HOST:PORT; REPLICA_ID must equal that replica's
SANDBOX_REPLICA_ID, which it uses to tag the MCP session ids it issues.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TEMPLATE = Path(__file__).with_name("sandbox-runtime.conf.template")
REPLICA = re.compile(r"^(?P<rid>[A-Za-z0-9_-]{1,64})=(?P<addr>[A-Za-z0-9_.:\[\]-]+:\d{1,5})$")


# nginx closes an idle connection to a replica before the replica would (its keep-alive is
# 75 s, server/run.py): a replica closing one just as nginx sends a request on it would cost
# that request a 502 (nginx never replays a POST it has sent).
UPSTREAM_IDLE = "50s"


def render(listen: str, replicas: list[tuple[str, str]]) -> str:
    if not replicas:
        raise ValueError("at least one replica is required")
    ids = [rid for rid, _ in replicas]
    if len(set(ids)) != len(ids):
        raise ValueError("replica ids must be unique")
    blocks = []
    for rid, addr in replicas:
        lines = [f"upstream srt_{_ident(rid)} {{"]
        lines += [f"    server {addr} max_fails=1 fail_timeout=5s;"]
        lines += [f"    server {other} backup;" for orid, other in replicas if orid != rid]
        lines += ["    keepalive 16;", f"    keepalive_timeout {UPSTREAM_IDLE};", "}"]
        blocks.append("\n".join(lines))
    everyone = ["upstream srt_all {", "    least_conn;"]
    everyone += [f"    server {addr} max_fails=1 fail_timeout=5s;" for _, addr in replicas]
    everyone += ["    keepalive 32;", f"    keepalive_timeout {UPSTREAM_IDLE};", "}"]
    blocks.append("\n".join(everyone))
    by_session = ["upstream srt_by_session {", "    hash $srt_session_name consistent;"]
    by_session += [f"    server {addr} max_fails=1 fail_timeout=5s;" for _, addr in replicas]
    by_session += ["    keepalive 32;", f"    keepalive_timeout {UPSTREAM_IDLE};", "}"]
    blocks.append("\n".join(by_session))
    by_sandbox = ["upstream srt_by_sandbox {", "    hash $http_e2b_sandbox_id consistent;"]
    by_sandbox += [f"    server {addr} max_fails=1 fail_timeout=5s;" for _, addr in replicas]
    by_sandbox += ["    keepalive 32;", f"    keepalive_timeout {UPSTREAM_IDLE};", "}"]
    blocks.append("\n".join(by_sandbox))
    session_map = "\n".join(f"    ~^{re.escape(rid)}\\. srt_{_ident(rid)};" for rid, _ in replicas)
    text = TEMPLATE.read_text()
    text = text.replace("# @@UPSTREAMS@@", "\n\n".join(blocks))
    text = text.replace("# @@SESSION_MAP@@", session_map)
    return text.replace("@@LISTEN@@", listen)


def _ident(rid: str) -> str:
    return rid.replace("-", "_")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="8080", help="nginx `listen` value (default 8080)")
    parser.add_argument("--output", "-o", help="file to write (default: stdout)")
    parser.add_argument("replicas", nargs="+", help="REPLICA_ID=HOST:PORT")
    args = parser.parse_args(argv)
    replicas = []
    for item in args.replicas:
        match = REPLICA.match(item)
        if not match:
            parser.error(f"not REPLICA_ID=HOST:PORT: {item!r}")
        replicas.append((match["rid"], match["addr"]))
    try:
        text = render(args.listen, replicas)
    except ValueError as exc:
        parser.error(str(exc))
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
