"""A kernel is code the server does not trust: whatever it sends, the server holds a bounded
amount of it (issue 24, finding 1: three flooding kernels took the server to 3.9 GB).

A real server, real kernels in real sandboxes, the official MCP client; the server's memory
is read from /proc. Every flood is checked to have reached the server (its dropped-bytes
counter, or the call's own events), so a flood that never ran cannot pass for a bounded one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from mcp_harness import ServerProcess, Servers, open_client

pytestmark = pytest.mark.e2e

TOKEN = "flood-test-token-1"
OTHER = "flood-other-token-2"
# The server may grow by this much over the whole module: the bounds are 16 MiB queued and
# one 8 MiB message in flight per kernel, and a few kernels flood at once. Unbounded, the
# first test alone grew it by ~3.8 GB.
RSS_GROWTH_MB = 300

# From a thread of the kernel after its cell returned: messages answering nothing.
THREAD_FLOOD = """
import threading, time
k = get_ipython().kernel
p = "x" * 1_000_000
def go():
    time.sleep(0.3)
    for i in range(400):
        k.session.send(k.iopub_socket, {kind!r}, {content}, parent={{}})
threading.Thread(target=go, daemon=True).start()
"""
STREAM = '{"name": "stdout", "text": p}'
DISPLAY = '{"data": {"text/plain": p}, "metadata": {}, "transient": {}}'
RESULT = '{"data": {"text/plain": p}, "metadata": {}, "execution_count": 1}'


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve(
        "floods",
        SANDBOX_AUTH_TOKENS=f"alice:{TOKEN},bob:{OTHER}",
        SANDBOX_MEMORY_MB="512",
        SANDBOX_CANCEL_GRACE="1",
        SANDBOX_MAX_INTERPRETERS="64",
        SANDBOX_MAX_INTERPRETERS_PER_PRINCIPAL="64",
    )


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def dropped(server: ServerProcess, reason: str = "") -> float:
    """Bytes of kernel messages the server dropped (for `reason`, or the first reason)."""
    return server.metric(TOKEN, "srt_interpreter_dropped_bytes_total{", reason)


@pytest.fixture(scope="module")
def baseline(server: ServerProcess) -> int:
    """The server's RSS once it has run each kind of call once."""

    async def warm() -> None:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("run_code", code="import numpy", session="warm-up")
            await conn.ok("execute_code", command="true", session="warm-up")

    asyncio.run(warm())
    return rss_mb(server.pid)


def session() -> str:
    return f"f-{uuid.uuid4().hex[:8]}"


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


async def others_keep_answering(server: ServerProcess, seconds: float) -> list[float]:
    """Another principal's calls, one after another for `seconds`: how long each took."""
    took: list[float] = []
    async with open_client(server.url, OTHER, "auto") as conn:
        end = time.monotonic() + seconds
        s = session()
        while time.monotonic() < end:
            started = time.monotonic()
            done = await conn.ok("execute_code", command="echo ok", session=s)
            assert stdout_of(done) == "ok\n", done
            code = await conn.ok("run_code", code="print(6 * 7)", session=s)
            assert stdout_of(code) == "42\n", code
            took.append(time.monotonic() - started)
    return took


async def watch_rss(server: ServerProcess, seconds: float) -> int:
    peak = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, rss_mb(server.pid))
        await asyncio.sleep(0.1)
    return peak


async def bounded_while_flooding(server: ServerProcess, baseline: int, seconds: float) -> None:
    """For `seconds`: the server's RSS stays within the bound of its baseline, and another
    principal's calls keep answering."""
    peak, took = await asyncio.gather(
        watch_rss(server, seconds), others_keep_answering(server, seconds)
    )
    assert peak - baseline < RSS_GROWTH_MB, f"server RSS {baseline} -> {peak} MB"
    assert took and max(took) < 10, took


