"""Project mode (issue 41): each workspace a directory of the state filesystem with a quota
it enforces, on a loop-mounted state filesystem the tests make: btrfs with quotas enabled
(each workspace a subvolume with a qgroup limit) by default; SRT_QUOTA_FS=ext4-project or xfs
runs the same tests on ext4 `prjquota` / XFS `pquota` (a kernel with quota support: the VM
harness; this machine's kernel has none). The quota holds
from inside the sandbox and through uploads, the sandbox cannot escape it (no subvolume of its
own: its seccomp filter refuses btrfs ioctls), a warm interpreter's workspace is adopted by a
rename, snapshots capture and restore, retention gives the space back, 2,000 sessions fit one
replica for little disk, and a full state filesystem loses no acknowledged write. A real
server, real bwrap sandboxes, the official client. (The ext4/XFS project-quota path runs for
real in the VM harness with SRT_QUOTA_FS; its pure parts: test_workspace_projects.py.)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from loopfs_harness import btrfs_qgroups, disk_used, loop_filesystem
from mcp_harness import eventually, open_client, running_server

from sandbox_runtime.workspaces.projects import Projects, get_project

pytestmark = pytest.mark.e2e

TOKEN = "workspace-quota-token-0123"
MIB = 1024 * 1024
SETTINGS = {
    "SANDBOX_AUTH_TOKEN": TOKEN,
    "SANDBOX_WORKSPACE_MB": "16",
    "SANDBOX_WORKSPACE_QUOTA": "project",
    "SANDBOX_MIN_FREE_DISK_MB": "16",
    "SANDBOX_INTERPRETER_WARM": "python=0",
}
SUBVOL_CREATE = """
import fcntl, os
args = bytearray(4096); args[8:13] = b"inner"
fd = os.open(".", os.O_RDONLY)
try:
    fcntl.ioctl(fd, 0x5000940E, args)
    print("made")
except OSError as exc:
    print("refused", exc.errno)
xattr = bytearray(28)
try:
    fcntl.ioctl(fd, 0x801C581F, xattr)
    xattr[12:16] = (1).to_bytes(4, "little")
    fcntl.ioctl(fd, 0x401C5820, xattr)
    print("projid set")
except OSError as exc:
    print("projid refused", exc.errno)
"""


FS = os.environ.get("SRT_QUOTA_FS", "btrfs")  # or ext4-project, xfs
KIND = {"btrfs": "btrfs", "ext4-project": "ext4", "xfs": "xfs"}[FS]
OVER_QUOTA = ("Disk quota exceeded", "No space left on device")  # (XFS says ENOSPC)


@pytest.fixture(scope="module")
def quotafs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The state filesystem with quotas (btrfs unless SRT_QUOTA_FS says otherwise)."""
    with loop_filesystem(tmp_path_factory.mktemp("quotafs"), FS, 1024) as point:
        yield point


def quota_dir(path: Path) -> bool:
    """Whether `path` is a workspace with a quota: a subvolume's root (quotafs), a directory
    with a project id of its own (ext4, XFS)."""
    if KIND == "btrfs":
        return os.stat(path).st_ino == 256
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return get_project(fd)[1] != 0
    finally:
        os.close(fd)


def quota_ids(root: Path, spaces: list[Path]) -> set[str]:
    """Each workspace's quota: its qgroup (quotafs) or its project id."""
    if KIND == "btrfs":
        return {f"0/{subvolume_id(p)}" for p in spaces}
    ids = set()
    for p in spaces:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        try:
            ids.add(str(get_project(fd)[1]))
        finally:
            os.close(fd)
    return ids


