"""What a model (or its user) reads at the edges: a plot it can be shown, a wrong token and a typo
in a hosted server's URL that say what is wrong in every framework, and ten agents of one token
that name no session running at once.

A real server; the official client in both eras in-process, and the frameworks (LangChain's
adapters, openai-agents, pydantic-ai, the TypeScript SDKs) through the drivers in tests/clients/
as tests/test_frameworks.py runs them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hosted_harness import script_entry, toml
from mcp.types import ImageContent, ResourceLink
from mcp_harness import Mode, ServerProcess, Servers, eventually, open_client
from test_frameworks import DRIVERS, TOKEN, brief, clients_node, python_driver, run_driver

pytestmark = pytest.mark.e2e

# (TOKEN: the drivers' token, which run_driver passes them)
OTHER = "other-token-0123456789abcdef"
TYPO = "tme"
CLOSE = "no hosted server 'tme'; did you mean 'time'? (list_servers names them)"
PLOT = (
    "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.savefig('p.png')\n"
    "plt.show()\nprint('plotted')"
)
PNG = b"\x89PNG\r\n\x1a\n"
RUNNING = 10  # the token's running limit in this module's server (a session's stays 4)


@pytest.fixture(scope="module")
def server(serve: Servers, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    catalog = tmp_path_factory.mktemp("edges-catalog") / "servers.toml"
    # Only `edges` may use `time`; `secret` is another principal's, never named to `edges`.
    catalog.write_text(
        toml(
            {
                "time": script_entry("echoenv.py", principals=["edges"]),
                "secret": script_entry("echoenv.py", principals=["other"]),
            }
        )
    )
    return serve(
        "edges",
        SANDBOX_AUTH_TOKENS=f"edges:{TOKEN},other:{OTHER}",
        SANDBOX_SERVERS_FILE=str(catalog),
        SANDBOX_MAX_RUNNING_PER_PRINCIPAL=str(RUNNING),
    )


def typo_url(server: ServerProcess, name: str = TYPO) -> str:
    return f"{server.base_url}/servers/{name}/mcp"


# -- images ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_plot_is_one_png_image_block_and_no_link(server: ServerProcess, mode: Mode) -> None:
    """The official client in both eras: the plot is an image content block (base64 PNG), and
    no resource link follows it (LangChain's adapters turn any link into an image or file URL
    that OpenAI-style APIs refuse); p.png is named under `files`."""
    async with open_client(server.url, TOKEN, mode) as conn:
        result = await conn.call("run_code", code=PLOT, session=f"plot-{mode}")
    assert not result.is_error, result.content
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert len(images) == 1, result.content
    assert images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data, validate=True).startswith(PNG)
    assert not [b for b in result.content if isinstance(b, ResourceLink)], result.content
    assert "workspace://" not in json.dumps([b.model_dump() for b in result.content])
    assert result.structured_content is not None
    assert {f["path"] for f in result.structured_content["files"]} == {"p.png"}


async def test_an_image_a_kernel_wraps_comes_back_unwrapped(server: ServerProcess) -> None:
    """base64 wrapped in lines (as base64.encodebytes writes it) is sent as one line: a data:
    URL made of it by a client must have no line breaks."""
    code = (
        "import base64, io\nimport matplotlib.pyplot as plt\nfrom IPython.display import display\n"
        "buf = io.BytesIO()\nplt.plot([1, 2])\nplt.savefig(buf, format='png')\nplt.close('all')\n"
        "display({'image/png': base64.encodebytes(buf.getvalue()).decode()}, raw=True)"
    )
    async with open_client(server.url, TOKEN, "legacy") as conn:
        result = await conn.call("run_code", code=code, session="wrapped")
    assert not result.is_error, result.content
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert len(images) == 1, result.content
    assert "\n" not in images[0].data
    assert base64.b64decode(images[0].data, validate=True).startswith(PNG)


def test_a_plot_through_langchain_converts_to_a_data_url_of_a_png(
    server: ServerProcess, tmp_path: Path
) -> None:
    """LangChain's adapters (2025 era) and convert_to_openai_messages, what a LangChain agent
    sends an OpenAI-style model: the plot is an image_url holding a data URL of a PNG, and no
    other URL is in it."""
    report = python_driver("legacy", "edges_driver.py", server, tmp_path, "--plot")
    plot = report["plot_langchain"]
    assert plot["shown"] is None, brief(plot)
    parts = plot["value"]["openai"]
    assert isinstance(parts, list), brief(plot)  # (a failed conversion is a dict: its error)
    urls = [p for p in parts if p["type"] == "image_url"]
    assert urls and all(p["png"] for p in urls), brief(parts)
    assert all(p["url"].startswith("data:image/png;base64,") for p in urls), brief(parts)
    official = report["plot_official"]["value"]["blocks"]
    assert [b["type"] for b in official] == ["text", "image"], brief(official)


# -- a wrong token -------------------------------------------------------------------------------


async def test_a_wrong_token_is_refused_in_words_and_never_echoed(server: ServerProcess) -> None:
    """The 401's status line, JSON-RPC body and WWW-Authenticate say "invalid token" and how to
    fix it; no token is in them."""
    wrong = TOKEN + "-wrong"
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    async with httpx2.AsyncClient(timeout=10) as http:
        resp = await http.post(
            server.url, json=initialize, headers={"Authorization": f"Bearer {wrong}"}
        )
        missing = await http.post(server.url, json=initialize)
    assert resp.status_code == 401
    assert resp.reason_phrase.startswith("Unauthorized: invalid token, or none ("), (
        resp.reason_phrase
    )
    error = resp.json()["error"]
    assert error["code"] == -32001
    assert error["message"].startswith("invalid token: "), error
    assert "Authorization: Bearer <token>" in error["message"]
    assert 'error="invalid_token"' in resp.headers["www-authenticate"]
    assert TOKEN not in resp.text + str(resp.headers)
    assert missing.status_code == 401
    assert missing.json()["error"]["message"].startswith("missing token: ")
    assert "error=" not in missing.headers["www-authenticate"]  # RFC 6750 3.1


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_wrong_token_reads_invalid_token_in_the_frameworks(
    server: ServerProcess, tmp_path: Path, era: str
) -> None:
    """What each framework shows when its tools are loaded with a wrong token. openai-agents on
    mcp 1.x builds its own message from the status code alone ("HTTP error 401")."""
    report = python_driver(era, "edges_driver.py", server, tmp_path)
    for framework in ("official", "langchain", "openai-agents", "pydantic-ai"):
        if framework not in report:
            assert era == "modern" and framework == "langchain", sorted(report)
            continue
        seen = report[framework]["wrong_token"]
        assert seen["shown"] is not None, f"{framework}: a wrong token was accepted"
        assert TOKEN not in seen["leaves"], seen
        if framework == "openai-agents" and era == "legacy":
            assert "HTTP error 401" in seen["leaves"], seen
            continue
        assert "invalid token" in seen["leaves"], f"{framework}: {seen}"
        assert "Authorization: Bearer <token>" in seen["leaves"], f"{framework}: {seen}"


# -- a typo in a hosted server's URL --------------------------------------------------------------


async def test_a_typo_in_a_hosted_url_names_the_close_server_after_auth(
    server: ServerProcess,
) -> None:
    """A POST of initialize to /servers/tme/mcp: a JSON-RPC error naming `time` (in a 200: the
    1.x client turns any 404 into "Session terminated"); other requests get a 404 with the same
    words; a caller without a valid token learns no names; another principal's server is
    never suggested."""
    initialize = {"jsonrpc": "2.0", "id": 7, "method": "initialize", "params": {}}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx2.AsyncClient(timeout=10) as http:
        resp = await http.post(typo_url(server), json=initialize, headers=auth)
        assert resp.status_code == 200
        assert resp.json() == {
            "jsonrpc": "2.0",
            "id": 7,
            "error": {"code": -32600, "message": CLOSE},
        }
        batch = await http.post(typo_url(server), json=[initialize, {**initialize, "id": 8}],
                                headers=auth)  # fmt: skip
        assert [e["id"] for e in batch.json()] == [7, 8]
        for resp in (
            await http.get(typo_url(server), headers=auth),
            await http.post(
                typo_url(server),
                json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                headers=auth,
            ),
            await http.post(typo_url(server), content=b"{not json", headers=auth),
        ):
            assert resp.status_code == 404, resp.text
            assert resp.json() == {"error": CLOSE}
        for headers in ({}, {"Authorization": "Bearer nope"}):
            refused = await http.post(typo_url(server), json=initialize, headers=headers)
            assert refused.status_code == 401
            assert "time" not in refused.text.replace("token", ""), refused.text
        # `secret` is `other`'s: to `edges` it does not exist, and is not close to anything.
        resp = await http.post(typo_url(server, "secre"), json=initialize, headers=auth)
        assert resp.json()["error"]["message"] == (
            "no hosted server 'secre' (list_servers names them)"
        )
        resp = await http.post(typo_url(server, "secret"), json=initialize, headers=auth)
        assert resp.json()["error"]["message"] == (
            "no hosted server 'secret' (list_servers names them)"
        )


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_typo_in_a_hosted_url_reads_did_you_mean_in_the_frameworks(
    server: ServerProcess, tmp_path: Path, era: str
) -> None:
    report = python_driver(era, "edges_driver.py", server, tmp_path, "--typo-url", typo_url(server))
    for framework in ("official", "langchain", "openai-agents", "pydantic-ai"):
        if framework in report:
            seen = report[framework]["url_typo"]
            assert seen["shown"] is not None, f"{framework}: {seen}"
            assert CLOSE in seen["leaves"], f"{framework}: {seen}"


@pytest.mark.parametrize("sdk", ["v1", "v2"])
def test_the_typescript_sdks_show_the_typo_and_the_invalid_token(
    server: ServerProcess, tmp_path: Path, sdk: str
) -> None:
    """@modelcontextprotocol/sdk 1.x shows the 401's body in its message; the 2.x client says
    "the server requires authorization (HTTP 401)" and keeps the body in error.data.text."""
    node, modules = clients_node()
    work = tmp_path / f"ts-{sdk}"
    work.mkdir()
    shutil.copy(DRIVERS / "ts_sdk_driver.mjs", work)
    (work / "node_modules").symlink_to(modules, target_is_directory=True)
    argv = [node, str(work / "ts_sdk_driver.mjs"), "--sdk", sdk, "--sleep", "0",
            "--typo-url", typo_url(server)]  # fmt: skip
    report = _with_token(run_driver(argv, server, work), TOKEN)
    assert CLOSE in report["url_typo"]["message"], brief(report["url_typo"])
    wrong = report["wrong_token"]
    shown = wrong["message"] if sdk == "v1" else wrong["body"]
    assert "invalid token: " in shown, brief(wrong)


def _with_token(report: Any, token: str) -> Any:
    """`report`, after checking that `token` appears nowhere in it."""
    assert token not in json.dumps(report), "a token was echoed"
    return report


# -- the default session --------------------------------------------------------------------------


async def test_ten_agents_of_one_token_without_a_session_run_at_once(
    server: ServerProcess,
) -> None:
    """Ten clients of one token, none naming a session (all `default`), each start a command
    that waits until all ten run: all ten run at once (a session's limit is 4; the default
    session's is the token's). An eleventh is refused at the token's limit, with words that
    say whose limit it is; a named session keeps its own limit of 4."""
    barrier = (
        "mkdir -p at && mktemp at/XXXXXXXX >/dev/null && "
        f"until [ $(ls at | wc -l) -ge {RUNNING} ] && [ -e go ]; do sleep 0.05; done; echo ran"
    )

    async def start(i: int) -> str:
        mode: Mode = "legacy" if i % 2 else "auto"
        async with open_client(server.url, TOKEN, mode) as conn:
            started = await conn.ok("execute_code_async", command=barrier, timeout_seconds=120)
            return str(started["execution_id"])

    ids = await asyncio.gather(*(start(i) for i in range(RUNNING)))
    async with open_client(server.url, TOKEN, "auto") as conn:

        async def all_running() -> bool:
            listed = await conn.ok("list_executions", status="running", limit=50)
            return len(listed["result"]) == RUNNING

        await eventually(all_running, 60, f"{RUNNING} executions running")
        refused = await conn.error("execute_code_async", command="true")
        assert refused == (
            "this token's default session (every connection that names no session) is running "
            f"its maximum of {RUNNING} executions; wait for one to finish or cancel one"
        )
        await conn.ok("write_file", path="go", content="")
        for execution_id in ids:
            out = await conn.ok(
                "get_execution_output",
                execution_id=execution_id,
                last_event_id="0",
                wait=True,
                wait_seconds=60,
            )
            assert out["status"] == "completed", out
            assert "ran\n" in [e.get("data") for e in out["output"]], out
        # A named session still holds its own limit (SANDBOX_MAX_PER_SESSION, 4 by default).
        named = [
            await conn.ok("execute_code_async", command="sleep 60", session="named")
            for _ in range(4)
        ]
        text = await conn.error("execute_code_async", command="sleep 60", session="named")
        assert text.startswith("this session is running its maximum of 4 executions"), text
        for started in named:
            await conn.ok("cancel_execution", execution_id=started["execution_id"], session="named")
