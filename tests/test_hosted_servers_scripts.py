"""The hostile MCP servers in tests/hosted_servers, run outside any sandbox: each speaks
enough of the protocol for the sandboxed tests to rely on it, and misbehaves as described."""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# (Each test starts a server process and waits out its hangs: integration, not `-m unit`.)
pytestmark = pytest.mark.integration

SERVERS = Path(__file__).resolve().parent / "hosted_servers"
PYTHON = "/usr/bin/python3"
PROTOCOL = "2025-06-18"


class Proc:
    """One server over pipes: a thread reads its stdout lines into a bounded queue."""

    def __init__(
        self, script: str, *argv: str, env: dict[str, str] | None = None, line_limit: int = 16 << 20
    ) -> None:
        self.popen = subprocess.Popen(
            [PYTHON, str(SERVERS / script), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env if env is not None else {"PATH": "/usr/bin:/bin"},
        )
        self.lines: queue.Queue[bytes] = queue.Queue(maxsize=16)
        self.notifications: list[dict] = []
        self.next_id = 0
        self.line_limit = line_limit
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        while True:
            try:
                line = self.popen.stdout.readline(self.line_limit)
            except (OSError, ValueError):
                line = b""
            self.lines.put(line)
            if not line:
                return

    def send(self, msg: dict) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(msg) + "\n").encode())
        self.popen.stdin.flush()

    def request(self, method: str, params: dict | None = None) -> int:
        self.next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)
        return self.next_id

    def line(self, timeout: float) -> bytes | None:
        """The next stdout line (b"" at EOF), or None when none came within `timeout`."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def response(self, request_id: Any, timeout: float = 5.0) -> dict | None:
        """The response to `request_id`; notifications before it are kept. None: no response
        within `timeout` (or EOF)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            line = self.line(left)
            if not line:
                return None
            msg = json.loads(line)
            if "id" not in msg:
                self.notifications.append(msg)
                continue
            assert msg["id"] == request_id, msg
            return msg
        return None

    def call(self, method: str, params: dict | None = None, timeout: float = 5.0) -> dict:
        msg = self.response(self.request(method, params), timeout)
        assert msg is not None, f"no response to {method}"
        return msg

    def tool(self, name: str, arguments: dict | None = None, **kw: Any) -> dict:
        msg = self.call("tools/call", {"name": name, "arguments": arguments or {}}, **kw)
        assert "result" in msg, msg
        return msg["result"]

    def initialize(self) -> dict:
        msg = self.call(
            "initialize",
            {
                "protocolVersion": PROTOCOL,
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"},
            },
        )
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return msg["result"]

    def tools(self) -> dict[str, dict]:
        return {t["name"]: t for t in self.call("tools/list")["result"]["tools"]}

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(5)
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


@contextmanager
def server(script: str, *argv: str, **kw: Any) -> Iterator[Proc]:
    proc = Proc(script, *argv, **kw)
    try:
        yield proc
    finally:
        proc.kill()


def started(proc: Proc, name: str, *tools: str) -> dict[str, dict]:
    """Initialize `proc`, check its answer, and return its tools (which include `tools`)."""
    result = proc.initialize()
    assert result["protocolVersion"] == PROTOCOL
    assert result["capabilities"]["tools"] == {}
    assert result["serverInfo"]["name"] == name and result["serverInfo"]["version"]
    listed = proc.tools()
    for t in listed.values():
        assert t["inputSchema"]["type"] == "object" and "properties" in t["inputSchema"]
    assert set(tools) <= set(listed), listed
    return listed


def text_of(result: dict) -> str:
    assert result["isError"] is False, result
    [content] = result["content"]
    assert content["type"] == "text"
    return content["text"]


def test_mini_basics_ping_unknown_method_and_bad_lines() -> None:
    with server("crash.py") as proc:
        started(proc, "crash", "crash", "ok")
        assert proc.call("ping")["result"] == {}
        assert proc.call("resources/list")["error"]["code"] == -32601
        assert proc.call("tools/call", {"name": "nope"})["error"]["code"] == -32602
        assert proc.popen.stdin is not None
        proc.popen.stdin.write(b"this is not json\n")
        proc.popen.stdin.flush()
        assert (proc.response(None) or {})["error"]["code"] == -32700
        assert text_of(proc.tool("ok")) == "fine"