def quotas_left(root: Path, ids: set[str]) -> set[str]:
    """Those of `ids` the filesystem still has (a qgroup; a project with a limit)."""
    if KIND == "btrfs":
        return ids & btrfs_qgroups(root)
    projects = Projects(root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return {i for i in ids if projects._get(fd, int(i)).bytes_limit is not None}
    finally:
        os.close(fd)


def over_quota(text: str) -> bool:
    return any(w in text for w in OVER_QUOTA)


def files_limit_ok(usage: dict[str, Any]) -> bool:
    """btrfs limits no file count (None); ext4/XFS the workspace's inodes."""
    return usage["files_limit"] is None if KIND == "btrfs" else (usage["files_limit"] or 0) > 0


def session() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


def stdout_of(ran: dict[str, Any]) -> str:
    return "".join(e.get("data") or "" for e in ran["output"] if e.get("type") == "stdout")


def all_output(ran: dict[str, Any]) -> str:
    return "".join(e.get("data") or "" for e in ran["output"])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def workdir(quotafs: Path) -> Path:
    return quotafs / uuid.uuid4().hex[:8]


def subvolume_id(path: Path) -> str:
    done = subprocess.run(
        ["btrfs", "subvolume", "show", str(path)], check=True, capture_output=True, text=True
    )
    line = next(x for x in done.stdout.splitlines() if "Subvolume ID:" in x)
    return line.split(":")[1].strip()


async def test_the_quota_holds_inside_and_through_uploads(quotafs: Path) -> None:
    """In project mode (said by /health), a workspace is a subvolume of the state filesystem
    with a 16 MiB limit: dd past it gets "Disk quota exceeded", and so do write_file and a
    PUT to a file URL; the sandbox can neither make a subvolume of its own nor change a
    project id, and the quota still holds after it tried; list_files shows the use."""
    with running_server(workdir(quotafs), **SETTINGS) as server:
        health = server.health()
        assert health["workspaces"] == {"mode": "project", "quota": KIND}, health
        s = session()
        async with open_client(server.url, TOKEN, "auto") as conn:
            ran = await conn.ok("execute_code", command="head -c 2000000 /dev/urandom > a; ls",
                                session=s)  # fmt: skip
            assert ran["exit_code"] == 0, ran
            root = server.state_dir / "workspaces"
            [ws] = [p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir()]
            assert quota_dir(ws), "the workspace is a subvolume's root, or has a project id"
            assert (os.stat(ws).st_mode & 0o777) == 0o700
            assert not any(p.suffix == ".img" for p in root.iterdir()), "no image was made"

            ran = await conn.ok("execute_code", command="dd if=/dev/zero of=big bs=1M count=40",
                                session=s)  # fmt: skip
            assert ran["exit_code"] != 0 and over_quota(all_output(ran)), ran

            listed = await conn.ok("list_files", session=s)
            usage = listed["usage"]
            assert usage["bytes_limit"] == 16 * MIB and files_limit_ok(usage), usage
            assert 15 * MIB <= usage["bytes_used"] <= 17 * MIB, usage

            fill = "rm -f big; dd if=/dev/zero of=fill bs=1M count=15 status=none; sync"
            await conn.ok("execute_code", command=fill, session=s)
            content = b64(os.urandom(MIB * 2 - 4096))
            refused = await conn.error("write_file", path="w.bin", content=content,
                                       encoding="base64", session=s)  # fmt: skip
            assert "workspace is full" in refused, refused
            made = await conn.ok("create_file_url", path="up.bin", method="PUT", session=s)
            put = httpx2.put(made["url"], content=os.urandom(3 * MIB), timeout=60)
            assert put.status_code == 507 and "bytes free" in put.text, put.text
            await conn.ok("execute_code", command="rm fill", session=s)
            # (an upload that fits: a temp file renamed inside the subvolume)
            put = httpx2.put(made["url"], content=b"fits", timeout=30)
            assert put.status_code == 201, put.text
            read = await conn.ok("read_file", path="up.bin", session=s)
            assert read["content"] == "fits"

            ran = await conn.ok("execute_code", command=f"python3 -c '{SUBVOL_CREATE}'", session=s)
            out = stdout_of(ran)
            assert "refused 1" in out and "made" not in out, all_output(ran)
            assert "projid set" not in out, all_output(ran)
            ran = await conn.ok("execute_code", command="dd if=/dev/zero of=big bs=1M count=40",
                                session=s)  # fmt: skip
            assert ran["exit_code"] != 0 and over_quota(all_output(ran)), ran


async def test_warm_adoption_snapshots_and_retention(quotafs: Path, tmp_path: Path) -> None:
    """A warm interpreter's workspace becomes a session's (a rename: the quota goes with
    it); a snapshot captures and restores; a removed workspace's subvolume and qgroup go and
    its space comes back."""
    settings = {**SETTINGS, "SANDBOX_INTERPRETER_WARM": "python=1"}
    with running_server(workdir(quotafs), **settings) as server:
        root = server.state_dir / "workspaces"

        async def warm_waiting() -> bool:
            return server.metric(TOKEN, "srt_interpreters{", 'state="warm"', "python") >= 1

        await eventually(warm_waiting, 60, "a warm python interpreter")
        s = session()
        async with open_client(server.url, TOKEN, "auto") as conn:
            ran = await conn.ok("run_code", code="open('k.txt','w').write('kept')", session=s)
            assert server.metric(TOKEN, "srt_interpreter_events_total{", "warm_hit") >= 1
            listed = await conn.ok("list_files", session=s)
            assert listed["usage"]["bytes_limit"] == 16 * MIB, listed
            ran = await conn.ok("execute_code", command="cat k.txt; dd if=/dev/zero of=z "
                                "bs=1M count=40", session=s)  # fmt: skip
            assert stdout_of(ran) == "kept" and over_quota(all_output(ran)), ran

            await conn.ok("execute_code", command="rm z; echo one > one.txt", session=s)
            taken = await conn.ok("snapshot_session", session=s)
            await conn.ok("execute_code", command="rm one.txt; echo two > two.txt", session=s)
            restored = await conn.ok("restore_session", snapshot_id=taken["snapshot_id"], session=s)
            assert restored["restored_from"]["snapshot_id"] == taken["snapshot_id"]
            ran = await conn.ok("execute_code", command="cat one.txt; ls", session=s)
            assert stdout_of(ran).startswith("one\n") and "two.txt" not in stdout_of(ran)
            ran = await conn.ok("execute_code", command="dd if=/dev/zero of=z bs=1M count=40",
                                session=s)  # fmt: skip
            assert over_quota(all_output(ran)), "the restored workspace is limited"

        spaces = [p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir()]
        ids = quota_ids(quotafs, spaces)
        assert len(ids) == len(spaces) and quotas_left(quotafs, ids) == ids
        old = time.time() - 3 * 86400
        for p in spaces:
            os.utime(p, (old, old))  # (unused for three days: past the retention)
    # The server stopped; the next one's start removes what is past the retention.
    with running_server(server.workdir, **SETTINGS) as server:
        await eventually(
            lambda: not any(p.exists() for p in spaces), 30, "the expired workspaces removed"
        )
        if KIND == "btrfs":
            sync = ["btrfs", "subvolume", "sync", str(quotafs)]
            await asyncio.to_thread(subprocess.run, sync, check=True, timeout=60)
        await eventually(lambda: not quotas_left(quotafs, ids), 30, "their quotas gone")


async def test_two_thousand_sessions_on_one_replica(quotafs: Path) -> None:
    """2,000 sessions, each writing a file, cost the state filesystem a few MiB of metadata
    (images would take 2,000 x SANDBOX_WORKSPACE_MB)."""
    with running_server(workdir(quotafs), **SETTINGS) as server:
        before = disk_used(quotafs)
        started = time.monotonic()

        async def client(k: int) -> None:
            async with open_client(server.url, TOKEN, "auto") as conn:
                for i in range(500):
                    await conn.ok("write_file", path="note.txt", content=f"{k}-{i}",
                                  session=f"m-{k}-{i}")  # fmt: skip

        await asyncio.gather(*(client(k) for k in range(4)))
        took = time.monotonic() - started
        used = disk_used(quotafs) - before
        root = server.state_dir / "workspaces"
        made = [p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir()]
        assert len(made) >= 2000 and all(quota_dir(p) for p in made[:50])
        print(f"2000 sessions: {took:.1f} s, {used / MIB:.1f} MiB of disk")
        assert used < 200 * MIB, f"{used / MIB:.0f} MiB for 2,000 sessions"
        async with open_client(server.url, TOKEN, "auto") as conn:
            read = await conn.ok("read_file", path="note.txt", session="m-3-499")
            assert read["content"] == "3-499"
        assert server.health()["status"] == "ok"


async def test_a_full_state_filesystem_loses_no_acknowledged_write(tmp_path: Path) -> None:
    """Sessions write into a small state filesystem until it is full: each writer gets
    ENOSPC or EDQUOT (a clean refusal), every write_file the server acknowledged reads back
    identical after the caches are dropped, and the server stays healthy."""
    with (
        loop_filesystem(tmp_path, FS, 320) as point,
        running_server(
            point / "w",
            **{**SETTINGS, "SANDBOX_WORKSPACE_MB": "64", "SANDBOX_MIN_FREE_DISK_MB": "0"},
        ) as server,  # fmt: skip
    ):
        written: dict[tuple[str, str], str] = {}
        refusals: list[str] = []
        async with open_client(server.url, TOKEN, "auto") as conn:

            async def writer(s: str) -> None:
                for i in range(40):
                    data = os.urandom(1_500_000)
                    result = await conn.call("write_file", path=f"f{i}.bin", content=b64(data),
                                             encoding="base64", session=s)  # fmt: skip
                    if result.is_error:
                        text = "".join(getattr(c, "text", "") for c in result.content)
                        refusals.append(text)
                        return
                    written[(s, f"f{i}.bin")] = hashlib.sha256(data).hexdigest()

            sessions = [session() for _ in range(6)]
            await asyncio.gather(*(writer(s) for s in sessions))
            assert refusals, "the filesystem filled"
            assert all("full" in r for r in refusals), refusals
            ran = await conn.ok("execute_code", command="dd if=/dev/zero of=x bs=1M count=64",
                                session=sessions[0])  # fmt: skip
            assert ran["exit_code"] != 0, ran
            assert any(w in all_output(ran) for w in ("No space left", "Disk quota")), ran

            await asyncio.to_thread(drop_caches)
            for s in sessions:
                ran = await conn.ok("execute_code", command="sha256sum f*.bin", session=s)
                sums = {line.split()[1]: line.split()[0] for line in stdout_of(ran).splitlines()}
                for (owner, path), digest in written.items():
                    assert owner != s or sums.get(path) == digest, f"{s}:{path} changed"
            health = server.health()
            assert health["disk"]["damaged_workspaces"] == 0, health
            with contextlib.suppress(Exception):
                await conn.ok("execute_code", command="rm -f f*.bin x", session=sessions[0])
            ran = await conn.ok("execute_code", command="echo alive", session=sessions[1])
            assert stdout_of(ran) == "alive\n"


async def test_workspaces_from_before_keep_their_files(quotafs: Path) -> None:
    """A host that now gets project mode serves an image and a plain directory made before
    as they were (their files kept), and makes new workspaces as subvolumes."""
    work = workdir(quotafs)
    imaged, plain, new = session(), session(), session()
    with running_server(work, **{**SETTINGS, "SANDBOX_WORKSPACE_QUOTA": "image"}) as server:
        assert server.health()["workspaces"]["mode"] == "image"
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="old.txt", content="from an image", session=imaged)
    with running_server(work, **{**SETTINGS, "SANDBOX_WORKSPACE_QUOTA": "none"}) as server:
        assert server.health()["workspaces"]["mode"] == "directory"
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="old.txt", content="from a directory", session=plain)
    with running_server(work, **{**SETTINGS, "SANDBOX_WORKSPACE_QUOTA": "auto"}) as server:
        assert server.health()["workspaces"] == {"mode": "project", "quota": KIND}
        async with open_client(server.url, TOKEN, "auto") as conn:
            read = await conn.ok("read_file", path="old.txt", session=imaged)
            assert read["content"] == "from an image"
            usage = (await conn.ok("list_files", session=imaged))["usage"]
            assert usage["files_limit"] is not None, "still an ext4 image: its inode quota"
            read = await conn.ok("read_file", path="old.txt", session=plain)
            assert read["content"] == "from a directory"
            await conn.ok("write_file", path="new.txt", content="new", session=new)
            usage = (await conn.ok("list_files", session=new))["usage"]
            assert usage["bytes_limit"] == 16 * MIB and files_limit_ok(usage), usage


