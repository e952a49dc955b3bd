"""Adversarial tests of the workspace file tools: sandboxed code sets a trap in its workspace
(symlinks to /etc/shadow, to another session's files, to /proc/1/root; swapped directories;
FIFOs; hard links; 100k files; a full disk; hostile names and depths), then a file tool walks
into it. A real server and the official MCP client; the last part tests fsops directly."""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import socket
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp.shared.exceptions import MCPError
from mcp_harness import Conn, ServerProcess, Servers, error_text, eventually, open_client

from sandbox_runtime.errors import FileAccessError, InvalidRequestError, WorkspaceFullError
from sandbox_runtime.workspaces.fsops import (
    UPLOAD_PREFIX,
    WorkspaceFiles,
    clean_path,
    openat2_available,
)

pytestmark = pytest.mark.e2e

TOKEN = "attacks-token-0123456789"
MIB = 1024 * 1024
NO_LINK = ("symlink", "symbolic link")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def text_of(path: str | Path) -> str:
    return Path(path).read_text()


def lexists(path: str | Path) -> bool:
    return os.path.lexists(path)


def mentions_link(message: str) -> bool:
    return any(word in message for word in NO_LINK)


def workspaces_of(mb: int, inodes: int) -> dict[str, str]:
    return {
        "SANDBOX_AUTH_TOKEN": TOKEN,
        "SANDBOX_WORKSPACE_MB": str(mb),
        "SANDBOX_WORKSPACE_INODES": str(inodes),
    }


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve("attacks", **workspaces_of(64, 4096))


@pytest.fixture(scope="module")
def quota_server(serve: Servers) -> ServerProcess:
    return serve("quota", **workspaces_of(32, 512))


@pytest.fixture(scope="module")
def big_server(serve: Servers) -> ServerProcess:
    return serve("bigdir", **workspaces_of(256, 150000))


async def sh(
    conn: Conn, session: str, command: str, seconds: float = 60
) -> tuple[int | None, str, str]:
    """Run `command` in the session's sandbox: (exit code, stdout, stderr)."""
    result = await conn.call(
        "execute_code", command=command, session=session, timeout_seconds=seconds
    )
    assert not result.is_error, f"execute_code failed: {error_text(result)}"
    body = result.structured_content
    assert body is not None
    assert not body["has_more"]

    def text(kind: str) -> str:
        return "".join(e.get("data") or "" for e in body["output"] if e["type"] == kind)

    return body["exit_code"], text("stdout"), text("stderr")


def host_path(server: ServerProcess, relative: str) -> Path:
    """Where a workspace file (by a name unique across the server) is on the host."""
    found = list((server.state_dir / "workspaces").glob(f"ws-*/{relative}"))
    assert len(found) == 1, found
    return found[0]


# -- 1. symlinks to secrets -------------------------------------------------------------------


