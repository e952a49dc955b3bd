"""run_code: persistent interpreters per session, in real kernels inside real sandboxes.

A real server (its own state dir, the tests' runtime bound in), the official MCP client in
both protocol eras.
"""

from __future__ import annotations

import base64
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp.types import CallToolResult, ImageContent
from mcp_harness import (
    Conn,
    Mode,
    ServerProcess,
    Servers,
    alive,
    error_text,
    eventually,
    open_client,
    processes_with,
    running_server,
)
from topology_harness import TOKEN as TOPOLOGY_TOKEN
from topology_harness import running_topology

pytestmark = pytest.mark.e2e

TOKEN = "interpreter-test-token-1"
OTHER = "interpreter-other-token-2"


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve(
        "interp",
        SANDBOX_AUTH_TOKENS=f"alice:{TOKEN},bob:{OTHER}",
        SANDBOX_CANCEL_GRACE="1",
        SANDBOX_MEMORY_MB="256",
        SANDBOX_PIDS_LIMIT="64",
        SANDBOX_MAX_INTERPRETERS="64",
        SANDBOX_MAX_INTERPRETERS_PER_PRINCIPAL="64",
    )


def session() -> str:
    return f"i-{uuid.uuid4().hex[:8]}"


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")


async def run(conn: Conn, code: str, **args: Any) -> dict[str, Any]:
    return await conn.ok("run_code", code=code, **args)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_state_persists_between_calls_in_every_language(
    server: ServerProcess, mode: Mode
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, mode) as conn:
        first = await run(conn, "x = 41", session=s)
        assert first["state_reset"] == {"reason": "first_call"}
        second = await run(conn, "x + 1", session=s)
        assert second["state_reset"] is None
        assert second["results"][0]["text/plain"] == "42"
        assert second["execution_count"] == 2

        await run(
            conn,
            "function twice(a: number): number { return a * 2 }",
            language="typescript",
            session=s,
        )
        ts = await run(conn, "twice(21)", language="typescript", session=s)
        assert ts["results"][0]["text/plain"] == "42"

        await run(conn, "const greet = (n) => `hi ${n}`", language="javascript", session=s)
        js = await run(conn, "console.log(greet('js'))", language="javascript", session=s)
        assert stdout_of(js) == "hi js\n"

        await run(
            conn, 'cd /tmp && export LEVEL=7; shout() { echo "$1!"; }', language="bash", session=s
        )
        sh = await run(conn, "pwd; echo $LEVEL; shout hey", language="bash", session=s)
        assert stdout_of(sh) == "/tmp\n7\nhey!\n"
        listed = await conn.ok("list_languages", session=s)
        running = {item["language"]: item["running"] for item in listed["languages"]}
        assert running == {"bash": True, "javascript": True, "python": True, "typescript": True}
        python = next(i for i in listed["languages"] if i["language"] == "python")
        assert {"numpy", "pandas", "matplotlib", "scipy", "pillow", "requests"} <= set(
            python["packages"]
        )


async def test_a_plot_comes_back_as_a_png_image_and_a_dataframe_as_html(
    server: ServerProcess,
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        result: CallToolResult = await conn.call(
            "run_code",
            code="import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()",
            session=s,
        )
        assert not result.is_error, error_text(result)
        images = [b for b in result.content if isinstance(b, ImageContent)]
        assert len(images) == 1 and images[0].mime_type == "image/png"
        assert base64.b64decode(images[0].data).startswith(b"\x89PNG\r\n\x1a\n")
        frame = await run(
            conn, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})", session=s
        )
        assert "<table" in frame["results"][0]["text/html"]
        # The same outputs, polled: events carry the bundles.
        page = await conn.ok("get_execution_output", execution_id=frame["execution_id"], session=s)
        bundles = [e["bundle"] for e in page["output"] if e["type"] == "result"]
        assert "text/html" in bundles[0]