async def test_a_damaged_project_workspace_is_set_aside_and_replaced(quotafs: Path) -> None:
    """A project-mode workspace whose filesystem failed cannot be checked on its own: its
    next use moves it whole to .quarantine/ (files kept for the operator) and makes a fresh
    one with the quota, and the session is told (`workspace_quarantined`), once."""
    from sandbox_runtime.workspaces.store import WorkspaceStore

    root = workdir(quotafs) / "workspaces"
    store = WorkspaceStore(root, size_mb=16, inodes=4096, quota="project",
                           retention_seconds=3600)  # fmt: skip
    store.start(os.geteuid(), os.getegid())
    assert (store.mode, store.quota_kind) == ("project", KIND)
    path, existed = await store.ensure("ws-damaged")
    assert not existed and quota_dir(path)
    (path / "kept.txt").write_text("for the operator")
    store.mark_damaged("ws-damaged", "an I/O error (test)")
    path, _ = await store.ensure("ws-damaged")
    assert store.take_reset("ws-damaged") == "workspace_quarantined"
    assert store.take_reset("ws-damaged") is None
    assert not (path / "kept.txt").exists() and quota_dir(path)
    assert store.usage("ws-damaged")["bytes_limit"] == 16 * MIB
    [kept] = (root / ".quarantine").iterdir()
    assert (kept / "kept.txt").read_text() == "for the operator"
    assert not store.damaged()
    await store.remove("ws-damaged")
    assert not path.exists()
    await store.aclose()
