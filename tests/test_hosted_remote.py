"""A remote Streamable HTTP server in the catalog, proxied behind our endpoint: our token in,
the entry's headers (secrets resolved on the host) out."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hosted_harness import remote_server, text_of
from mcp_harness import ServerProcess, open_client, stop_all, stop_if_running

pytestmark = pytest.mark.e2e

TOKEN = "remote-entry-client-token-0123"
SECRET = "remote-upstream-secret-77"


@pytest.fixture(scope="module")
def remote() -> Iterator[str]:
    with remote_server("remote_http.py", "/mcp") as port:
        yield f"http://127.0.0.1:{port}/mcp"


@pytest.fixture(scope="module")
def server(remote: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("remote")
    catalog = workdir / "servers.toml"
    catalog.write_text(
        f"[servers.upstream]\nurl = {json.dumps(remote)}\n"
        'headers = { Authorization = "env:REMOTE_BEARER", X-Team = "agents" }\n'
        "call_timeout = 5\n"
    )
    server = ServerProcess(
        workdir,
        {
            "SANDBOX_AUTH_TOKEN": TOKEN,
            "SANDBOX_SERVERS_FILE": str(catalog),
            "REMOTE_BEARER": f"Bearer {SECRET}",
            "SANDBOX_POOL_SIZE": "0",
            "SANDBOX_INTERPRETER_WARM": "",
        },
    )
    try:
        server.start()
        yield server
    finally:
        stop_all(stop_if_running(server))


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_remote_server_is_proxied(server: ServerProcess, mode: str) -> None:
    async with open_client(f"{server.base_url}/servers/upstream/mcp", TOKEN, mode) as conn:
        names = {t.name for t in (await conn.client.list_tools()).tools}
        assert {"whoami", "count", "fail"} <= names, names
        seen = (await conn.client.call_tool("whoami", {})).structured_content
        assert seen == {"authorization": f"Bearer {SECRET}", "x-team": "agents"}, seen
        progress: list[float] = []

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            progress.append(value)

        done = await conn.client.call_tool("count", {"steps": 3}, progress_callback=on_progress)
        assert "counted 3" in text_of(done), done
        assert progress == [1.0, 2.0, 3.0], progress
        failed = await conn.client.call_tool("fail", {})
        assert failed.is_error and "remote failure on purpose" in text_of(failed), failed
    assert SECRET not in server.stderr_text()


async def test_the_secret_never_reaches_a_client(server: ServerProcess) -> None:
    async with open_client(server.url, TOKEN) as conn:
        listed = (await conn.client.call_tool("list_servers", {})).structured_content
    assert listed is not None
    (upstream,) = listed["servers"]
    assert upstream["kind"] == "remote" and upstream["ready"], upstream
    assert SECRET not in json.dumps(listed)
