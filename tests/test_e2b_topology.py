"""The E2B API on two replicas behind nginx (the shipped config), each with its own state
directory as on separate machines, sharing a redis-server: the SDK through nginx runs E2B's
examples (pause/resume, the timeout's sweep, a second process included), and a sandbox is the
same sandbox whichever replica a request reaches (its records in Redis, its commands and
files on its session's home)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from split_harness import running_split
from test_e2b_sdk import ALICE, python_driver
from topology_harness import running_topology

pytestmark = pytest.mark.e2e


def test_two_replicas_behind_nginx(tmp_path: Path) -> None:
    with running_topology(
        tmp_path, count=2, SANDBOX_E2B="true", SANDBOX_AUTH_TOKENS=f"alice:{ALICE}"
    ) as topology:
        via_nginx = f"http://127.0.0.1:{topology.nginx.port}"
        r = python_driver("latest", via_nginx, tmp_path, "examples")
        assert r["run"] == {"stdout": "hi\nhello\n", "stderr": "oops\n", "exit": 0}
        assert r["background"] == {"seen": "line1\nline2\nline3\n", "exit": 0}
        assert r["stdin"] == "typed\n" and r["killed"] is True
        assert r["read"] == "first" and r["rename"] == "/home/user/d/renamed.txt"
        assert r["second_process"] == "survives"
        assert r["resumed_read"] == "survives"
        assert r["running_after_timeout"] is False and r["listed_after_timeout"] is False

        first, second = (s.base_url for s in topology.replicas.values())
        created = python_driver("latest", first, tmp_path, "create")
        sid = created["sandbox_id"]
        record = json.loads(topology.redis.cli_raw("get", f"e2b:sandbox:{sid}"))
        assert record["principal"] == "alice" and record["state"] == "running"
        wrote = python_driver("latest", second, tmp_path, "run", sid, "echo across > f; hostname")
        assert wrote["exit"] == 0
        read = python_driver("latest", first, tmp_path, "run", sid, "cat f")
        assert read == {"stdout": "across\n", "exit": 0}
        homes = {topology.home_of("alice", f"e2b-{sid}")}
        assert homes <= set(topology.replicas), homes
        assert python_driver("latest", second, tmp_path, "kill", sid) == {"killed": True}
        assert topology.redis.cli_raw("get", f"e2b:sandbox:{sid}").strip() == ""


def test_split_roles(tmp_path: Path) -> None:
    """api replicas (no sandboxes) behind nginx's split config, workers running the sessions:
    the SDK's examples work the same."""
    with running_split(
        tmp_path, apis=2, workers=1, SANDBOX_E2B="true", SANDBOX_AUTH_TOKENS=f"alice:{ALICE}"
    ) as split:
        r = python_driver("latest", f"http://127.0.0.1:{split.nginx.port}", tmp_path, "examples")
        assert r["run"] == {"stdout": "hi\nhello\n", "stderr": "oops\n", "exit": 0}
        assert r["background"] == {"seen": "line1\nline2\nline3\n", "exit": 0}
        assert r["stdin"] == "typed\n" and r["killed"] is True
        assert r["read"] == "first" and r["second_process"] == "survives"
        assert r["resumed_read"] == "survives"
        assert r["running_after_timeout"] is False