async def test_symlinks_to_secrets_are_listed_never_followed(server: ServerProcess) -> None:
    a, b = unique("victimless"), unique("victim")
    secret_name = f"secret-{uuid.uuid4().hex}.txt"
    secret = f"B-SECRET-{uuid.uuid4().hex}\n"
    shadow = "/etc/shadow" if lexists("/etc/shadow") else "/etc/passwd"
    shadow_before = sha(shadow)
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("write_file", path=secret_name, content=secret, session=b)
        b_file = host_path(server, secret_name)
        assert b_file.read_text() == secret
        targets = {"shadow": shadow, "other": str(b_file), "proc1": "/proc/1/root"}
        made = " && ".join(
            f"ln -s '{target}' {prefix}{name}"
            for name, target in targets.items()
            for prefix in ("", "w-", "del-")
        )
        code, _, err = await sh(conn, a, made)
        assert code == 0, err

        for name in targets:
            message = await conn.error("read_file", path=name, session=a)
            assert mentions_link(message), message
            message = await conn.error("create_file_url", path=name, session=a)
            assert mentions_link(message), message
            with pytest.raises(MCPError):
                await conn.client.read_resource(f"workspace://{a}/{name}")
        for through in ("proc1/etc/shadow", "proc1/etc/passwd", f"other/{secret_name}"):
            message = await conn.error("read_file", path=through, session=a)
            assert mentions_link(message), message

        listing = await conn.ok("list_files", depth=4, session=a)
        entries = {e["path"]: e for e in listing["entries"]}
        for name, target in targets.items():
            assert entries[name]["type"] == "symlink", entries[name]
            assert entries[name]["target"] == target
        assert not [p for p in entries if "/" in p], "the listing went through a link"

        for name in targets:  # writing at a link's name replaces the link, never the target
            refused = await conn.error(
                "write_file", path=f"w-{name}", content="pwned", overwrite=False, session=a
            )
            assert "already exists" in refused
            wrote = await conn.call("write_file", path=f"w-{name}", content="pwned", session=a)
            if not wrote.is_error:
                back = await conn.ok("read_file", path=f"w-{name}", session=a)
                assert back["content"] == "pwned"
            deleted = await conn.ok("delete_file", path=f"del-{name}", session=a)
            assert deleted["deleted"] == "symlink"

        after = {e["path"]: e["type"] for e in (await conn.ok("list_files", session=a))["entries"]}
        assert not [p for p in after if p.startswith("del-")]
        assert all(after[name] == "symlink" for name in targets)
        assert sha(shadow) == shadow_before
        assert b_file.read_text() == secret
        assert (await conn.ok("read_file", path=secret_name, session=b))["content"] == secret
        # a URL signed for a file that is then swapped for a link serves nothing
        await conn.ok("write_file", path="swap", content="plain", session=a)
        url = (await conn.ok("create_file_url", path="swap", session=a))["url"]
        async with httpx2.AsyncClient(timeout=10) as http:
            assert (await http.get(url)).text == "plain"
            code, _, err = await sh(conn, a, f"ln -sfn '{b_file}' swap")
            assert code == 0, err
            got = await http.get(url)
            assert got.status_code >= 400 and secret not in got.text, got.text
            assert mentions_link(got.text), got.text
        # inside the sandbox: the kept links are intact, the deleted ones gone
        code, out, _ = await sh(conn, a, "readlink proc1 shadow; test -e del-proc1 || echo gone")
        assert code == 0 and out.splitlines() == ["/proc/1/root", shadow, "gone"]


# -- 2. symlinked parent directories ----------------------------------------------------------


async def test_paths_through_a_symlinked_directory_are_refused(server: ServerProcess) -> None:
    a, b = unique("parent"), unique("victim")
    folder = f"dir-{uuid.uuid4().hex}"
    secret = f"B-SECRET-{uuid.uuid4().hex}\n"
    fresh = f"new-{uuid.uuid4().hex}"
    passwd_before = sha("/etc/passwd")
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("write_file", path=f"{folder}/secret.txt", content=secret, session=b)
        b_dir = host_path(server, folder)
        code, _, err = await sh(
            conn,
            a,
            f"ln -s /etc d && ln -s '{b_dir}' bd && mkdir -p trap/in && ln -s '{b_dir}' trap/bd "
            "&& ln -s /etc trap/in/etc && ln -s / trap/root",
        )
        assert code == 0, err

        for path in ("d/passwd", "/workspace/d/hostname", "bd/secret.txt"):
            message = await conn.error("read_file", path=path, session=a)
            assert mentions_link(message), message
            message = await conn.error("write_file", path=path, content="pwned", session=a)
            assert mentions_link(message), message
            message = await conn.error("delete_file", path=path, session=a)
            assert mentions_link(message), message
        for path in (f"d/{fresh}", f"bd/{fresh}", f"bd/{fresh}/deeper.txt", f"d/{fresh}/x"):
            message = await conn.error("write_file", path=path, content="pwned", session=a)
            assert mentions_link(message), message
        for path in ("d", "bd", "d/", "/workspace/bd/.", "bd/x"):
            message = await conn.error("list_files", path=path, session=a)
            assert mentions_link(message), message
        message = await conn.error("create_file_url", path="d/passwd", session=a)
        assert mentions_link(message), message
        async with httpx2.AsyncClient(timeout=10) as http:
            for path in (f"d/{fresh}", f"bd/{fresh}"):  # a PUT URL is signed without a look;
                url = await conn.ok("create_file_url", path=path, method="PUT", session=a)
                put = await http.put(url["url"], content=b"pwned")  # the upload looks again
                assert put.status_code >= 400, put.text
                assert mentions_link(put.text), put.text

        # a recursive delete removes the links in a tree, never what they point to
        assert (await conn.ok("delete_file", path="trap", recursive=True, session=a))[
            "deleted"
        ] == "directory"
        # "bd/" names the link itself: deleting it (even recursively) removes only the link
        deleted = await conn.ok("delete_file", path="bd/", recursive=True, session=a)
        assert deleted["deleted"] == "symlink"
        assert sha("/etc/passwd") == passwd_before
        assert not lexists(f"/etc/{fresh}")
        assert sorted(os.listdir(b_dir)) == ["secret.txt"]
        assert (b_dir / "secret.txt").read_text() == secret
        assert lexists("/etc/passwd") and lexists("/etc/hostname")
        names = {e["path"] for e in (await conn.ok("list_files", session=a))["entries"]}
        assert names == {"d"}
        back = await conn.ok("read_file", path=f"{folder}/secret.txt", session=b)
        assert back["content"] == secret


