"""The execution layer's pure parts, in-process: requests, the output cursor, retention's
choice, the egress narrowing; and the local cluster's running limit. No sandbox, no Redis."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.models import ExecutionInfo, ExecutionStatus
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import InvalidRequestError, LimitExceededError
from sandbox_runtime.execution.reading import MAX_EVENTS_PER_READ, checked_read
from sandbox_runtime.execution.requests import checked_timeout, command_argv
from sandbox_runtime.execution.retention import evicted
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.sessions.cluster import LocalCluster
from sandbox_runtime.sessions.placements import Placement, Placements, RecentHomes
from sandbox_runtime.supervisor import Supervisor

pytestmark = pytest.mark.unit


def settings(tmp_path: Path, **values: object) -> Settings:
    return Settings(state_dir=tmp_path, _env_file=None, **values)  # type: ignore[call-arg, arg-type]


def test_a_command_string_runs_through_the_shell_and_a_list_as_it_is() -> None:
    assert command_argv("echo hi")[-1] == "echo hi"
    assert command_argv(["python3", "-c", "print(1)"]) == ["python3", "-c", "print(1)"]
    for bad, said in [("   ", "must not be empty"), (42, "string or a list")]:
        with pytest.raises(InvalidRequestError, match=said):
            command_argv(bad)


def test_a_timeout_is_the_default_or_the_callers_within_the_maximum(tmp_path: Path) -> None:
    config = settings(tmp_path, timeout=30, max_timeout=600)
    assert checked_timeout(None, config) == 30
    assert checked_timeout(12, config) == 12.0
    for bad, said in [
        (True, "must be a number"),
        ("5", "must be a number"),
        (float("nan"), "must be positive"),
        (0, "must be positive"),
        (601, "exceeds the server's maximum of 600"),
    ]:
        with pytest.raises(InvalidRequestError, match=said):
            checked_timeout(bad, config)


def test_a_read_is_bounded_and_a_bad_cursor_refused() -> None:
    assert checked_read(0, 10**9, 10**9, 30.0) == (0, MAX_EVENTS_PER_READ, 30.0)
    assert checked_read(5, 3, None, 30.0) == (5, 3, 0.0)
    assert checked_read(5, 3, -4, 30.0) == (5, 3, 0.0)
    for after, limit in [(-1, 1), (True, 1), ("3", 1), (0, 0), (0, False)]:
        with pytest.raises(InvalidRequestError):
            checked_read(after, limit, 0, 30.0)


@dataclass
class Held:
    execution_id: str
    principal: str
    finished_at: float | None
    retained_bytes: int = 0
    info: ExecutionInfo = field(init=False)

    def __post_init__(self) -> None:
        status = ExecutionStatus.RUNNING if self.finished_at is None else ExecutionStatus.COMPLETED
        self.info = ExecutionInfo(
            execution_id=self.execution_id,
            status=status,
            principal=self.principal,
            session_id="default",
            replica_id="r1",
            command="true",
            timeout_seconds=30,
            created_at=0.0,
            finished_at=self.finished_at,
        )

    @property
    def status(self) -> ExecutionStatus:
        return self.info.status

    @property
    def owner(self) -> Owner:
        return Owner(self.principal, "default")


def test_retention_drops_the_expired_then_takes_from_whoever_holds_the_most() -> None:
    held = [
        Held("old", "alice", finished_at=10.0),
        Held("running", "alice", finished_at=None),
        *(Held(f"b{i}", "bob", finished_at=100.0 + i) for i in range(6)),
        Held("a1", "alice", finished_at=150.0),
    ]
    # 120 s retention at t=200: "old" expired; cap 4 of the 7 kept: bob's three oldest go.
    doomed = evicted(held, now=200.0, retention_seconds=120, max_retained=4, budget=10**9)
    assert doomed == {"old", "b0", "b1", "b2"}
    assert "running" not in evicted(held, 10**9, 1, 0, 0)


def test_retention_keeps_each_principal_within_half_the_byte_budget() -> None:
    held = [Held(f"x{i}", "flooder", 100.0 + i, retained_bytes=400) for i in range(5)]
    held.append(Held("quiet", "quiet", 50.0, retained_bytes=100))
    doomed = evicted(held, now=200.0, retention_seconds=10**6, max_retained=100, budget=2000)
    # The flooder may hold 1000 bytes (half): its three oldest go; the quiet one stays.
    assert doomed == {"x0", "x1", "x2"}


def test_placements_forget_the_least_recently_placed_first() -> None:
    placements = Placements(limit=3)
    for name in "abcd":
        placements.remember(name, "r1", Owner("p", name))
    placements.remember("b", "r2", Owner("p", "b"))  # (b is now the most recent)
    placements.remember("e", "r1", Owner("p", "e"))
    assert placements.get("a") is None and placements.get("c") is None
    assert [key for key, _ in placements.homed_at("r1")] == ["d", "e"]
    assert placements.get("b") == ("r2", Owner("p", "b"))


def test_a_recent_home_lives_its_second_unrenewed_and_a_failed_call_forgets_it() -> None:
    homes = RecentHomes(seconds=0.2, limit=2)
    there = Placement(False, "w1", "127.0.0.1:1")
    with homes.trying("s1", there, time.monotonic()):
        pass
    assert homes.get("s1") == there
    homes.remember("s1", Placement(False, "w2", "127.0.0.1:2"), time.monotonic())
    assert homes.get("s1") == there  # (not renewed by use)
    with pytest.raises(LookupError), homes.trying("s1", there, None):
        raise LookupError("the home refused it")
    assert homes.get("s1") is None  # any failure: looked up again
    with homes.trying("s1", there, None):  # (came from the cache, forgotten meanwhile)
        pass
    assert homes.get("s1") is None
    with homes.trying("s1", there, time.monotonic() - 0.3):  # a call longer than the life
        pass
    assert homes.get("s1") is None  # (counted from the lookup, not from the call's end)
    now = time.monotonic()
    homes.remember("s2", there, now)
    homes.remember("here", Placement(True, "me"), now)  # (a local home is never cached)
    assert homes.get("here") is None
    homes.remember("s3", there, now)
    homes.remember("s4", there, now)
    assert homes.get("s2") is None and homes.get("s4") == there  # bounded: oldest first
    time.sleep(0.25)
    assert homes.get("s3") is None and homes.get("s4") is None  # expired


async def test_the_local_cluster_counts_running_executions_per_principal(tmp_path: Path) -> None:
    supervisor = Supervisor()
    cluster = LocalCluster(settings(tmp_path, max_running_per_principal=2), Metrics(), supervisor)
    alice = Owner("alice", "default")
    await cluster.admit(alice, "e1")
    await cluster.admit(Owner("alice", "s:other"), "e2")
    with pytest.raises(LimitExceededError, match="maximum of 2 executions across all"):
        await cluster.admit(alice, "e3")
    await cluster.admit(Owner("bob", "default"), "e4")  # another principal is not held up

    class Ended:
        owner = alice
        execution_id = "e1"

    cluster.finished(Ended())  # type: ignore[arg-type]
    for _ in range(20):
        await asyncio.sleep(0)
        if supervisor.spawned == 0:
            break
    await cluster.admit(alice, "e5")
    assert await cluster.check(starting=True) is None
    assert cluster.store_status == "disabled" and await cluster.unreachable() is None
    await cluster.aclose()
    await supervisor.aclose()
