"""The interpreters' pure parts, in-process: which interpreter makes room for another, and a
kernel's messages as an execution's events (bounded), the caller's environment as code."""

from __future__ import annotations

from typing import Any, cast

import pytest

from sandbox_runtime.domain.models import EventType
from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.errors import InvalidRequestError, LimitExceededError
from sandbox_runtime.execution.execution import Execution
from sandbox_runtime.interpreters.interpreter import (
    MAX_NAMED,
    Interpreter,
    choose_eviction,
    same_limits,
)
from sandbox_runtime.interpreters.outputs import (
    MAX_BUNDLE_BYTES,
    MAX_BUNDLE_ENTRIES,
    MAX_TEXT_CHARS,
    CallOutput,
    bounded_bundle,
    bounded_text,
    env_prelude,
)
from sandbox_runtime.interpreters.runtime import KernelSpec
from sandbox_runtime.sandbox import SandboxLimits

pytestmark = pytest.mark.unit


def interpreter(
    session: str, last_used: float, busy: bool = False, waiting: int = 0
) -> Interpreter:
    return Interpreter(
        Owner("token", session),
        "python",
        cast(Any, None),  # (no kernel: the choice never looks at it)
        SandboxLimits(),
        busy=busy,
        waiting=waiting,
        last_used=last_used,
    )


# -- room for one more interpreter -------------------------------------------------------------


def test_under_the_limit_nothing_is_evicted() -> None:
    assert choose_eviction([interpreter("a", 1.0)], starting=0, limit=2) is None
    assert choose_eviction([], starting=1, limit=2) is None


def test_at_the_limit_the_least_recently_used_idle_interpreter_makes_room() -> None:
    old, busy, queued, recent = (
        interpreter("old", 1.0),
        interpreter("busy", 0.5, busy=True),
        interpreter("queued", 0.2, waiting=1),
        interpreter("recent", 9.0),
    )
    assert choose_eviction([recent, busy, old, queued], starting=0, limit=4) is old


def test_when_all_are_busy_or_starting_the_start_is_refused_naming_them() -> None:
    mine = [interpreter("a", 1.0, busy=True), interpreter("b", 2.0, waiting=3)]
    with pytest.raises(LimitExceededError, match="maximum of 2") as refused:
        choose_eviction(mine, starting=0, limit=2)
    assert "session 'a' (python)" in str(refused.value)
    assert "session 'b' (python)" in str(refused.value)
    # Starts in flight hold slots: one idle interpreter is not room enough when two start.
    with pytest.raises(LimitExceededError):
        choose_eviction([interpreter("c", 1.0)], starting=2, limit=2)


def test_a_refusal_names_at_most_max_named_interpreters() -> None:
    mine = [interpreter(f"s{n:02}", 1.0, busy=True) for n in range(MAX_NAMED + 5)]
    with pytest.raises(LimitExceededError) as refused:
        choose_eviction(mine, starting=0, limit=len(mine))
    assert str(refused.value).count("(python)") == MAX_NAMED


def test_a_caller_asking_other_limits_than_the_running_interpreter_is_refused() -> None:
    running = interpreter("a", 1.0)
    same_limits(running, None)
    same_limits(running, SandboxLimits())
    with pytest.raises(InvalidRequestError, match="other limits"):
        same_limits(running, SandboxLimits().tighten({"memory_mb": 64}))


# -- a kernel's output, bounded ------------------------------------------------------------------


def test_texts_are_cut_at_the_bound_and_not_strings_made_strings() -> None:
    assert bounded_text(None) == "" and bounded_text(12) == "12"
    assert bounded_text("x" * MAX_TEXT_CHARS) == "x" * MAX_TEXT_CHARS
    assert bounded_text("x" * (MAX_TEXT_CHARS + 1)) == "x" * MAX_TEXT_CHARS + " [...]"


