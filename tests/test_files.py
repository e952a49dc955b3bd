"""Workspace files through the MCP tools and resources: a real server, the official client."""

from __future__ import annotations

import base64
import hashlib
import os
import time
import uuid
from pathlib import Path

import pytest
from mcp.types import ImageContent, ResourceLink
from mcp_harness import ServerProcess, Servers, error_text, eventually, open_client, running_server

from sandbox_runtime.files.operations import CLOCK_REALTIME_COARSE

pytestmark = pytest.mark.e2e

TOKEN = "files-token-0123456789"
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve(
        "files",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_WORKSPACE_MB="64",
        SANDBOX_WORKSPACE_INODES="4096",
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_text_and_binary_round_trip_through_the_tools(server: ServerProcess, mode) -> None:
    session = unique("rt")
    blob = os.urandom(300_000) + bytes(range(256))
    async with open_client(server.url, TOKEN, mode) as conn:
        wrote = await conn.ok(
            "write_file", path="data/notes.txt", content="héllo\n", session=session
        )
        assert wrote["path"] == "data/notes.txt" and wrote["size"] == len("héllo\n".encode())
        assert wrote["usage"]["bytes_limit"] <= 64 * 1024 * 1024
        encoded = base64.b64encode(blob).decode()
        await conn.ok("write_file", path="/workspace/bin/blob", content=encoded,
                      encoding="base64", session=session)  # fmt: skip
        text = await conn.ok("read_file", path="data/notes.txt", session=session)
        assert text["content"] == "héllo\n" and text["encoding"] == "utf-8" and text["eof"]
        raw = await conn.ok("read_file", path="bin/blob", session=session)
        assert raw["encoding"] == "base64" and base64.b64decode(raw["content"]) == blob
        part = await conn.ok(
            "read_file", path="bin/blob", offset=10, length=5, encoding="base64", session=session
        )
        assert base64.b64decode(part["content"]) == blob[10:15] and not part["eof"]
        # The sandbox sees what the tools wrote, and the tools see what the sandbox wrote.
        run = await conn.ok(
            "execute_code",
            command="cat data/notes.txt; sha256sum bin/blob; echo made > out.txt",
            session=session,
        )
        stdout = "".join(e.get("data") or "" for e in run["output"] if e["type"] == "stdout")
        assert "héllo" in stdout
        assert hashlib.sha256(blob).hexdigest() in stdout
        assert (await conn.ok("read_file", path="out.txt", session=session))["content"] == "made\n"
        listing = await conn.ok("list_files", depth=2, session=session)
        paths = {e["path"]: e for e in listing["entries"]}
        assert paths["bin/blob"]["type"] == "file" and paths["bin/blob"]["size"] == len(blob)
        assert paths["data"]["type"] == "directory"
        assert (await conn.ok("delete_file", path="data", recursive=True, session=session))[
            "deleted"
        ] == "directory"
        missing = await conn.error("read_file", path="data/notes.txt", session=session)
        assert "no such file" in missing


async def test_paths_outside_the_workspace_are_refused(server: ServerProcess) -> None:
    session = unique("out")
    async with open_client(server.url, TOKEN, "auto") as conn:
        for path in ("/etc/passwd", "../x", "a/../../x", "/workspace/../etc/passwd", "/tmp/x"):
            message = await conn.error("read_file", path=path, session=session)
            assert "outside the workspace" in message or "'..'" in message, (path, message)
        await conn.ok("write_file", path="x", content="1", session=session)
        refused = await conn.error(
            "write_file", path="x", content="2", overwrite=False, session=session
        )
        assert "already exists" in refused
        assert (await conn.ok("read_file", path="x", session=session))["content"] == "1"


async def test_images_come_back_as_images_and_files_as_resources(server: ServerProcess) -> None:
    session = unique("img")
    async with open_client(server.url, TOKEN, "legacy") as conn:
        await conn.ok("write_file", path="dot.png", content=base64.b64encode(PNG).decode(),
                      encoding="base64", session=session)  # fmt: skip
        result = await conn.call("read_file", path="dot.png", session=session)
        images = [c for c in result.content if isinstance(c, ImageContent)]
        assert images and base64.b64decode(images[0].data) == PNG
        templates = await conn.client.list_resource_templates()
        assert any(t.uri_template.startswith("workspace://") for t in templates.resource_templates)
        read = await conn.client.read_resource(f"workspace://{session}/dot.png")
        assert base64.b64decode(read.contents[0].blob) == PNG  # type: ignore[union-attr]
        await conn.ok("write_file", path="sub/dir/t.txt", content="deep", session=session)
        read = await conn.client.read_resource(f"workspace://{session}/sub/dir/t.txt")
        assert read.contents[0].text == "deep"  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_results_name_the_files_a_call_created_or_changed(
    server: ServerProcess, mode
) -> None:
    session = unique("links")
    async with open_client(server.url, TOKEN, mode) as conn:
        await conn.ok("write_file", path="old.txt", content="old", session=session)
        await conn.ok("write_file", path="keep.txt", content="keep", session=session)
        # Change times tick with the kernel's coarse clock: let it tick past these writes, so
        # that the call's own changes are told apart from them.
        written = time.clock_gettime(CLOCK_REALTIME_COARSE)
        await eventually(
            lambda: time.clock_gettime(CLOCK_REALTIME_COARSE) > written, 1, "a clock tick", 0.001
        )
        result = await conn.call(
            "execute_code",
            command="mkdir -p out && seq 100 > out/numbers.csv && echo more >> old.txt",
            session=session,
        )
        assert not result.is_error, error_text(result)
        files = {f["path"]: f["size"] for f in result.structured_content["files"]}
        assert files == {"out/numbers.csv": 292, "old.txt": 8}
        # No resource links: LangChain's adapters turn each into an image or file URL that
        # OpenAI-style APIs refuse. The files are resources all the same.
        assert not [c for c in result.content if isinstance(c, ResourceLink)], result.content
        read = await conn.client.read_resource(f"workspace://{session}/out/numbers.csv")
        assert read.contents[0].text.splitlines()[-1] == "100"  # type: ignore[union-attr]
        code = await conn.call(
            "run_code", code="open('plot.txt', 'w').write('x' * 10)", session=session
        )
        assert not code.is_error, error_text(code)
        assert code.structured_content["files"] == [{"path": "plot.txt", "size": 10}]


async def test_the_sandbox_user_is_not_nobody(server: ServerProcess) -> None:
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("write_file", path="f", content="x", session="uid")
    images = list((server.state_dir / "workspaces").glob("ws-*.img"))
    assert images
    points = [p.with_suffix("") for p in images]
    owners = {p.stat().st_uid for p in points if p.is_dir()}
    assert owners and 65534 not in owners and 0 not in owners


def test_nothing_stays_mounted_after_the_server_stops(tmp_path: Path) -> None:
    from sandbox_runtime.workspaces.store import mounts_under

    with running_server(tmp_path, SANDBOX_AUTH_TOKEN=TOKEN) as running:
        import anyio

        async def use() -> None:
            async with open_client(running.url, TOKEN, "auto") as conn:
                await conn.ok("write_file", path="f", content="x", session="m")

        anyio.run(use)
        assert mounts_under(tmp_path), "a workspace image is mounted while in use"
    assert not mounts_under(tmp_path)