@pytest.mark.parametrize(
    ("kind", "content"),
    [("stream", STREAM), ("display_data", DISPLAY), ("execute_result", RESULT)],
)
async def test_kernels_flooding_between_calls_are_bounded_and_stopped(
    server: ServerProcess, baseline: int, kind: str, content: str
) -> None:
    dropped_before = dropped(server, "unsolicited")
    sessions = [session() for _ in range(3)]
    async with open_client(server.url, TOKEN, "auto") as conn:
        for s in sessions:
            await conn.ok("run_code", code="x = 1", session=s)
            started = await conn.ok(
                "run_code", code=THREAD_FLOOD.format(kind=kind, content=content), session=s
            )
            assert started["status"] == "completed", started
        await bounded_while_flooding(server, baseline, 6.0)
        # Each flood reached the server and was dropped unread...
        flooded = dropped(server, "unsolicited") - dropped_before
        assert flooded > 3 * 64 * 2**20, flooded
        # ...and each flooding kernel was stopped: its session's next call says why.
        for s in sessions:
            after = await conn.ok("run_code", code="print('x' in dir())", session=s)
            assert after["state_reset"] == {"reason": "flooded"}, after
            assert stdout_of(after) == "False\n"
            again = await conn.ok("run_code", code="print(1)", session=s)
            assert again["state_reset"] is None and stdout_of(again) == "1\n"
    assert rss_mb(server.pid) - baseline < RSS_GROWTH_MB


async def test_output_flooding_a_running_call_is_capped_and_the_call_ends(
    server: ServerProcess, baseline: int
) -> None:
    s = session()
    code = "p = 'y' * 1_000_000\nfor i in range(300):\n    print(p, end='', flush=True)\nz = 5"
    async with open_client(server.url, TOKEN, "auto") as conn:
        flood = asyncio.ensure_future(conn.ok("run_code", code=code, session=s))
        await bounded_while_flooding(server, baseline, 4.0)
        result = await flood
        assert result["status"] == "completed", result
        status = await conn.ok(
            "get_execution_status", execution_id=result["execution_id"], session=s
        )
        assert status["stdout_bytes"] == 300 * 10**6, status
        assert status["dropped_bytes"] >= 300 * 10**6 - 10 * 2**20, status
        after = await conn.ok("run_code", code="print(z)", session=s)
        assert after["state_reset"] is None and stdout_of(after) == "5\n"


async def test_a_message_over_the_size_bound_is_dropped_and_the_call_says_so(
    server: ServerProcess,
) -> None:
    s = session()
    code = (
        "k = get_ipython().kernel\n"
        "k.session.send(k.iopub_socket, 'display_data', {'data': {'text/plain': 'z' * 20_000_000},"
        " 'metadata': {}}, parent=k.get_parent())\n"
        "print('after')"
    )
    async with open_client(server.url, TOKEN, "auto") as conn:
        result = await conn.ok("run_code", code=code, session=s)
        assert result["status"] == "completed", result
        assert stdout_of(result) == "after\n"
        truncated = [e for e in result["output"] if e["type"] == "truncated"]
        assert truncated and truncated[0]["dropped_bytes"] > 20_000_000, result["output"]
        assert "over 8388608 bytes" in truncated[0]["message"]
        again = await conn.ok("run_code", code="print(2)", session=s)
        assert again["state_reset"] is None and stdout_of(again) == "2\n"


async def test_a_print_over_the_size_bound_arrives_in_pieces_up_to_the_output_limit(
    server: ServerProcess,
) -> None:
    """One print of 20 MB is one stream message: split (not dropped), then cut by the output
    limit like a command's output."""
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        result = await conn.ok(
            "run_code", code="print('x' * 9_000_000 + 'é' * 6_000_000 + 'end')", session=s
        )
        assert result["status"] == "completed", result
        status = await conn.ok(
            "get_execution_status", execution_id=result["execution_id"], session=s
        )
        assert status["stdout_bytes"] == 9_000_000 + 12_000_000 + 4, status
        assert status["dropped_bytes"] == status["stdout_bytes"] - 10 * 2**20, status
        page = await conn.ok(  # (the first event after `ready`)
            "get_execution_output",
            execution_id=result["execution_id"],
            last_event_id="1",
            session=s,
        )
        first = page["output"][0]
        assert first["type"] == "stdout" and set(first["data"]) == {"x"}, first["type"]


