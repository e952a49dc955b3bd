"""The issue 42 workflow, as an agent works it: a scripted agent (no model) that reads only what a
model is shown and follows every hint exactly, through LangChain's adapters (2025 era,
tests/clients/workflow_driver.py in the clients venv) and the official client (2026 era). One
fixed workflow (tests/clients/_workflow.py): a CSV written, pandas' describe(), a plot, an async
command polled to its end, stdin, a cancel, 200,000 lines of output, a hosted server's tool, code
mode calling it, and a typo in its name.

Judged here for both eras alike: every result within its budget; every hint followed succeeded;
the plot is a PNG a client forwards (LangChain: through convert_to_openai_messages, a data: URL);
the whole long output is read through the call its note names and in its .outputs/ file; the
typo's error names the server meant.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from pathlib import Path
from typing import Any

import pytest
from hints_harness import text_of
from hosted_harness import script_entry, toml
from mcp.types import ImageContent
from mcp_harness import Mode, ServerProcess, Servers, open_client
from test_frameworks import DRIVERS, TOKEN, brief, clients_python, run_driver

sys.path.insert(0, str(DRIVERS))  # the workflow and its hint parser, shared with the driver
from _workflow import HOSTED, LINES, workflow

pytestmark = pytest.mark.e2e

BUDGET = 100_000  # SANDBOX_RESULT_MAX_CHARS's default
WHOLE = "".join(f"line {i}\n" for i in range(LINES)).encode()
PNG = b"\x89PNG\r\n\x1a\n"

_reports: dict[str, Any] = {}


@pytest.fixture(scope="module")
def server(serve: Servers, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    catalog = tmp_path_factory.mktemp("workflow-catalog") / "servers.toml"
    catalog.write_text(toml({HOSTED: script_entry("echoenv.py")}))
    return serve("workflow", SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_SERVERS_FILE=str(catalog))


def hosted_url(server: ServerProcess) -> str:
    return f"{server.base_url}/servers/{HOSTED}/mcp"


async def official(server: ServerProcess, mode: Mode = "auto") -> Any:
    """The workflow through the official client (mcp 2.x): the text block and image blocks."""

    def caller(conn: Any) -> Any:
        async def call(tool: str, args: dict[str, Any]) -> dict[str, Any]:
            result = await conn.call(tool, **args)
            images = []
            for block in result.content:
                if isinstance(block, ImageContent):
                    png = base64.b64decode(block.data, validate=True).startswith(PNG)
                    images.append({"url": f"data:{block.mime_type};base64,", "png": png})
            return {"text": text_of(result), "is_error": result.is_error, "images": images}

        return call

    async with (
        open_client(server.url, TOKEN, mode) as conn,
        open_client(hosted_url(server), TOKEN, mode) as hosted,
    ):
        return await workflow(caller(conn), caller(hosted))


async def report_of(era: str, server: ServerProcess, tmp_path: Path) -> Any:
    if era not in _reports:
        if era == "2025-langchain":
            argv = [str(clients_python("legacy")), str(DRIVERS / "workflow_driver.py")]
            _reports[era] = run_driver(
                [*argv, "--hosted-url", hosted_url(server)], server, tmp_path, timeout=240
            )
        else:
            _reports[era] = await official(server)
    return _reports[era]


ERAS = ["2025-langchain", "2026-official"]


@pytest.mark.parametrize("era", ERAS)
async def test_every_result_within_its_budget_and_every_hint_works(
    era: str, server: ServerProcess, tmp_path: Path
) -> None:
    report = await report_of(era, server, tmp_path)
    read = report["read"]
    over = [r for r in read if r["chars"] > r["budget"]]
    assert not over, brief(over)
    followed = [r for r in read if r["hint"]]
    failed = [r for r in followed if r["is_error"]]
    assert not failed, brief(failed, 4000)
    assert not report["unfollowed"], brief(report["unfollowed"])
    steps = {r["step"] for r in followed}
    # The async command, stdin, the cancel and the long output gave hints, and they were followed.
    assert {"async", "stdin", "cancel", "long"} <= steps, sorted(steps)
    errors = [r for r in read if r["is_error"]]
    assert not errors, brief(errors, 4000)
    print(f"{era}: {len(read)} results, {len(followed)} of them hints followed, "
          f"{sum(r['chars'] for r in read):,} characters read")  # fmt: skip


@pytest.mark.parametrize("era", ERAS)
async def test_each_step_reads_as_it_should(
    era: str, server: ServerProcess, tmp_path: Path
) -> None:
    report = await report_of(era, server, tmp_path)
    assert report["describe"].startswith("           sales\ncount   8.000000"), report["describe"]
    assert "tick 3" in "".join(report["async"]) and "[exit 0" in report["async"][-1], report[
        "async"
    ]
    assert report["stdin"][-1].startswith("hello model\n"), report["stdin"]
    assert "cancelled" in report["cancel"][-1], report["cancel"]
    assert report["hosted"] == "hi", report["hosted"]
    assert "from code\n" in report["code_mode"], report["code_mode"]
    assert "[time.echo → ok" in report["code_mode"], report["code_mode"]
    assert "from a cell" in report["cell"], report["cell"]


@pytest.mark.parametrize("era", ERAS)
async def test_the_plot_is_a_png_the_model_is_shown(
    era: str, server: ServerProcess, tmp_path: Path
) -> None:
    """Through LangChain: the ToolMessage as convert_to_openai_messages sends it, an image_url
    holding a data: URL that decodes to a PNG. Through the official client: the image block."""
    plot = (await report_of(era, server, tmp_path))["plot"]
    images = plot["images"]
    assert len(images) == 1, brief(plot)
    assert images[0]["url"].startswith("data:image/png;base64,") and images[0]["png"], images
    assert "by_region.png" in plot["text"], plot["text"]


@pytest.mark.parametrize("era", ERAS)
async def test_the_long_output_is_read_whole_through_its_note_and_its_file(
    era: str, server: ServerProcess, tmp_path: Path
) -> None:
    long = (await report_of(era, server, tmp_path))["long"]
    assert long["text_head"].startswith("line 0\nline 1\n"), long["text_head"]
    assert f"line {LINES - 1}\n[exit 0" in long["text_tail"], long["text_tail"]
    whole = {"bytes": len(WHOLE), "lines": LINES, "sha256": hashlib.sha256(WHOLE).hexdigest()}
    for route in ("read_file", "get_execution_output"):
        got = long[route]
        assert {k: got.get(k) for k in whole} == whole, (route, brief(got))
    assert f"{LINES} {len(WHOLE)} .outputs/" in long["file"], long["file"]
    assert hashlib.sha256(WHOLE).hexdigest() in long["file"], long["file"]


@pytest.mark.parametrize("era", ERAS)
async def test_a_typo_in_a_server_name_names_the_server_meant(
    era: str, server: ServerProcess, tmp_path: Path
) -> None:
    report = await report_of(era, server, tmp_path)
    for text in (report["typo"], report["typo_cell"]):
        assert f"no server 'tme'; did you mean '{HOSTED}'?" in text, text
