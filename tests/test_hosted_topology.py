"""Hosted servers in the deployed topology: two replicas (separate machines: state of their
own, the same catalog), Redis and the shipped nginx config. An instance homed on one replica
is used through the other, and through nginx, in both protocol eras."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hosted_harness import text_of
from mcp_harness import open_client
from topology_harness import TOKEN, running_topology

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).resolve().parent / "hosted_servers"
CATALOG = f"""
[servers.snoop]
command = ["/usr/bin/python3", "/opt/srt-server/snoop.py"]
directory = "{SCRIPTS}"

[servers.giant]
command = ["/usr/bin/python3", "/opt/srt-server/giant.py"]
directory = "{SCRIPTS}"
"""


async def test_an_instance_homed_on_one_replica_is_used_through_the_other(
    tmp_path: Path,
) -> None:
    catalog = tmp_path / "servers.toml"
    catalog.write_text(CATALOG)
    with running_topology(
        tmp_path,
        count=2,
        SANDBOX_SERVERS_FILE=str(catalog),
        SANDBOX_POOL_SIZE="0",
        SANDBOX_INTERPRETER_WARM="",
    ) as topology:
        first, second = list(topology.replicas)
        a, b = topology.replicas[first], topology.replicas[second]

        async with open_client(f"{a.base_url}/servers/snoop/mcp", TOKEN) as conn:
            wrote = await conn.client.call_tool("write_state", {"key": "k", "value": "on a"})
            assert not wrote.is_error, wrote
        home = topology.redis.cli_raw("hget", "session:default:srv:snoop:home", "home").strip()
        assert home == first, home
        assert topology.metric(first, "srt_hosted_server_instances") == 1

        for mode in ("legacy", "auto"):
            async with open_client(f"{b.base_url}/servers/snoop/mcp", TOKEN, mode) as conn:
                read = await conn.client.call_tool("read_state", {"key": "k"})
                assert text_of(read) == "on a", read
        # The second replica forwarded: it runs no instance of its own.
        assert topology.metric(second, "srt_hosted_server_instances") == 0
        assert topology.metric(first, "srt_hosted_server_instances") == 1
        assert topology.metric(second, "srt_forwarded_calls_total") >= 2
        # search_tools on the replica that is not the home: the tool list is learned there
        # (by the instance's owner), so this one lists through it.
        async with open_client(b.url, TOKEN) as conn:
            found = (await conn.call("search_tools", query="", server="snoop")).structured_content
        assert found is not None and found["problems"] == [], found
        assert {"snoop", "write_state"} <= {t["tool"] for t in found["tools"]}, found
        assert topology.metric(second, "srt_hosted_server_instances") == 0

        # Through nginx, progress notifications cross the forwarding too; clients at once.
        nginx_url = f"http://127.0.0.1:{topology.nginx.port}/servers/giant/mcp"

        async def one(mode: str) -> list[float]:
            seen: list[float] = []

            async def progress(value: float, total: float | None, message: str | None) -> None:
                seen.append(value)

            async with open_client(nginx_url, TOKEN, mode) as conn:
                done = await conn.client.call_tool(
                    "progress", {"steps": 3}, progress_callback=progress
                )
                assert not done.is_error, done
                listed = await conn.client.list_tools()
                assert {"giant", "many", "progress"} <= {t.name for t in listed.tools}
            return seen

        results = await asyncio.gather(*(one(m) for m in ("legacy", "auto", "legacy", "auto")))
        assert all(r == [1.0, 2.0, 3.0] for r in results), results
        started = sum(
            topology.metric(rid, "srt_hosted_server_starts_total") for rid in topology.replicas
        )
        assert started == 2, started  # one instance each of snoop and giant, wherever homed
        body = json.dumps(
            topology.redis.cli_raw("hgetall", "session:default:srv:giant:home").split()
        )
        assert first in body or second in body, body