@pytest.mark.parametrize("channel", ["shell", "stdin"])
async def test_big_messages_on_the_shell_and_stdin_channels_are_bounded(
    server: ServerProcess, baseline: int, channel: str
) -> None:
    """Messages on the request channels, claiming to answer the running call."""
    s = session()
    socket = "k.shell_stream" if channel == "shell" else "k.stdin_socket"
    kind = "execute_reply" if channel == "shell" else "input_request"
    code = (
        "k = get_ipython().kernel\np = 'q' * 2_000_000\n"
        "for i in range(200):\n"
        f"    k.session.send({socket}, {kind!r}, {{'status': 'ok', 'prompt': p, 'x': p}},"
        " parent=k.get_parent('shell'), ident=k._parent_ident['shell'])\n"
    )
    dropped_before = dropped(server, "unsolicited") + dropped(server, "over_bound")
    async with open_client(server.url, TOKEN, "auto") as conn:
        flood = asyncio.ensure_future(conn.call("run_code", code=code, session=s))
        await bounded_while_flooding(server, baseline, 5.0)
        result = await asyncio.wait_for(flood, 60)  # it ends (how is the flood's business)
        assert result.structured_content is not None
        execution_id = result.structured_content["execution_id"]
        # The server read the flood: what it did not drop became bounded input requests.
        prompts: list[str] = []
        cursor, more = "0", True
        while more:
            page = await conn.ok(
                "get_execution_output", execution_id=execution_id, last_event_id=cursor, session=s
            )
            prompts += [e["prompt"] for e in page["output"] if e["type"] == "input_request"]
            cursor, more = page["next_cursor"], page["has_more"]
        assert all(len(prompt) <= 8192 + 6 for prompt in prompts)
        read = dropped(server, "unsolicited") + dropped(server, "over_bound") - dropped_before
        # (at least until the kernel was stopped for flooding: 64 MiB outside its calls)
        assert read + len(prompts) * 4_000_000 > 60 * 2**20, (read, len(prompts))
        # ...and the session still has a working interpreter: the rest of a flood that
        # outlived its call may get the kernel stopped under the next call, which says so.
        after = await conn.call("run_code", code="print(3)", session=s)
        content = after.structured_content
        assert content is not None
        if content["status"] != "completed":
            assert "outside its calls" in str(content["error"]), content
            after = await conn.call("run_code", code="print(3)", session=s)
            content = after.structured_content
            assert content is not None and content["state_reset"] == {"reason": "flooded"}
        assert content["status"] == "completed" and stdout_of(content) == "3\n", content


async def test_a_flood_from_a_subprocess_of_the_kernel_is_bounded(
    server: ServerProcess, baseline: int
) -> None:
    """A child process writes to the kernel's captured stdout (the kernel turns that into
    messages): it does not reach the server's memory."""
    s = session()
    code = (
        "import subprocess, sys, os\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.3)\\n"
        'for i in range(2000): print("s" * 500_000, flush=True)\'])\n'
        "print('started')"
    )
    async with open_client(server.url, TOKEN, "auto") as conn:
        started = await conn.ok("run_code", code=code, session=s)
        assert stdout_of(started).endswith("started\n")
        await bounded_while_flooding(server, baseline, 5.0)
        after = await conn.ok("run_code", code="print(4)", session=s)
        assert stdout_of(after) == "4\n"