def test_snoop_reports_and_keeps_state(tmp_path: Path) -> None:
    readable = tmp_path / "secret.txt"
    readable.write_text("top secret " * 20)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "HOSTED_STATE_DIR": str(tmp_path), "MY_TOKEN": "a-Token"}
    try:
        with server("snoop.py", env=env) as proc:
            started(proc, "snoop", "snoop", "write_state", "read_state", "ok")
            assert text_of(proc.tool("ok")) == "fine"
            report = json.loads(
                text_of(
                    proc.tool(
                        "snoop",
                        {
                            "paths": [str(readable), str(tmp_path / "missing")],
                            "dirs": [str(tmp_path)],
                            "host": "127.0.0.1",
                            "port": port,
                            "unix_sockets": [str(tmp_path / "no.sock")],
                            "mark": "A-mark",
                        },
                    )
                )
            )
            assert report["uid"] == os.getuid() and report["gid"] == os.getgid()
            got = {a["what"]: a for a in report["attempts"]}
            assert got["environ self"]["ok"]
            assert got["environ self"]["detail"]["token_in_values"] is True
            assert "MY_TOKEN" in got["environ self"]["detail"]["names"]
            assert got["list /"]["ok"]
            assert got[f"read {readable}"]["detail"] == ("top secret " * 20)[:100]
            assert not got[f"read {tmp_path / 'missing'}"]["ok"]
            assert got[f"list {tmp_path}"]["ok"]
            assert got[f"tcp 127.0.0.1:{port}"]["ok"]
            assert not got[f"unix {tmp_path / 'no.sock'}"]["ok"]
            assert got[f"write {tmp_path / 'mine.txt'}"]["ok"]
            assert got[f"readback {tmp_path / 'mine.txt'}"]["detail"] == "A-mark"
            assert got[f"readback {readable}"]["ok"]

            assert proc.tool("write_state", {"key": "../k/ey", "value": "v1"})["isError"] is False
            assert text_of(proc.tool("read_state", {"key": "../k/ey"})) == "v1"
            assert (tmp_path / "_k_ey").read_text() == "v1"
            assert proc.tool("read_state", {"key": "absent"})["isError"] is True
    finally:
        listener.close()


def test_crash_exits_3_without_answering() -> None:
    with server("crash.py") as proc:
        started(proc, "crash", "crash", "ok")
        assert text_of(proc.tool("ok")) == "fine"
        assert proc.response(proc.request("tools/call", {"name": "crash"})) is None
        assert proc.popen.wait(5) == 3
        assert proc.popen.stderr is not None
        assert b"crashing on purpose" in proc.popen.stderr.read()


def test_flood_writes_junk_lines_and_stderr() -> None:
    with server("flood.py", line_limit=1 << 16) as proc:
        started(proc, "flood", "flood", "stderr_flood", "ok")
        assert text_of(proc.tool("ok")) == "fine"
        proc.request("tools/call", {"name": "flood"})
        for _ in range(50):
            line = proc.line(5)
            assert line and line.endswith(b"\n")
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            assert not isinstance(msg, dict) or ("id" not in msg and "method" not in msg)
    with server("flood.py", line_limit=1 << 16) as proc:
        started(proc, "flood", "flood")
        proc.request("tools/call", {"name": "flood", "arguments": {"mode": "bigline"}})
        for _ in range(3):
            line = proc.line(5)
            assert line and len(line) == 1 << 16 and set(line) == {ord("x")}
    with server("flood.py") as proc:
        started(proc, "flood", "stderr_flood")
        proc.request("tools/call", {"name": "stderr_flood"})
        assert proc.popen.stderr is not None
        got = proc.popen.stderr.read(1 << 20)
        assert len(got) == 1 << 20 and b"junk line" in got


def test_silent_hang_gets_no_answer_but_ok_does() -> None:
    with server("silent.py") as proc:
        started(proc, "silent", "hang", "ok")
        hang = proc.request("tools/call", {"name": "hang"})
        assert proc.response(hang, timeout=1.0) is None
        proc.send(
            {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": hang, "reason": "test"},
            }
        )
        assert text_of(proc.tool("ok")) == "fine"
        assert proc.popen.poll() is None


def test_silent_no_init_never_answers_initialize() -> None:
    with server("silent.py", "--no-init") as proc:
        init = proc.request("initialize", {"protocolVersion": PROTOCOL, "capabilities": {}})
        assert proc.response(init, timeout=0.5) is None
        assert proc.call("ping")["result"] == {}


def test_giant_many_progress_and_a_big_line() -> None:
    with server("giant.py") as proc:
        started(proc, "giant", "giant", "many", "progress", "ok")
        assert text_of(proc.tool("ok")) == "fine"
        assert text_of(proc.tool("many", {"count": 3})) == "sent 3 notifications"
        assert [n["method"] for n in proc.notifications] == ["notifications/message"] * 3
        assert [n["params"]["data"] for n in proc.notifications] == [
            "message 0",
            "message 1",
            "message 2",
        ]
        proc.notifications.clear()
        result = proc.call(
            "tools/call",
            {"name": "progress", "arguments": {"steps": 3}, "_meta": {"progressToken": "p1"}},
        )["result"]
        assert text_of(result) == "done 3 steps"
        assert [
            (n["params"]["progressToken"], n["params"]["progress"]) for n in proc.notifications
        ] == [("p1", 1), ("p1", 2), ("p1", 3)]
        assert text_of(proc.tool("giant", {"mb": 1})) == "x" * (1 << 20)