async def test_an_exception_returns_the_error_and_the_interpreter_keeps_its_state(
    server: ServerProcess,
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        await run(conn, "kept = 'yes'", session=s)
        failed = await run(conn, "def f():\n    raise ValueError('boom')\nf()", session=s)
        assert failed["status"] == "completed" and failed["exit_code"] == 1
        assert failed["error"]["name"] == "ValueError" and failed["error"]["value"] == "boom"
        assert any("raise ValueError" in line for line in failed["error"]["traceback"])
        assert not any("\x1b[" in line for line in failed["error"]["traceback"])
        after = await run(conn, "kept", session=s)
        assert after["results"][0]["text/plain"] == "'yes'" and after["state_reset"] is None


async def test_a_timeout_interrupts_an_endless_loop_and_keeps_the_state(
    server: ServerProcess,
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        await run(conn, "x = 5", session=s)
        looped = await run(conn, "while True:\n    pass", timeout_seconds=1, session=s)
        assert looped["status"] == "timeout"
        assert looped["error"]["name"] == "KeyboardInterrupt"
        after = await run(conn, "x", session=s)
        assert after["results"][0]["text/plain"] == "5" and after["state_reset"] is None


async def test_code_that_ignores_the_interrupt_is_killed_and_the_next_call_says_state_reset(
    server: ServerProcess,
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        await run(conn, "x = 5", session=s)
        stubborn = await run(
            conn,
            "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
            timeout_seconds=1,
            session=s,
        )
        assert stubborn["status"] == "timeout"
        assert "state" in stubborn["error"] and "lost" in stubborn["error"]
        after = await conn.call("run_code", code="x", session=s)
        content = after.structured_content or {}
        assert content["state_reset"] == {"reason": "killed"}
        assert content["error"]["name"] == "NameError"


async def test_a_cancel_interrupts_a_running_call_and_keeps_the_state(
    server: ServerProcess,
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        await run(conn, "y = 9", session=s)
        started = await conn.ok("run_code_async", code="import time\ntime.sleep(60)", session=s)
        await eventually(
            lambda: conn.ok(
                "get_execution_status", execution_id=started["execution_id"], session=s
            ),
            5,
            "the call to run",
        )
        cancelled = await conn.ok(
            "cancel_execution", execution_id=started["execution_id"], session=s
        )
        assert cancelled["status"] == "cancelled"
        assert (await run(conn, "y", session=s))["results"][0]["text/plain"] == "9"


async def test_os_exit_inside_the_interpreter_makes_the_next_call_say_state_reset(
    server: ServerProcess,
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        await run(conn, "z = 1", session=s)
        died = await conn.call("run_code", code="import os\nos._exit(1)", session=s)
        content = died.structured_content or {}
        assert content["status"] == "failed" and "died" in str(content["error"])
        after = await run(conn, "print('back')", session=s)
        assert after["state_reset"] == {"reason": "crashed"}
        assert stdout_of(after) == "back\n"


async def test_input_is_answered_through_send_stdin(server: ServerProcess) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        started = await conn.ok(
            "run_code_async", code="name = input('who? ')\nprint('hello', name)", session=s
        )
        execution_id = started["execution_id"]

        async def prompt() -> dict[str, Any] | None:
            page = await conn.ok("get_execution_output", execution_id=execution_id, session=s)
            return next((e for e in page["output"] if e["type"] == "input_request"), None)

        request = await eventually(prompt, 20, "an input_request event")
        assert request["prompt"] == "who? "
        await conn.ok("send_stdin", execution_id=execution_id, input_data="ada\n", session=s)
        page = await conn.ok(
            "get_execution_output",
            execution_id=execution_id,
            wait=True,
            wait_seconds=10,
            session=s,
        )

        async def finished() -> bool:
            status = await conn.ok("get_execution_status", execution_id=execution_id, session=s)
            return status["status"] == "completed"

        await eventually(finished, 10, "the call to end")
        page = await conn.ok("get_execution_output", execution_id=execution_id, session=s)
        assert "hello ada\n" in "".join(e.get("data", "") for e in page["output"])
        refused = await conn.error(
            "send_stdin", execution_id=execution_id, input_data="more\n", session=s
        )
        assert "finished" in refused or "not waiting" in refused


async def test_sessions_and_tokens_do_not_share_variables_or_files(server: ServerProcess) -> None:
    a, b = session(), session()
    async with (
        open_client(server.url, TOKEN, "auto") as alice,
        open_client(server.url, OTHER, "auto") as bob,
    ):
        await run(alice, "secret = 'alice'\nopen('/workspace/mine.txt', 'w').write('a')", session=a)
        other = await alice.call("run_code", code="secret", session=b)
        assert (other.structured_content or {})["error"]["name"] == "NameError"
        same_name = await bob.call("run_code", code="secret", session=a)
        assert (same_name.structured_content or {})["error"]["name"] == "NameError"
        files = await run(bob, "import os\nprint(os.listdir('/workspace'))", session=a)
        assert stdout_of(files) == "[]\n"
        shell = await alice.ok("execute_code", command="cat /workspace/mine.txt", session=a)
        assert stdout_of(shell) == "a", "interpreters and execute_code share the workspace"
        pandas = await alice.ok("execute_code", command="python3 -c 'import pandas'", session=a)
        assert pandas["exit_code"] == 0, "executions see the runtime on their PATH"


async def test_an_interpreter_reaches_nothing_outside_its_sandbox(server: ServerProcess) -> None:
    s = session()
    host = socket.gethostbyname("localhost")
    code = f"""
import os, socket
out = {{}}
for path in ('/etc/shadow', '/root', '{server.state_dir}', '{server.workdir}/server.stderr'):
    try:
        os.listdir(path) if os.path.isdir(path) else open(path).read()
        out[path] = 'READABLE'
    except OSError as e:
        out[path] = type(e).__name__
s = socket.socket()
s.settimeout(2)
try:
    s.connect(('{host}', {server.port}))
    out['server'] = 'CONNECTED'
except OSError as e:
    out['server'] = type(e).__name__
out['env'] = sorted(k for k in os.environ if 'TOKEN' in k or 'SECRET' in k)
out['uid'] = os.getuid()
out['pids'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
print(out)
"""
    async with open_client(server.url, TOKEN, "auto") as conn:
        result = await run(conn, code, session=s)
    report = eval(stdout_of(result))
    assert "READABLE" not in report.values(), report
    assert report["server"] != "CONNECTED"
    assert report["env"] == []
    assert report["uid"] == 1000
    assert max(report["pids"]) < 50, "the interpreter sees only its own sandbox's processes"
    for pid in [p for p, _ in processes_with("ipykernel_launcher")]:
        assert os.stat(f"/proc/{pid}").st_uid != 0, "a kernel runs as root"


async def test_a_fork_bomb_and_a_huge_allocation_are_contained(server: ServerProcess) -> None:
    s = session()
    bomb = "import subprocess\nsubprocess.run(['bash', '-c', ':(){ :|:& };:'], timeout=3)"
    async with open_client(server.url, TOKEN, "auto") as conn:
        await run(conn, "import os; os.getpid()", session=s)
        started = time.monotonic()
        bombed = await conn.call("run_code", code=bomb, timeout_seconds=15, session=s)
        assert bombed.structured_content is not None
        assert httpx2.get(f"{server.base_url}/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 20
        # The bomb's processes fill the interpreter's pids limit: a restart clears them all.
        restarted = await conn.ok("restart_interpreter", language="python", session=s)
        assert restarted["restarted"] is True
        huge = await conn.call(
            "run_code", code="b = 'x' * (10 * 1024**3)", timeout_seconds=30, session=s
        )
        content = huge.structured_content or {}
        assert content.get("error"), content  # MemoryError, or the kernel was OOM-killed
        assert httpx2.get(f"{server.base_url}/health", timeout=5).status_code == 200
        again = await run(conn, "print('alive')", session=s)
        assert stdout_of(again) == "alive\n"


async def test_an_idle_interpreter_is_stopped_and_the_next_call_says_so(tmp_path: Path) -> None:
    with running_server(
        tmp_path,
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_INTERPRETER_IDLE_SECONDS="1",
        SANDBOX_INTERPRETER_WARM="python=0",
    ) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await run(conn, "v = 1", session="idle")

            async def reaped() -> bool:
                listed = await conn.ok("list_languages", session="idle")
                return not next(i for i in listed["languages"] if i["language"] == "python")[
                    "running"
                ]

            await eventually(reaped, 20, "the idle interpreter to stop", interval=0.5)
            after = await conn.call("run_code", code="v", session="idle")
            content = after.structured_content or {}
            assert content["state_reset"] == {"reason": "idle"}
            assert content["error"]["name"] == "NameError"
        metrics = httpx2.get(
            f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
        ).text
        assert 'srt_interpreter_events_total{event="reaped",language="python"} 1.0' in metrics
        assert 'srt_interpreter_events_total{event="start",language="python"} 2.0' in metrics
        assert 'srt_interpreters{language="python",state="idle"} 1.0' in metrics


async def test_variables_survive_calls_entering_through_different_replicas(
    tmp_path: Path,
) -> None:
    with running_topology(tmp_path) as topology:
        s = session()
        replicas = list(topology.replicas.values())
        async with open_client(replicas[0].url, TOPOLOGY_TOKEN, "auto") as first:
            await first.ok("run_code", code="total = 40", session=s)
        for i, replica in enumerate(replicas):
            async with open_client(replica.url, TOPOLOGY_TOKEN, "legacy") as conn:
                result = await conn.ok("run_code", code="total += 1\ntotal", session=s)
                assert result["results"][0]["text/plain"] == str(41 + i)
        async with open_client(topology.session_url(s), TOPOLOGY_TOKEN, "auto") as by_path:
            result = await by_path.ok("run_code", code="total")
            assert result["results"][0]["text/plain"] == "43"


@pytest.mark.parametrize("end", ["sigterm", "sigkill"])
async def test_nothing_of_the_kernels_outlives_the_server(tmp_path: Path, end: str) -> None:
    server = ServerProcess(tmp_path, {"SANDBOX_AUTH_TOKEN": TOKEN}).start()
    try:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await run(conn, "1", session="a")
            await run(conn, "echo 1", language="bash", session="a")
            await run(conn, "1", language="typescript", session="a")
        kernels = server.state_dir / "kernels"
        assert len(list(kernels.iterdir())) >= 3  # and the warm one
        below = server.descendants()
        assert len(below) > 6
    finally:
        if end == "sigterm":
            server.stop()
        else:
            server.kill()
    await eventually(
        lambda: not [pid for pid, started in below if alive(pid, started)],
        10,
        "every kernel sandbox to end with the server",
    )
    if end == "sigterm":
        assert not any(kernels.iterdir())
    else:  # left by a crash: removed by the next server at its start
        again = ServerProcess(tmp_path, {"SANDBOX_AUTH_TOKEN": TOKEN}).start()
        again.stop()
        # (the directory itself is made again only by a kernel's start, which a quick stop
        # may have come before)
        assert not kernels.exists() or not any(kernels.iterdir())


async def test_a_caller_may_tighten_an_interpreters_limits_never_loosen_them(
    server: ServerProcess,
) -> None:
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        looser = await conn.error(
            "run_code", code="1", sandbox_config={"memory_mb": 100_000}, session=s
        )
        assert "memory_mb" in looser
        tight = await run(
            conn,
            "import resource\nopen('/proc/self/limits').read().count('\\n') > 0",
            sandbox_config={"pids": 20, "memory_mb": 128},
            session=s,
        )
        assert tight["results"][0]["text/plain"] == "True"
        other = await conn.error("run_code", code="1", sandbox_config={"pids": 30}, session=s)
        assert "restart_interpreter" in other
        assert (await run(conn, "1", session=s))["status"] == "completed"  # no config: as is
        restarted = await conn.ok(
            "restart_interpreter", language="python", sandbox_config={"pids": 30}, session=s
        )
        assert restarted["restarted"] is True
        bounded = await run(
            conn,
            "import subprocess\n"
            "procs = []\n"
            "try:\n"
            "    for _ in range(60):\n"
            "        procs.append(subprocess.Popen(['sleep', '30']))\n"
            "except OSError as e:\n"
            "    print('refused', len(procs))\n"
            "for p in procs:\n"
            "    p.kill()",
            session=s,
        )
        refused = stdout_of(bounded)
        assert refused.startswith("refused"), refused
        assert int(refused.split()[1]) < 30


async def test_deno_output_and_results_arrive_with_every_call(server: ServerProcess) -> None:
    """Deno's kernel may publish output after a cell's idle status: none of it may be lost."""
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        for i in range(30):
            language = "typescript" if i % 2 else "javascript"
            result = await run(conn, f"console.log('n{i}'); {i} * 2", language=language, session=s)
            assert stdout_of(result) == f"n{i}\n", (i, result["output"])
            assert result["results"][0]["text/plain"] == str(i * 2), (i, result)