# -- 3. a rename race -------------------------------------------------------------------------

RACE = r"""
import ctypes, os, sys, time
os.mkdir('d')
open('d/passwd', 'w').write('own passwd\n')
open('d/shadow', 'w').write('own shadow\n')
os.symlink('/etc', 'd-alt')
os.mkdir('w'); open('w/passwd', 'w').write('own\n')
os.symlink(sys.argv[1], 'w-alt')
libc = ctypes.CDLL(None, use_errno=True)
def swap(a, b):  # renameat2(RENAME_EXCHANGE): the name always exists, a dir or a link
    if libc.renameat2(-100, a, -100, b, 2) != 0:
        raise OSError(ctypes.get_errno(), 'renameat2')
swap(b'd', b'd-alt'); swap(b'd', b'd-alt')
open('racing', 'w').write('1')
end = time.monotonic() + 45
while time.monotonic() < end:
    swap(b'd', b'd-alt')
    swap(b'w', b'w-alt')
"""


async def test_a_rename_race_never_leads_outside(server: ServerProcess, tmp_path: Path) -> None:
    session = unique("race")
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "passwd").write_text("sentinel\n")
    etc = {text_of("/etc/passwd")}
    if lexists("/etc/shadow"):
        etc.add(text_of("/etc/shadow"))
    own = {"d/passwd": "own passwd\n", "d/shadow": "own shadow\n"}
    outcomes = {"read": 0, "read refused": 0, "list": 0, "write": 0}
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("write_file", path="race.py", content=RACE, session=session)
        started = await conn.ok(
            "execute_code_async",
            command=f"python3 race.py '{sentinel}'",
            timeout_seconds=60,
            session=session,
        )
        execution = started["execution_id"]
        try:

            async def racing() -> bool:
                status = await conn.ok(
                    "get_execution_status", execution_id=execution, session=session
                )
                assert status["status"] == "running", status
                return not (await conn.call("read_file", path="racing", session=session)).is_error

            await eventually(racing, 20, "the rename loop to start")
            for i in range(200):
                path = ("d/passwd", "d/shadow")[i % 2]
                read = await conn.call("read_file", path=path, session=session)
                if read.is_error:
                    assert mentions_link(error_text(read)), error_text(read)
                    outcomes["read refused"] += 1
                else:
                    content = (read.structured_content or {})["content"]
                    assert content not in etc
                    assert content == own[path]
                    outcomes["read"] += 1
                listed = await conn.call("list_files", path="d", session=session)
                if not listed.is_error:
                    names = {e["path"] for e in (listed.structured_content or {})["entries"]}
                    assert names <= set(own), names
                    outcomes["list"] += 1
                target = ("w/passwd", f"w/new-{i}")[i % 2]
                wrote = await conn.call(
                    "write_file", path=target, content=f"written {i}\n", session=session
                )
                outcomes["write"] += not wrote.is_error
                if i % 10 == 5:  # through the link, this would remove the sentinel
                    await conn.call("delete_file", path="w/passwd", session=session)
            status = await conn.ok("get_execution_status", execution_id=execution, session=session)
            assert status["status"] == "running", "the race loop ended before the calls did"
        finally:
            await conn.call("cancel_execution", execution_id=execution, force=True, session=session)

        async def stopped() -> bool:
            status = await conn.ok("get_execution_status", execution_id=execution, session=session)
            return status["status"] == "cancelled"

        await eventually(stopped, 20, "the race loop to stop")
        assert sorted(os.listdir(sentinel)) == ["passwd"]
        assert (sentinel / "passwd").read_text() == "sentinel\n"
        # the race was on: some calls found the directory, some the link
        assert outcomes["read"] and outcomes["read refused"], outcomes
        assert outcomes["write"], outcomes