def test_a_bundle_keeps_values_within_bounds_and_says_what_it_dropped() -> None:
    bundle, size = bounded_bundle({"text/plain": "hi", "application/json": {"a": 1}})
    assert bundle == {"text/plain": "hi", "application/json": {"a": 1}}
    assert size == len("text/plain") + 2 + len("application/json") + len('{"a": 1}') + 2 * 64
    big, _ = bounded_bundle({"image/png": "x" * (MAX_BUNDLE_BYTES + 1)})
    assert list(big) == ["text/plain"] and "image/png output of" in big["text/plain"]
    many, _ = bounded_bundle({f"t/{n}": "v" for n in range(MAX_BUNDLE_ENTRIES + 3)})
    assert len(many) == MAX_BUNDLE_ENTRIES + 1  # (its last text/plain says what was dropped)
    assert many["text/plain"] == "[3 more MIME types dropped]"
    long_name, _ = bounded_bundle({"m" * 300: "v"})
    assert list(long_name) == ["m" * 255]


class FakeExecution:
    """What CallOutput calls on an execution."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def record_output(self, kind: EventType, text: str) -> None:
        self.events.append((kind, text))

    def record_event(self, kind: EventType, size: int, **fields: object) -> None:
        self.events.append((kind, size, fields))

    def record_dropped(self, size: int, why: str) -> None:
        self.events.append(("dropped", size, why))


def test_a_calls_messages_become_its_events() -> None:
    execution = FakeExecution()
    asked: list[bool] = []
    output = CallOutput(cast(Execution, execution), lambda: asked.append(True))
    output("stream", {"name": "stdout", "text": "out"})
    output("stream", {"name": "stderr", "text": "err"})
    output("execute_result", {"data": {"text/plain": "42"}, "execution_count": 3})
    assert not output.failed
    output("error", {"ename": "E", "evalue": "v", "traceback": ["\x1b[31mline\x1b[0m"]})
    output("input_request", {"prompt": "? ", "password": 1})
    output("dropped", {"bytes": 77})
    output("comm_open", {})  # (anything else: nothing)
    assert output.failed and asked == [True]
    kinds = [event[0] for event in execution.events]
    assert kinds == [
        EventType.STDOUT,
        EventType.STDERR,
        EventType.RESULT,
        EventType.EXCEPTION,
        EventType.INPUT_REQUEST,
        "dropped",
    ]
    assert execution.events[2][2] == {"bundle": {"text/plain": "42"}, "execution_count": 3}
    assert execution.events[3][2] == {"name": "E", "value": "v", "traceback": ["line"]}
    assert execution.events[4][2] == {"prompt": "? ", "password": True}
    assert execution.events[5][1] == 77


# -- the caller's environment ----------------------------------------------------------------------


def spec(language: str, kernel: str = "") -> KernelSpec:
    return KernelSpec(language, kernel or language, [])


def test_the_environment_becomes_each_languages_own_code() -> None:
    env = {"A": "it's", "B": "2"}
    assert env_prelude(spec("python"), {}) == ""
    assert env_prelude(spec("python"), env) == (
        'import os as _srt_os; _srt_os.environ.update({"A": "it\'s", "B": "2"}); del _srt_os\n'
    )
    assert env_prelude(spec("bash"), env) == "export A='it'\\''s'\nexport B='2'\n"
    assert env_prelude(spec("typescript", "deno"), {"A": "1"}) == 'Deno.env.set("A", "1");\n'
    with pytest.raises(InvalidRequestError, match="not supported for r"):
        env_prelude(spec("r", "ir"), env)


def test_relay_gives_a_tcp_kernel_ports_no_connect_retry_can_take() -> None:
    """The relay's connect retries take ephemeral source ports while the kernel starts: the
    kernel's listen ports come from below that range, distinct, skipping one already taken."""
    import importlib.util
    import socket
    from pathlib import Path

    import sandbox_runtime.interpreters as package

    path = Path(package.__file__).parent / "runtime_files" / "srt_kernel_pipe.py"
    spec = importlib.util.spec_from_file_location("srt_kernel_pipe", path)
    assert spec is not None and spec.loader is not None
    relay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(relay)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", relay.LISTEN_FIRST))
        ports = relay._listen_ports(5)
    assert len(set(ports)) == 5 and relay.LISTEN_FIRST not in ports
    assert all(1024 <= port < low for port in ports)