def test_echoenv_echo_env_and_a_cancelled_slow_call() -> None:
    env = {"PATH": "/usr/bin:/bin", "ONLY_THIS": "1"}
    with server("echoenv.py", env=env) as proc:
        listed = started(proc, "echoenv", "env", "slow", "echo", "ok")
        assert listed["echo"]["outputSchema"]["properties"]["text"] == {"type": "string"}
        result = proc.tool("echo", {"text": "hi there"})
        assert text_of(result) == "hi there" and result["structuredContent"] == {"text": "hi there"}
        assert json.loads(text_of(proc.tool("env")))["ONLY_THIS"] == "1"
        slow = proc.request("tools/call", {"name": "slow", "arguments": {"seconds": 30}})
        proc.send(
            {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": slow, "reason": "test"},
            }
        )
        echo = proc.request("tools/call", {"name": "echo", "arguments": {"text": "after"}})
        msg = proc.response(echo)  # asserts nothing (no answer to slow) comes before it
        assert msg is not None and text_of(msg["result"]) == "after"
        assert proc.response(-1, timeout=0.3) is None
        assert text_of(proc.tool("slow", {"seconds": 0.01})) == "slept 0.01"


def test_wstools_lists_what_its_state_dir_says(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOSTED_STATE_DIR": str(tmp_path)}
    with server("wstools.py", "--many", "3", "--size", "2000", env=env) as proc:
        listed = started(proc, "wstools", "set_tools", "ok", "big_0", "big_2")
        assert len(listed) == 5, sorted(listed)
        assert len(json.dumps(listed["big_1"])) > 2 * 2000, listed["big_1"]
        said = text_of(proc.tool("set_tools", {"names": ["mine_a", "mine_b"], "description": "d"}))
        assert said == "listing 2 tools from now on"
        listed = proc.tools()
        assert listed["mine_a"]["description"] == "d" and "mine_b" in listed, sorted(listed)
        assert text_of(proc.tool("mine_b")) == "mine_b"
        assert text_of(proc.tool("big_0")) == "big"
    with server("wstools.py", env=env) as proc:  # (a new process: the list is the state's)
        assert set(started(proc, "wstools")) == {"set_tools", "ok", "mine_a", "mine_b"}


def unread_input(proc: Proc, wait: float = 1.0) -> int:
    """Write to `proc`'s stdin until the pipe stays full for `wait` seconds (what it reads
    meanwhile is written again); how many bytes it took."""
    assert proc.popen.stdin is not None
    fd = proc.popen.stdin.fileno()
    os.set_blocking(fd, False)
    taken, chunk = 0, b"x" * 65536
    while True:
        try:
            taken += os.write(fd, chunk)
            assert taken < 16 << 20, "the server keeps reading"
            continue
        except BlockingIOError:
            pass
        _, writable, _ = select.select([], [fd], [], wait)
        if not writable:
            return taken


def test_deaf_stops_reading_its_stdin_after_its_answer_or_mid_message() -> None:
    for partial in (0, 5000):
        with server("deaf.py") as proc:
            started(proc, "deaf", "deafen", "chatter", "id", "ok")
            assert text_of(proc.tool("ok", {"pad": "x" * 1000})) == "fine"
            first = text_of(proc.tool("id"))
            assert len(first) == 16
            deaf = proc.tool("deafen", {"partial": partial})
            assert text_of(deaf) == "deaf after 0 pings"
            taken = unread_input(proc)
            assert taken < 1 << 20, taken  # (a pipe, its read-ahead buffer and `partial`)
            assert proc.popen.poll() is None
    with server("deaf.py") as proc:
        started(proc, "deaf", "id")
        assert text_of(proc.tool("id")) != first  # (a process of its own)


def test_deaf_pings_its_client_and_reads_no_answer() -> None:
    with server("deaf.py") as proc:
        started(proc, "deaf", "deafen")
        call = proc.request("tools/call", {"name": "deafen", "arguments": {"pings": 3}})
        pings = [json.loads(proc.line(5) or b"{}") for _ in range(3)]
        assert [(p["id"], p["method"]) for p in pings] == [(f"ping-{i}", "ping") for i in range(3)]
        answer = proc.response(call)
        assert answer is not None and text_of(answer["result"]) == "deaf after 3 pings"
        for p in pings:
            proc.send({"jsonrpc": "2.0", "id": p["id"], "result": {}})
        unread_input(proc)
        assert proc.popen.poll() is None


def test_deaf_chatter_sends_progress_for_the_calls_token() -> None:
    with server("deaf.py") as proc:
        started(proc, "deaf", "chatter")
        params = {"name": "chatter", "arguments": {"count": 3, "size": 10}}
        result = proc.call("tools/call", {**params, "_meta": {"progressToken": "c"}})["result"]
        assert text_of(result) == "chatted 3"
        assert [
            (n["params"]["progressToken"], n["params"]["progress"], n["params"]["message"])
            for n in proc.notifications
        ] == [("c", i, "n" * 10) for i in (1, 2, 3)]
        proc.notifications.clear()
        assert text_of(proc.tool("chatter", {"count": 5})) == "chatted 5"
        assert proc.notifications == []  # (no token: no notifications)