# -- 4. FIFOs and sockets ---------------------------------------------------------------------


async def test_fifos_and_sockets_never_block_a_tool(server: ServerProcess) -> None:
    session = unique("fifo")
    async with open_client(server.url, TOKEN, "auto") as conn:
        code, _, err = await sh(
            conn,
            session,
            "mkfifo f g h && python3 -c "
            "\"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"",
        )
        assert code == 0, err
        with anyio.fail_after(10):
            message = await conn.error("read_file", path="f", session=session)
            assert "fifo" in message and "not a regular file" in message
            message = await conn.error("read_file", path="sock", session=session)
            assert "socket" in message
            message = await conn.error("create_file_url", path="f", session=session)
            assert "fifo" in message
            with pytest.raises(MCPError):
                await conn.client.read_resource(f"workspace://{session}/f")
            listing = await conn.ok("list_files", session=session)
            kinds = {e["path"]: e["type"] for e in listing["entries"]}
            assert kinds == {"f": "fifo", "g": "fifo", "h": "fifo", "sock": "socket"}
            refused = await conn.error(
                "write_file", path="g", content="x", overwrite=False, session=session
            )
            assert "already exists" in refused
            wrote = await conn.call("write_file", path="g", content="now a file", session=session)
            if not wrote.is_error:
                assert (await conn.ok("read_file", path="g", session=session))[
                    "content"
                ] == "now a file"
            assert (await conn.ok("delete_file", path="h", session=session))["deleted"] == "fifo"
            kinds = {
                e["path"]: e["type"]
                for e in (await conn.ok("list_files", session=session))["entries"]
            }
            assert kinds["f"] == "fifo" and "h" not in kinds
            assert kinds["g"] == ("fifo" if wrote.is_error else "file")


# -- 5. hard links out of the workspace -------------------------------------------------------


@pytest.mark.parametrize("target", ["/etc/passwd", "/usr/bin/env"])
async def test_hard_links_to_outside_cannot_be_made(server: ServerProcess, target: str) -> None:
    session = unique("hardlink")
    async with open_client(server.url, TOKEN, "auto") as conn:
        code, _, err = await sh(conn, session, f"ln {target} x")
        assert code not in (0, None), err
        assert "Invalid cross-device link" in err or "Operation not permitted" in err, err
        message = await conn.error("read_file", path="x", session=session)
        assert "no such file" in message


# -- 6. a 100k-file directory -----------------------------------------------------------------

MANY = 100_000


async def test_a_huge_directory_is_listed_within_bounds(big_server: ServerProcess) -> None:
    session = unique("many")
    async with open_client(big_server.url, TOKEN, "auto") as conn:
        made = await conn.call(
            "execute_code",
            command="python3 -c \"import os\nos.mkdir('d')\nfor i in range("
            f"{MANY}): os.close(os.open(f'd/f{{i:06d}}', os.O_CREAT | os.O_WRONLY))\"",
            timeout_seconds=120,
            session=session,
        )
        assert not made.is_error, error_text(made)
        body = made.structured_content or {}
        assert body["exit_code"] == 0, body
        assert len(body["files"]) <= 50  # the changed-files report is bounded too
        for limit, depth, path in ((None, 1, "d"), (10_000, 1, "d"), (10_000, 2, ".")):
            args = {"path": path, "depth": depth} | ({"limit": limit} if limit else {})
            began = time.monotonic()
            listing = await conn.ok("list_files", session=session, **args)
            assert time.monotonic() - began < 10
            assert listing["truncated"] is True
            assert listing["count"] == len(listing["entries"]) == (limit or 1000)
        assert listing["usage"]["files_used"] > MANY


# -- 7. quotas --------------------------------------------------------------------------------


