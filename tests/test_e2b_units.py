"""Units of the E2B edge: its paths onto the workspace, the Connect framing, the workspace
operations it added (make_dir, move) on a real filesystem, with links planted where a client
could not see them."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from sandbox_runtime.e2b.connect import MAX_FRAME, ConnectError, frame, read_frames
from sandbox_runtime.e2b.paths import to_e2b, to_workspace
from sandbox_runtime.e2b.sandboxes import (
    E2BSandbox,
    MemorySandboxStore,
    RedisSandboxStore,
    SandboxStore,
    valid_sandbox_id,
)
from sandbox_runtime.e2b.wire import template_of
from sandbox_runtime.errors import FileAccessError, InvalidRequestError
from sandbox_runtime.workspaces.fsops import WorkspaceFiles


@pytest.mark.parametrize(
    ("given", "workspace"),
    [
        (None, "/workspace"),
        ("", "/workspace"),
        ("/home/user", "/workspace"),
        ("/home/user/a/b.txt", "/workspace/a/b.txt"),
        ("a/b.txt", "/workspace/a/b.txt"),
        ("~/x", "/workspace/x"),
        ("/workspace/x", "/workspace/x"),
        ("/home/user//x/./y", "/workspace/x/y"),
    ],
)
def test_e2b_paths_name_the_workspace(given: Any, workspace: str) -> None:
    assert to_workspace(given) == workspace


@pytest.mark.parametrize(
    "given",
    ["/etc/passwd", "../x", "/home/user/../../etc", "/home/userx/a", "/home", "a\0b", "/tmp/x", 7],
)
def test_e2b_paths_outside_the_home_are_refused(given: Any) -> None:
    with pytest.raises(InvalidRequestError):
        to_workspace(given)


def test_workspace_paths_read_back_as_e2b_paths() -> None:
    assert to_e2b("/workspace") == "/home/user"
    assert to_e2b("a/b") == "/home/user/a/b"
    assert to_e2b("/workspace/a") == "/home/user/a"


def test_templates_are_ours_or_none() -> None:
    assert template_of("base") == "base"
    assert template_of("code-interpreter") == "code-interpreter-v1"
    assert template_of("e2b/code-interpreter-v1:latest") == "code-interpreter-v1"
    assert template_of("my-template") is None
    assert template_of(None) is None


def test_sandbox_ids_are_unguessable_and_checked() -> None:
    from sandbox_runtime.e2b.sandboxes import new_sandbox_id

    ids = {new_sandbox_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(valid_sandbox_id(i) and len(i) == 20 for i in ids)
    for bad in ("", "../x", "A" * 10, "x" * 65, "a b"):
        assert not valid_sandbox_id(bad)


def test_a_sandbox_is_a_named_session_of_its_principal() -> None:
    sandbox = E2BSandbox("iabc", "alice", "base", "base", "tok", 1.0, 2.0, 1)
    assert sandbox.owner.principal == "alice" and sandbox.owner.session_id == "s:e2b-iabc"
    assert E2BSandbox.from_json(sandbox.to_json()) == sandbox


def test_the_memory_store_hands_out_copies_and_counts_per_principal() -> None:
    async def run() -> None:
        store = MemorySandboxStore()
        sandbox = E2BSandbox("iabc", "alice", "base", "base", "tok", 1.0, 2.0, 1)
        await store.put(sandbox)
        got = await store.get("iabc")
        assert got is not None
        got.metadata["changed"] = "yes"  # (a caller's change is not the store's)
        assert (await store.get("iabc")).metadata == {}  # type: ignore[union-attr]
        assert await store.count("alice") == 1 and await store.count("bob") == 0
        assert [s.sandbox_id for s in await store.expired(3.0, 10)] == ["iabc"]
        assert await store.delete(sandbox) is True and await store.delete(sandbox) is False

    asyncio.run(run())


async def replace_is_a_write_only_while_there(store: SandboxStore) -> None:
    now = time.time()
    sandbox = E2BSandbox("irepl", "alice", "base", "base", "tok", now, now + 60, 60)
    assert await store.replace(sandbox) is False and await store.get("irepl") is None
    await store.put(sandbox)
    sandbox.state = "paused"
    assert await store.replace(sandbox) is True
    assert (await store.get("irepl")).state == "paused"  # type: ignore[union-attr]
    assert await store.delete(sandbox) is True
    # (a pause or resume finishing after a kill leaves nothing behind)
    assert await store.replace(sandbox) is False
    assert await store.get("irepl") is None and await store.count("alice") == 0


async def one_transition_at_a_time(store: SandboxStore) -> None:
    assert await store.claim("itr", "a", 60) is True
    assert await store.claim("itr", "b", 60) is False
    await store.release("itr", "b")  # (not b's: nothing happens)
    assert await store.claim("itr", "b", 60) is False
    await store.release("itr", "a")
    assert await store.claim("itr", "b", 60) is True
    assert await store.claim("other", "a", 60) is True


def test_a_killed_sandbox_is_not_written_back_memory() -> None:
    asyncio.run(replace_is_a_write_only_while_there(MemorySandboxStore()))
    asyncio.run(one_transition_at_a_time(MemorySandboxStore()))


def test_a_killed_sandbox_is_not_written_back_redis(redis_server: Any) -> None:
    import redis.asyncio as aioredis

    async def run() -> None:
        client = aioredis.from_url(redis_server.url)
        try:
            await replace_is_a_write_only_while_there(RedisSandboxStore(client, "t44:"))
            await one_transition_at_a_time(RedisSandboxStore(client, "t44:"))
            assert await client.zcard("t44:e2b:ends") == 0
        finally:
            await client.aclose()

    asyncio.run(run())


async def racing_creates_stay_within_the_cap(store: SandboxStore) -> None:
    now = time.time()
    sandboxes = [
        E2BSandbox(f"icap{i}", "carol", "base", "base", "tok", now, now + 60, 60) for i in range(20)
    ]
    added = await asyncio.gather(*(store.add(s, 3) for s in sandboxes))
    assert sum(added) == 3 and await store.count("carol") == 3


def test_racing_creates_stay_within_the_cap_memory() -> None:
    asyncio.run(racing_creates_stay_within_the_cap(MemorySandboxStore()))


def test_racing_creates_stay_within_the_cap_redis(redis_server: Any) -> None:
    """Creates on several replicas at once: counted and written in one step, not a count read
    by all of them before any wrote (SANDBOX_E2B_MAX_SANDBOXES was passed by a burst)."""
    import redis.asyncio as aioredis

    async def run() -> None:
        client = aioredis.from_url(redis_server.url)
        try:
            await racing_creates_stay_within_the_cap(RedisSandboxStore(client, "t44cap:"))
        finally:
            await client.aclose()

    asyncio.run(run())


def request_of(chunks: list[bytes]) -> Request:
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)  # type: ignore[arg-type]


def read_all(chunks: list[bytes]) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [m async for m in read_frames(request_of(chunks))]

    return asyncio.run(run())


def test_frames_split_anywhere_are_read_whole() -> None:
    body = frame({"a": 1}) + frame({"b": "x" * 1000}) + frame({}, 0x02)
    pieces = [body[i : i + 3] for i in range(0, len(body), 3)]
    assert read_all(pieces) == [{"a": 1}, {"b": "x" * 1000}]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (struct.pack(">BI", 0, MAX_FRAME + 1), "resource_exhausted"),
        (b"\x00\x00\x00", "invalid_argument"),
        (struct.pack(">BI", 0, 10) + b"{}", "invalid_argument"),
        (struct.pack(">BI", 0, 4) + b"nope", "invalid_argument"),
        (struct.pack(">BI", 0, 2) + b"[]", "invalid_argument"),
        (struct.pack(">BI", 1, 2) + b"{}", "unimplemented"),
    ],
)
def test_bad_frames_are_connect_errors(body: bytes, code: str) -> None:
    with pytest.raises(ConnectError) as caught:
        read_all([body])
    assert caught.value.code == code


def test_the_end_frame_carries_the_error() -> None:
    from sandbox_runtime.e2b.connect import end_frame

    raw = end_frame(ConnectError("not_found", "gone"))
    flags, length = struct.unpack(">BI", raw[:5])
    assert flags == 2 and json.loads(raw[5 : 5 + length]) == {
        "error": {"code": "not_found", "message": "gone"}
    }


@pytest.fixture
def files(tmp_path: Path) -> WorkspaceFiles:
    root = tmp_path / "ws"
    root.mkdir()
    return WorkspaceFiles(root, os.getuid(), os.getgid())


def test_make_dir_makes_parents_and_says_when_it_was_there(files: WorkspaceFiles) -> None:
    assert files.make_dir("a/b/c") is True
    assert (files.root / "a/b/c").is_dir()
    assert files.make_dir("a/b/c") is False
    files.write("f", b"x", False)
    with pytest.raises(FileAccessError):
        files.make_dir("f")


def test_make_dir_does_not_follow_a_planted_link(files: WorkspaceFiles, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (files.root / "link").symlink_to(outside)
    with pytest.raises((FileAccessError, InvalidRequestError)):
        files.make_dir("link/new")
    assert list(outside.iterdir()) == []


def test_move_renames_within_the_workspace(files: WorkspaceFiles, tmp_path: Path) -> None:
    files.write("a.txt", b"hello", False)
    entry = files.move("a.txt", "d/e/b.txt")
    assert entry.path == "d/e/b.txt" and entry.size == 5
    assert (files.root / "d/e/b.txt").read_bytes() == b"hello"
    assert not (files.root / "a.txt").exists()
    with pytest.raises(FileAccessError):
        files.move("missing", "x")
    with pytest.raises(InvalidRequestError):
        files.move("d", "d/e/inside")
    with pytest.raises(InvalidRequestError):
        files.move("d", "")
    outside = tmp_path / "outside"
    outside.mkdir()
    (files.root / "link").symlink_to(outside)
    with pytest.raises((FileAccessError, InvalidRequestError)):
        files.move("d/e/b.txt", "link/stolen")
    assert list(outside.iterdir()) == []


def test_an_open_server_still_wants_a_key_header() -> None:
    """No tokens configured: any key is principal `default`, but a request without one (a
    cross-site form a browser may send without a preflight) is refused."""
    from sandbox_runtime.e2b.control import principal_of

    def request(headers: list[tuple[bytes, bytes]]) -> Request:
        return Request({"type": "http", "method": "POST", "headers": headers})

    assert principal_of(request([]), {}) is None
    assert principal_of(request([(b"x-api-key", b"e2b_00")]), {}) == "default"
    tokens = {"e2b_" + "ab" * 20: "alice"}
    assert principal_of(request([(b"x-api-key", b"e2b_00")]), tokens) is None
    assert principal_of(request([(b"x-api-key", ("e2b_" + "ab" * 20).encode())]), tokens) == "alice"
    assert (
        principal_of(request([(b"authorization", ("Bearer e2b_" + "ab" * 20).encode())]), tokens)
        == "alice"
    )