async def test_a_flood_during_a_call_stops_the_kernel_and_the_call_says_why(
    server: ServerProcess,
) -> None:
    s = session()
    code = (
        "import time\nk = get_ipython().kernel\np = 'w' * 1_000_000\n"
        "for i in range(300):\n"
        "    k.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': p}, parent={})\n"
        "time.sleep(30)"
    )
    async with open_client(server.url, TOKEN, "auto") as conn:
        started = time.monotonic()
        result = await conn.call("run_code", code=code, session=s)
        assert time.monotonic() - started < 20
        assert result.structured_content is not None
        content = result.structured_content
        assert content["status"] == "failed", content
        assert "sent more than 64 MiB of messages outside its calls" in str(content["error"])
        after = await conn.ok("run_code", code="print(6)", session=s)
        assert after["state_reset"] == {"reason": "flooded"}
        assert stdout_of(after) == "6\n"


# Records code in the sandbox writes straight into the relay's record pipe (same uid: it can
# open /proc/<relay>/fd/N): each ends that kernel (a protocol break), nothing else.
RECORDS = {
    "bad channel": "b'\\x07' + b'\\xff' * 4096",
    "drop note of 2**32-1 parts": "struct.pack('>BI', 255, 2**32 - 1) + bytes(4096)",
    "empty records": "struct.pack('>BI', 0, 0) * 100_000",
}
# A message whose parent's msg_id is a list answers nothing: dropped, the kernel goes on.
ODD_PARENT = (
    "struct.pack('>BI', 1, 6) + b''.join(struct.pack('>I', len(f)) + f for f in "
    "[b'<IDS|MSG>', b'', b'{}', b'{\"msg_id\": [1]}', b'{}', b'{}'])"
)
INJECT = """
import os, struct
pid = next(p for p in os.listdir('/proc')
           if p.isdigit() and b'srt_kernel_pipe' in open(f'/proc/{p}/cmdline', 'rb').read())
links = {fd: os.readlink(f'/proc/{pid}/fd/{fd}') for fd in os.listdir(f'/proc/{pid}/fd')}
fd = next(fd for fd, link in links.items()
          if link.startswith('pipe:') and link not in (links['0'], links['2']))
out = os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY)
os.write(out, PAYLOAD)
import time; time.sleep(5)
"""


@pytest.mark.parametrize("payload", sorted(RECORDS))
async def test_garbage_in_the_record_pipe_ends_that_kernel_only(
    server: ServerProcess, payload: str
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("run_code", code="x = 1", session=s)
        code = INJECT.replace("PAYLOAD", RECORDS[payload])
        broken = await conn.call("run_code", code=code, session=s)
        content = broken.structured_content
        assert content is not None and content["status"] == "failed", content
        assert "broke the protocol" in str(content["error"]), content["error"]
        fresh = await conn.ok("run_code", code="print('x' in dir())", session=s)
        assert fresh["state_reset"] == {"reason": "crashed"}
        assert stdout_of(fresh) == "False\n"
        others = await conn.ok("run_code", code="print(7)", session=session())
        assert stdout_of(others) == "7\n"


async def test_a_message_with_an_odd_parent_in_the_record_pipe_is_dropped(
    server: ServerProcess,
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("run_code", code="x = 1", session=s)
        code = INJECT.replace("PAYLOAD", ODD_PARENT).replace("time.sleep(5)", "time.sleep(0.5)")
        await conn.ok("run_code", code=code, session=s)
        after = await conn.ok("run_code", code="print(x)", session=s)
        assert after["state_reset"] is None and stdout_of(after) == "1\n"


async def test_a_result_with_countless_mime_types_is_cut(server: ServerProcess) -> None:
    s = session()
    code = (
        "k = get_ipython().kernel\n"
        "k.session.send(k.iopub_socket, 'display_data', {'data': {f'x/{i}': '' for i in "
        "range(200_000)}, 'metadata': {}}, parent=k.get_parent());"
    )
    async with open_client(server.url, TOKEN, "auto") as conn:
        result = await conn.ok("run_code", code=code, session=s)
        bundles = result["results"]
        assert len(bundles) == 1 and len(bundles[0]) <= 33, [len(b) for b in bundles]
        assert "199968 more MIME types dropped" in bundles[0]["text/plain"]