async def test_the_byte_quota_holds_inside_and_on_the_host(quota_server: ServerProcess) -> None:
    session = unique("bytes")
    marker = f"marker-{uuid.uuid4().hex}"
    async with open_client(quota_server.url, TOKEN, "auto") as conn:
        await conn.ok("write_file", path=marker, content="m", session=session)
        image = host_path(quota_server, marker).parent.with_suffix(".img")
        assert image.is_file()
        code, _, err = await sh(conn, session, "dd if=/dev/zero of=big bs=1M count=100")
        assert code not in (0, None)
        assert "No space left on device" in err, err
        # Thin (SANDBOX_WORKSPACE_RESERVE=thin): the host gives the image what it holds, and
        # never more than its quota.
        assert 16 * MIB <= os.stat(image).st_blocks * 512 < 33 * MIB
        assert image.stat().st_size == 32 * MIB
        code, _, err = await sh(conn, session, "rm big")
        assert code == 0, err
        blob = os.urandom(MIB)
        wrote = await conn.ok(
            "write_file",
            path="one-mib",
            content=base64.b64encode(blob).decode(),
            encoding="base64",
            session=session,
        )
        assert wrote["size"] == MIB
        assert wrote["usage"]["bytes_used"] <= wrote["usage"]["bytes_limit"] <= 32 * MIB
        back = await conn.ok(
            "read_file", path="one-mib", encoding="base64", length=MIB, session=session
        )
        assert base64.b64decode(back["content"]) == blob
        # deleted files give their blocks back to the host (discard, once the delete is
        # committed: the write_file's fsync commits it)
        assert os.stat(image).st_blocks * 512 < 8 * MIB


async def test_an_upload_past_the_quota_fails_cleanly(quota_server: ServerProcess) -> None:
    session = unique("upload")
    marker = f"marker-{uuid.uuid4().hex}"
    chunk = base64.b64encode(os.urandom(2 * MIB)).decode()
    async with open_client(quota_server.url, TOKEN, "auto") as conn:
        await conn.ok("write_file", path=marker, content="m", session=session)
        point = host_path(quota_server, marker).parent
        await conn.ok("write_file", path="x", content="old content", session=session)
        message = None
        for i in range(40):
            result = await conn.call(
                "write_file", path=f"fill-{i}", content=chunk, encoding="base64", session=session
            )
            if result.is_error:
                message = error_text(result)
                break
        assert message is not None, "40 uploads of 2 MiB fit in a 32 MiB workspace"
        assert "workspace is full" in message and "quota" in message, message
        assert i >= 8  # most of the 32 MiB was usable
        message = await conn.error(
            "write_file", path="x", content=chunk, encoding="base64", session=session
        )
        assert "workspace is full" in message, message
        assert (await conn.ok("read_file", path="x", session=session))["content"] == "old content"
        listing = await conn.ok("list_files", session=session)
        names = {e["path"] for e in listing["entries"]}
        assert f"fill-{i}" not in names and f"fill-{i - 1}" in names
        assert not [n for n in os.listdir(point) if n.startswith(UPLOAD_PREFIX)]
        # deleting makes room again
        await conn.ok("delete_file", path="fill-0", session=session)
        await conn.ok("write_file", path="x", content=chunk, encoding="base64", session=session)


async def test_the_inode_quota_holds(quota_server: ServerProcess) -> None:
    session = unique("inodes")
    async with open_client(quota_server.url, TOKEN, "auto") as conn:
        code, _, err = await sh(
            conn,
            session,
            "python3 -c \"import os\nfor i in range(1000): os.close(os.open(f'f{i}', "
            'os.O_CREAT | os.O_WRONLY))"',
        )
        assert code not in (0, None)
        assert "No space left on device" in err, err
        message = await conn.error("write_file", path="new.txt", content="x", session=session)
        assert "workspace is full" in message, message
        message = await conn.error("write_file", path="sub/new.txt", content="x", session=session)
        assert "workspace is full" in message, message
        listing = await conn.ok("list_files", limit=10_000, session=session)
        assert 400 < listing["count"] < 1000
        assert listing["usage"]["files_limit"] < 1000
        assert "new.txt" not in {e["path"] for e in listing["entries"]}


# -- hostile names and depths (found by these tests) ------------------------------------------


