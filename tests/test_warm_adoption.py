"""A session's first run_code takes a warm interpreter only when nothing uses its workspace.

Adopting a warm interpreter swaps its workspace in for the session's: done while an execution,
another interpreter or a file operation used the session's, that one's files were lost (issue
24). A real server with warm python and bash interpreters, real sandboxes, the official client.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from mcp_harness import Conn, ServerProcess, Servers, eventually, open_client

pytestmark = pytest.mark.e2e

TOKEN = "warm-adoption-token-1"


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve(
        "adopt",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_INTERPRETER_WARM="python=1,bash=1",
        SANDBOX_MEMORY_MB="512",
    )


def session() -> str:
    return f"a-{uuid.uuid4().hex[:8]}"


def metric(server: ServerProcess, prefix: str, *labels: str) -> float:
    return server.metric(TOKEN, prefix, *labels)


def warm_hits(server: ServerProcess, language: str = "python") -> float:
    return metric(
        server, "srt_interpreter_events_total{", 'event="warm_hit"', f'language="{language}"'
    )


async def warm_ready(server: ServerProcess, language: str = "python") -> None:
    """Wait until a warm interpreter of `language` waits in the pool."""

    def ready() -> bool:
        return metric(server, "srt_interpreters{", 'state="warm"', f'"{language}"') >= 1

    await eventually(ready, 60, f"a warm {language} interpreter")


def stdout_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data") or "" for e in result["output"] if e["type"] == "stdout")


async def finished(conn: Conn, execution_id: str, s: str) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        info = await conn.ok("get_execution_status", execution_id=execution_id, session=s)
        return info if info["status"] not in ("pending", "running") else None

    info: dict[str, Any] = await eventually(done, 30, "the execution to finish", interval=0.2)
    return info


async def test_a_new_session_takes_the_warm_interpreter(server: ServerProcess) -> None:
    await warm_ready(server)
    before = warm_hits(server)
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        first = await conn.ok(
            "run_code", code="open('/workspace/w.txt', 'w').write('warm')\nprint(2)", session=s
        )
        assert stdout_of(first) == "2\n"
        assert warm_hits(server) == before + 1, "a new session's first call is a warm hit"
        back = await conn.ok("read_file", path="w.txt", session=s)
        assert back["content"] == "warm", "the adopted workspace is the session's"


async def test_an_execution_running_when_the_first_run_code_comes_keeps_its_file(
    server: ServerProcess,
) -> None:
    # The reported repro: the command writes after run_code's interpreter has started.
    await warm_ready(server)
    before = warm_hits(server)
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        started = await conn.ok(
            "execute_code_async",
            command="sleep 3; echo precious > /workspace/out.txt",
            session=s,
        )
        ran = await conn.ok("run_code", code="print(1)", session=s)
        assert stdout_of(ran) == "1\n"
        info = await finished(conn, started["execution_id"], s)
        assert info["status"] == "completed" and info["exit_code"] == 0
        back = await conn.ok("read_file", path="out.txt", session=s)
        assert back["content"] == "precious\n"
        assert warm_hits(server) == before, "a workspace in use is never swapped"
        seen = await conn.ok("run_code", code="print(open('/workspace/out.txt').read())", session=s)
        assert stdout_of(seen) == "precious\n\n", "the interpreter runs in the same workspace"


async def test_an_execution_started_with_the_first_run_code_keeps_its_file(
    server: ServerProcess,
) -> None:
    # Both at once: whichever comes first, the command's file is the session's afterwards.
    async with open_client(server.url, TOKEN, "auto") as conn:
        for _ in range(3):
            await warm_ready(server)
            s = session()
            started, ran = await asyncio.gather(
                conn.ok(
                    "execute_code_async",
                    command="sleep 1; echo precious > /workspace/out.txt",
                    session=s,
                ),
                conn.ok("run_code", code="print(1)", session=s),
            )
            assert stdout_of(ran) == "1\n"
            info = await finished(conn, started["execution_id"], s)
            assert info["status"] == "completed" and info["exit_code"] == 0
            back = await conn.ok("read_file", path="out.txt", session=s)
            assert back["content"] == "precious\n"


async def test_a_running_interpreter_call_keeps_its_file_when_another_language_starts(
    server: ServerProcess,
) -> None:
    await warm_ready(server)
    s = session()
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("run_code", code="import time", session=s)  # (the warm python one)
        await warm_ready(server, "bash")
        before = warm_hits(server, "bash")
        call = asyncio.create_task(
            conn.ok(
                "run_code",
                code="time.sleep(3)\nopen('/workspace/k.txt', 'w').write('kept')",
                session=s,
            )
        )

        async def running() -> bool:
            listed = await conn.ok("list_executions", session=s)
            return any(e["status"] == "running" for e in listed["result"])

        await eventually(running, 10, "the python call to run", interval=0.05)
        shell = await conn.ok("run_code", code="echo hi", language="bash", session=s)
        assert stdout_of(shell) == "hi\n"
        await call
        back = await conn.ok("read_file", path="k.txt", session=s)
        assert back["content"] == "kept"
        assert warm_hits(server, "bash") == before, "a workspace in use is never swapped"
        seen = await conn.ok("run_code", code="cat /workspace/k.txt", language="bash", session=s)
        assert stdout_of(seen) == "kept"