async def test_undecodable_names_and_deep_trees_do_not_break_the_tools(
    server: ServerProcess,
) -> None:
    session = unique("hostile")
    async with open_client(server.url, TOKEN, "auto") as conn:
        made = await conn.call(
            "execute_code",
            command="python3 -c \"import os\nopen(b'bad\\xffname', 'w').write('x')\n"
            "os.symlink(b'/etc/\\xfe', b'link')\nopen('fine.txt', 'w').write('y')\"",
            session=session,
        )
        assert not made.is_error, error_text(made)
        assert (made.structured_content or {})["files"] == [{"path": "fine.txt", "size": 1}]
        listing = await conn.ok("list_files", session=session)
        entries = {e["path"]: e for e in listing["entries"]}
        assert entries["bad\ufffdname"]["type"] == "file"
        assert entries["link"]["target"] == "/etc/\ufffd"

        deep = await conn.call(
            "execute_code",
            command="python3 -c \"import os\nfor i in range(1200): os.mkdir('a'); os.chdir('a')\n"
            "open('f', 'w').write('deep')\" && echo made",
            session=session,
        )
        assert not deep.is_error, error_text(deep)  # the changed-files scan must not fail it
        assert (deep.structured_content or {})["exit_code"] == 0
        code, out, _ = await sh(conn, session, "echo still fine")
        assert code == 0 and out == "still fine\n"
        result = await conn.call("delete_file", path="a", recursive=True, session=session)
        if result.is_error:  # refused cleanly, not an internal error
            assert "too deep" in error_text(result), error_text(result)
            code, _, err = await sh(conn, session, "rm -rf a")
            assert code == 0, err
        names = {e["path"] for e in (await conn.ok("list_files", session=session))["entries"]}
        assert "a" not in names


# -- 8. fsops directly ------------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to the sandbox uid needs root")
MODES = [
    pytest.param(
        True,
        id="openat2",
        marks=pytest.mark.skipif(not openat2_available(), reason="no openat2"),
    ),
    pytest.param(False, id="walk"),
]
UID = GID = 65534


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the workspace, with a secret in it."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret").write_text("outside secret\n")
    return path


@pytest.fixture(params=MODES)
def files(request: pytest.FixtureRequest, tmp_path: Path) -> WorkspaceFiles:
    root = tmp_path / "ws"
    root.mkdir()
    return WorkspaceFiles(root, UID, GID, use_openat2=request.param)


def _names(path: Path) -> list[str]:
    return sorted(os.listdir(path))


@needs_root
def test_fsops_symlink_components_are_refused(files: WorkspaceFiles, outside: Path) -> None:
    root = files.root
    os.symlink(outside / "secret", root / "s")
    os.symlink(outside, root / "d")
    os.symlink("d", root / "dd")  # a relative chain
    os.symlink("..", root / "up")
    os.symlink("/proc/1/root", root / "p")
    (root / "tree").mkdir()
    os.symlink(outside, root / "tree" / "out")

    for path in ("s", "d", "dd", "up", "p"):
        with pytest.raises(FileAccessError, match=r"symlink|symbolic link|not a directory"):
            files.read(path, 0, 100)
        assert files.stat(path).type == "symlink"
    assert files.stat("s").target == str(outside / "secret")
    for path in ("d/secret", "dd/secret", "up/outside/secret", "p/etc/passwd", "tree/out/secret"):
        with pytest.raises(FileAccessError, match="symbolic link"):
            files.read(path, 0, 100)
        with pytest.raises(FileAccessError, match="symbolic link"):
            files.write(path, b"pwned", True)
        with pytest.raises(FileAccessError, match="symbolic link"):
            files.delete(path, False)
        with pytest.raises(FileAccessError, match="symbolic link"):
            files.stat(path)
    for path in ("d/new", "d/sub/new", "dd/new", "up/new"):
        with pytest.raises(FileAccessError, match="symbolic link"):
            files.write(path, b"pwned", True)
    for path in ("d", "dd", "up", "p", "tree/out"):
        with pytest.raises(FileAccessError, match="symbolic link"):
            files.listing(path, 1, 100)
    entries, truncated = files.listing(".", 16, 1000)
    assert not truncated
    by_path = {e.path: e for e in entries}
    assert set(by_path) == {"s", "d", "dd", "up", "p", "tree", "tree/out"}
    assert by_path["tree/out"].type == "symlink" and by_path["tree/out"].target == str(outside)

    assert files.write("s", b"replaced", True) == 8  # replaces the link, not its target
    assert not (root / "s").is_symlink() and (root / "s").read_bytes() == b"replaced"
    assert files.delete("d", True) == "symlink"
    assert files.delete("tree", True) == "directory"
    assert (outside / "secret").read_text() == "outside secret\n"
    assert _names(outside) == ["secret"]
    assert _names(root) == ["dd", "p", "s", "up"]


@needs_root
def test_fsops_paths_must_stay_in_the_workspace(files: WorkspaceFiles) -> None:
    for path in ("..", "a/../b", "/etc/passwd", "/workspacex/y", "/workspace/../etc", "//x"):
        with pytest.raises(InvalidRequestError):
            clean_path(path)
        with pytest.raises(InvalidRequestError):
            files.write(path, b"x", True)
    for path in ("a\x00b", "\ud800", "x" * 256, "a/" * 2100):
        with pytest.raises(InvalidRequestError):
            clean_path(path)
    assert clean_path("/workspace/a//b/./") == ("a", "b")
    assert clean_path("/workspace") == clean_path(".") == clean_path("") == ()
    files.write("/workspace/a/b.txt", b"abs", True)
    assert files.read("a/b.txt", 0, 10) == (b"abs", 3)
    assert files.read("/workspace/a/b.txt", 1, 10) == (b"bs", 3)
    assert [e.path for e in files.listing("/workspace", 2, 10)[0]] == ["a", "a/b.txt"]
    with pytest.raises(InvalidRequestError):
        files.delete("/workspace", True)
    assert files.delete("/workspace/a", True) == "directory"
    assert _names(files.root) == []


@needs_root
def test_fsops_refuses_fifos_and_sockets_without_blocking(files: WorkspaceFiles) -> None:
    os.mkfifo(files.root / "f")
    os.mkfifo(files.root / "g")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(files.root / "sock"))
    outcome: list[BaseException | None] = []

    def read_fifo() -> None:
        try:
            files.read("f", 0, 10)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read_fifo, daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # blocked in open(): let it go before failing
        os.close(os.open(files.root / "f", os.O_RDWR | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("reading a FIFO blocked")
    assert isinstance(outcome[0], FileAccessError) and "fifo" in str(outcome[0])
    with pytest.raises(FileAccessError, match="socket"):
        files.read("sock", 0, 10)
    assert files.stat("f").type == "fifo" and files.stat("sock").type == "socket"
    with pytest.raises(FileAccessError, match="already exists"):
        files.write("g", b"x", False)
    assert files.write("g", b"file now", True) == 8
    assert stat.S_ISREG(os.lstat(files.root / "g").st_mode)
    kinds = {e.path: e.type for e in files.listing(".", 1, 10)[0]}
    assert kinds == {"f": "fifo", "g": "file", "sock": "socket"}


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs with 64 inodes: real ENOSPC."""
    point = tmp_path / "small"
    point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=64", "tmpfs", str(point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


@needs_root
@pytest.mark.parametrize("use_openat2", MODES)
def test_fsops_writes_are_atomic_at_the_quota(small_fs: Path, use_openat2: bool) -> None:
    files = WorkspaceFiles(small_fs, UID, GID, use_openat2=use_openat2)
    assert files.write("x", b"old", True) == 3
    with pytest.raises(WorkspaceFullError, match="workspace is full"):
        files.write("x", b"\1" * 2 * MIB, True)
    with pytest.raises(WorkspaceFullError):
        files.write("y", b"\1" * 2 * MIB, True)
    assert files.read("x", 0, 10) == (b"old", 3)
    assert _names(small_fs) == ["x"]  # no upload left behind
    upload = files.open_upload("x", True)  # an upload given up midway
    upload.write(b"partial")
    upload.abort()
    upload.abort()
    assert files.read("x", 0, 10) == (b"old", 3) and _names(small_fs) == ["x"]
    made = 0
    with contextlib.suppress(OSError):
        for made in range(100):
            (small_fs / f"n{made}").touch()
    assert made < 99
    with pytest.raises(WorkspaceFullError, match="workspace is full"):
        files.write("z", b"1", True)


@needs_root
def test_fsops_files_belong_to_the_sandbox_user(files: WorkspaceFiles) -> None:
    assert files.write("a/b/c.txt", b"c", True) == 1
    for relative in ("a", "a/b", "a/b/c.txt"):
        st = os.lstat(files.root / relative)
        assert (st.st_uid, st.st_gid) == (UID, GID), relative
    assert stat.S_IMODE(os.lstat(files.root / "a/b/c.txt").st_mode) == 0o644
    files.write("a/b/c.txt", b"again", True)
    assert os.lstat(files.root / "a/b/c.txt").st_uid == UID


@needs_root
def test_fsops_a_rename_race_never_leads_outside(files: WorkspaceFiles, outside: Path) -> None:
    root = files.root
    (root / "d").mkdir()
    (root / "d" / "secret").write_text("own\n")
    (root / "d" / "own-marker").write_text("")
    os.symlink(outside, root / "alt")
    libc = ctypes.CDLL(None, use_errno=True)
    stop = threading.Event()
    swaps = [0]

    def swap() -> None:
        a, b = os.fsencode(root / "d"), os.fsencode(root / "alt")
        while not stop.is_set():
            if libc.renameat2(-100, a, -100, b, 2) != 0:
                raise OSError(ctypes.get_errno(), "renameat2")
            swaps[0] += 1

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    seen = {"read": 0, "refused": 0}
    try:
        for i in range(3000):
            try:
                data, _ = files.read("d/secret", 0, 100)
                assert data == b"own\n"
                seen["read"] += 1
            except FileAccessError as exc:
                if "no such file" in str(exc):  # deleted below: write it again
                    with contextlib.suppress(FileAccessError):
                        files.write("d/secret", b"own\n", True)
                else:
                    assert "symbolic link" in str(exc) or "symlink" in str(exc), exc
                    seen["refused"] += 1
            with contextlib.suppress(FileAccessError):
                names = {e.path for e in files.listing("d", 1, 10)[0]}
                assert "d/own-marker" in names, names  # the workspace's own directory
            with contextlib.suppress(FileAccessError):
                files.write(f"d/w{i % 5}", b"w", True)
            if i % 7 == 0:  # through the link, this would remove the outside secret
                with contextlib.suppress(FileAccessError):
                    files.delete("d/secret", False)
    finally:
        stop.set()
        swapper.join(5)
    assert swaps[0] > 100
    assert seen["read"] and seen["refused"], seen
    assert _names(outside) == ["secret"]
    assert (outside / "secret").read_text() == "outside secret\n"
    own = next(p for p in (root / "d", root / "alt") if not p.is_symlink())
    assert (
        {"own-marker", "w0", "w4"}
        <= set(_names(own))
        <= {"own-marker", "secret", "w0", "w1", "w2", "w3", "w4"}
    )


@pytest.fixture
def deep_files(files: WorkspaceFiles) -> Iterator[WorkspaceFiles]:
    """`files`, whose tree the test makes too deep for pytest's own cleanup (a recursive
    rmtree): removed here with rm -rf, which does not recurse on the stack."""
    yield files
    subprocess.run(["rm", "-rf", str(files.root)], check=True)


@needs_root
def test_fsops_deep_trees_and_undecodable_names(deep_files: WorkspaceFiles) -> None:
    files = deep_files
    fds_before = len(os.listdir("/proc/self/fd"))
    since = time.clock_gettime(5) - 1  # CLOCK_REALTIME_COARSE, as operations.py uses
    fd = os.open(files.root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1200):
        os.mkdir("a", dir_fd=fd)
        step = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = step
    os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    (files.root / "top.txt").write_text("top")
    root = os.fsencode(files.root)
    with open(root + b"/bad\xffname", "w") as f:
        f.write("x")
    os.symlink(b"/etc/\xfe", root + b"/link")

    found, _ = files.changed_since(since, 20_000, 50)
    assert [e.path for e in found] == ["top.txt"]  # nothing unnameable, no recursion error
    entries, _ = files.listing(".", 3, 100)
    json.dumps([e.wire() for e in entries], ensure_ascii=False).encode()  # valid UTF-8
    by_path = {e.path: e for e in entries}
    assert by_path["bad\ufffdname"].type == "file"
    assert by_path["link"].target == "/etc/\ufffd"
    assert "a/a/a" in by_path  # depth 3
    try:
        assert files.delete("a", True) == "directory"
    except FileAccessError as exc:
        assert "too deep" in str(exc)
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert files.delete("bad\udcffname", False) == "file"  # a raw name still works as a path
    assert not os.path.lexists(root + b"/bad\xffname")


def test_fsops_errors_are_domain_errors() -> None:
    """Every errno fsops maps ends as a FileAccessError or WorkspaceFullError with text."""
    files = WorkspaceFiles(Path("/nonexistent"), UID, GID, use_openat2=False)
    for code in (errno.ENOSPC, errno.EDQUOT):
        assert isinstance(files._fail(OSError(code, ""), ("x",), "write"), WorkspaceFullError)
    for code in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
        message = str(files._fail(OSError(code, ""), ("x",), "read"))
        assert "symbolic link" in message, message
