"""A filling state disk loses no acknowledged write, damages no workspace, and says so (issues
32 and 41).

The state directory is a small ext4 filesystem of the test's own (a loop-mounted image), filled
from the sessions' own `dd` and from outside (a file written straight into it) while they
write; with thin images (the default) every write the server acknowledged must read back
identical after `sync; echo 3 > drop_caches` and after a restart, writers get ENOSPC with
words, no workspace is marked damaged, refusals name the cause and the settings, /ready is
unready while the disk is low and ready again once space returns. A real server, real
images, the official client. Image mode is forced (SANDBOX_WORKSPACE_QUOTA=image).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import hashlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import Conn, ServerProcess, eventually, open_client, running_server

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("mkfs.ext4") is None,
        reason="needs root and mkfs.ext4 to mount a small state filesystem",
    ),
]

TOKEN = "disk-full-token-0123456789"
MIB = 1024 * 1024
STATE_FS_MB = 256
FLOOR_MB = 48
HEADROOM_MB = 16
# 256 MiB workspaces (more than the disk: the disk stops them, not their quota), a margin of
# 16 MiB each (the least for their 8 MiB of metadata plus a dirty-page limit): with three
# mounted, writes stop under max(48, 3 * 16) = 48 MiB free.
SETTINGS = {
    "SANDBOX_AUTH_TOKEN": TOKEN,
    "SANDBOX_WORKSPACE_QUOTA": "image",
    "SANDBOX_WORKSPACE_MB": "256",
    "SANDBOX_WORKSPACE_HEADROOM_MB": str(HEADROOM_MB),
    "SANDBOX_MIN_FREE_DISK_MB": str(FLOOR_MB),
    "SANDBOX_INTERPRETER_WARM": "python=0",
    "SANDBOX_WORKSPACE_POOL": "0",
}


@contextlib.contextmanager
def state_filesystem(tmp_path: Path, mb: int) -> Iterator[Path]:
    """A server workdir whose state directory is a fresh `mb` MiB ext4 filesystem."""
    image, state = tmp_path / "state-fs.img", tmp_path / "work" / "state"
    state.mkdir(parents=True)
    with open(image, "wb") as f:
        f.truncate(mb * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(state)], check=True)
    try:
        yield tmp_path / "work"
    finally:
        # (The server unmounted its workspaces when it stopped; a lazy unmount covers a
        # failed test whose server was killed.)
        for point in sorted(
            (p for p in mounted_under(state)), key=lambda p: len(p.parts), reverse=True
        ):
            subprocess.run(["umount", "-l", str(point)], check=False)
        if subprocess.run(["umount", str(state)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(state)], check=False)
        image.unlink(missing_ok=True)


def mounted_under(root: Path) -> list[Path]:
    prefix = f"{root}/"
    with open("/proc/self/mountinfo") as f:
        return [Path(line.split()[4]) for line in f if line.split()[4].startswith(prefix)]


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    with state_filesystem(tmp_path, STATE_FS_MB) as work:
        yield work


def session() -> str:
    return f"d-{uuid.uuid4().hex[:8]}"


def fill_from_outside(state: Path, mb: int | None = None, name: str = "outside.fill") -> Path:
    """Write a file straight into the state filesystem: `mb` MiB, or until it is full."""
    path = state / name
    chunk = b"\xa5" * MIB
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(mb if mb is not None else 2**20):
            try:
                os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
    return path


def break_superblock(image: Path) -> None:
    with open(image, "r+b") as f:
        f.write(b"\0" * 8192)  # the primary superblock (e2fsck -p does not look for backups)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def ready(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    resp = httpx2.get(f"{server.base_url}/ready", timeout=5)
    return resp.status_code, resp.json()


def metric(server: ServerProcess, prefix: str, *labels: str) -> float:
    return server.metric(TOKEN, prefix, *labels)


def output(ran: dict[str, Any]) -> str:
    return "".join(e.get("data") or "" for e in ran["output"] if e.get("type") != "stderr")


async def dd(conn: Conn, s: str, path: str, mb: int) -> Any:
    """Random bytes into `path` with dd; the result (its sha256 as output) or the call."""
    command = f"dd if=/dev/urandom of={path} bs=1M count={mb} status=none && sha256sum {path}"
    return await conn.call("execute_code", command=command, session=s)


async def sha256_in(conn: Conn, s: str, path: str) -> str:
    ran = await conn.ok("execute_code", command=f"sha256sum {path}", session=s)
    assert not ran.get("session_reset"), ran
    assert ran["exit_code"] == 0, ran
    return output(ran).split()[0]


async def check_all(conn: Conn, written: dict[tuple[str, str], str]) -> None:
    for (s, path), digest in written.items():
        assert await sha256_in(conn, s, path) == digest, f"{s}:{path} changed"


# Writes 2 MiB files with `dd conv=fsync` until one fails: an acknowledged file (dd exited 0)
# is printed with its digest, the failure with dd's words.
WRITER = r"""
i=0
while [ $i -lt 200 ]; do
  i=$((i+1))
  if out=$(dd if=/dev/urandom of=f$i bs=1M count=2 conv=fsync status=none 2>&1); then
    echo "OK f$i $(sha256sum f$i | cut -d' ' -f1)"
  else
    echo "FAILED f$i: $out"; break
  fi
done
"""


def free_bytes(state: Path) -> int:
    st = os.statvfs(state)
    return st.f_bavail * st.f_frsize


def fill_gradually(state: Path, until_free: int, name: str = "outside.fill") -> Path:
    """Write into the state filesystem from outside, 1 MiB at a time put on disk, until it
    has less than `until_free` bytes free (a program filling the disk as the sessions
    write)."""
    path = state / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while free_bytes(state) >= until_free:
            try:
                os.write(fd, b"\x5a" * MIB)
                os.fsync(fd)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    finally:
        os.close(fd)
    return path


def acknowledged(s: str, ran: dict[str, Any], written: dict[tuple[str, str], str]) -> str:
    """Record the files the writer had acknowledged; the words of its failure."""
    assert ran["exit_code"] == 0, ran
    failure = ""
    for line in output(ran).splitlines():
        if line.startswith("OK "):
            _, path, digest = line.split()
            written[(s, path)] = digest
        elif line.startswith("FAILED "):
            failure = line
    return failure


async def test_a_filling_state_disk_stops_writers_cleanly_and_damages_nothing(
    workdir: Path,
) -> None:
    """Three sessions write with dd while the state filesystem fills from inside and from
    outside: every write acknowledged (write_file; dd conv=fsync that exited 0) reads back
    identical after the caches are dropped, the disk filled to its last block from outside
    and a restart; writers get ENOSPC; no workspace is marked damaged; new sessions are
    refused naming the free space and the settings; /ready is 503 while the disk is low and
    200 once space returns, when writes and new sessions work again."""
    state = workdir / "state"
    written: dict[tuple[str, str], str] = {}
    server = ServerProcess(workdir, dict(SETTINGS)).start()
    try:
        assert ready(server)[0] == 200
        assert server.health()["disk"]["reserve"] == "thin"
        async with open_client(server.url, TOKEN, "auto") as conn:
            sessions = [session() for _ in range(3)]
            for s in sessions:
                data = os.urandom(300_000)
                content = base64.b64encode(data).decode()
                await conn.ok(
                    "write_file", path="w.bin", content=content, encoding="base64", session=s
                )
                written[(s, "w.bin")] = hashlib.sha256(data).hexdigest()

            # From inside (each session could take more than the whole disk) and from
            # outside at once, until the disk is under its floor.
            *runs, _ = await asyncio.gather(
                *(
                    conn.ok("execute_code", command=WRITER, session=s, timeout_seconds=120)
                    for s in sessions
                ),
                asyncio.to_thread(fill_gradually, state, (FLOOR_MB // 2) * MIB),
            )
            for s, ran in zip(sessions, runs, strict=True):
                failure = acknowledged(s, ran, written)
                assert "No space left on device" in failure, ran
            assert len(written) > 3 + 10, written  # (they wrote before the disk stopped them)
            print(f"{len(written)} writes acknowledged; {free_bytes(state) // MIB} MiB left free")
            status, body = ready(server)
            assert status == 503 and any(r.startswith("disk:") for r in body["reasons"]), body
            health = server.health()["disk"]
            assert health["status"] == "low" and health["writes_stopped"], health
            assert metric(server, "srt_state_disk_low") == 1

            # Nothing they accepted waits for the host any more: the disk filled to its last
            # block from outside loses none of it.
            last = fill_from_outside(state, name="last.fill")
            drop_caches()
            await check_all(conn, written)
            first = sessions[0]
            refused = await conn.error(
                "write_file", path="more.txt", content="x" * 100_000, session=first
            )
            assert "state filesystem" in refused and "SANDBOX_MIN_FREE_DISK_MB" in refused
            ran = await conn.ok(
                "execute_code",
                command="/bin/echo more > more.txt; echo $?; cat w.bin | wc -c",
                session=first,
            )
            assert "No space left on device" in "".join(
                e.get("data") or "" for e in ran["output"]
            ), ran
            ran = await conn.ok("execute_code", command="rm f1 && echo gone", session=first)
            assert output(ran) == "gone\n", ran  # (deleting works, and gives blocks back)
            del written[(first, "f1")]
            refused = await conn.error("execute_code", command="true", session=session())
            assert re.search(r"has \d+ MiB free", refused), refused
            for setting in ("SANDBOX_MIN_FREE_DISK_MB", "SANDBOX_WORKSPACE_HEADROOM_MB"):
                assert setting in refused, refused
            assert metric(server, "srt_workspace_damage_total", 'event="detected"') == 0
            assert server.health()["disk"]["damaged_workspaces"] == 0

            last.unlink()
            (state / "outside.fill").unlink()
            # Room for a new session: the floor plus a margin for each mounted workspace and
            # the new one. How much the writers took before the disk stopped them depends on
            # the machine's speed: one session gives its dd files back until that is free.
            wanted = (FLOOR_MB + 4 * HEADROOM_MB + 8) * MIB
            last_session = sessions[-1]
            for key in [k for k in written if k[0] == last_session and k[1] != "w.bin"]:
                if free_bytes(state) >= wanted:
                    break
                await conn.ok("execute_code", command=f"rm {key[1]}", session=last_session)
                del written[key]
                await asyncio.sleep(0.2)  # (the image's discard gives the blocks back)
            await eventually(lambda: free_bytes(state) >= wanted, 10, "room for a new session")
            await eventually(lambda: ready(server)[0] == 200, 10, "/ready once space returns")
            await eventually(
                lambda: not server.health()["disk"]["writes_stopped"], 10, "writes let in again"
            )
            assert metric(server, "srt_state_disk_low") == 0
            ran = await dd(conn, first, "again", 2)
            assert not ran.is_error and ran.structured_content["exit_code"] == 0, ran
            written[(first, "again")] = output(dict(ran.structured_content)).split()[0]
            ran = await conn.ok("execute_code", command="echo fresh", session=session())
            assert output(ran) == "fresh\n"
        server.stop()
        assert not list((state / "workspaces").glob("*.damaged"))
        assert not (state / "workspaces" / ".quarantine").exists()

        server = ServerProcess(workdir, dict(SETTINGS)).start()
        drop_caches()
        async with open_client(server.url, TOKEN, "auto") as conn:
            await check_all(conn, written)
        assert metric(server, "srt_workspace_damage_total", 'event="detected"') == 0
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


def workspace_device(state: Path) -> str:
    """The loop device (loopN) of the one session workspace mounted under `state`."""
    points = [p for p in mounted_under(state / "workspaces") if p.name.startswith("ws-")]
    assert len(points) == 1, points
    dev = os.stat(points[0]).st_dev
    return os.path.basename(os.readlink(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))


async def test_a_workspace_whose_filesystem_fails_says_so_and_is_checked(tmp_path: Path) -> None:
    """A workspace's filesystem that fails (the kernel finds an error in it and makes it
    read-only: ext4's own error path, triggered through its sysfs knob) fails the write_file
    that meets it, never a success; the workspace is marked and checked by e2fsck before it
    is served again; the caller learns how that ended; what was acknowledged before reads
    back identical."""
    state = tmp_path / "state"
    with running_server(tmp_path, **SETTINGS) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            s = session()
            kept = os.urandom(300_000)
            await conn.ok(
                "write_file",
                path="kept.bin",
                content=base64.b64encode(kept).decode(),
                encoding="base64",
                session=s,
            )
            name = workspace_device(state)
            with open(f"/sys/fs/ext4/{name}/trigger_fs_error", "w") as knob:  # noqa: ASYNC230
                knob.write("test: failed under us\n")
            failed = await conn.error(
                "write_file",
                path="lost.bin",
                content=base64.b64encode(os.urandom(1_900_000)).decode(),
                encoding="base64",
                session=s,
            )
            assert "filesystem failed" in failed, failed
            assert metric(server, "srt_workspace_damage_total", 'event="detected"') == 1
            assert server.health()["disk"]["damaged_workspaces"] == 1

            got = await conn.ok("read_file", path="kept.bin", encoding="base64", session=s)
            reset = got.get("session_reset")
            checked = [
                e
                for e in ("clean", "repaired", "quarantined")
                if metric(server, "srt_workspace_damage_total", f'event="{e}"') == 1
            ]
            assert len(checked) == 1, checked
            if checked == ["quarantined"]:
                assert reset and reset["reason"] == "workspace_quarantined", got
            else:
                assert base64.b64decode(got["content"]) == kept
                if checked == ["repaired"]:
                    assert reset and reset["reason"] == "workspace_repaired", got
                else:
                    assert not reset, got
            assert server.health()["disk"]["damaged_workspaces"] == 0
            await conn.ok("write_file", path="after.txt", content="works", session=s)


async def test_an_image_that_will_not_mount_is_set_aside_and_the_session_told(
    tmp_path: Path,
) -> None:
    """A workspace image left unusable (its superblock gone) is not a dead session for ever:
    e2fsck cannot repair it, so it is moved to .quarantine/ for the operator and the session
    starts afresh with session_reset workspace_quarantined."""
    settings = {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_INTERPRETER_WARM": "python=0"}
    s = session()
    with running_server(tmp_path, **settings) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="f.txt", content="one", session=s)
    images = [p for p in (tmp_path / "state" / "workspaces").glob("*.img")]
    assert len(images) == 1, images
    break_superblock(images[0])
    with running_server(tmp_path, **settings) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            got = await conn.ok("write_file", path="g.txt", content="two", session=s)
            assert got.get("session_reset", {}).get("reason") == "workspace_quarantined", got
            listed = await conn.ok("list_files", session=s)
            assert [e["path"] for e in listed["entries"]] == ["g.txt"]
            assert metric(server, "srt_workspace_damage_total", 'event="quarantined"') == 1
    assert len(list((tmp_path / "state" / "workspaces" / ".quarantine").iterdir())) == 1


def used_bytes(state: Path) -> int:
    st = os.statvfs(state)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def image_bytes(state: Path) -> int:
    """What the workspace images take of the state filesystem."""
    return sum(p.stat().st_blocks * 512 for p in (state / "workspaces").glob("*.img"))


async def test_thin_workspaces_cost_what_they_hold(tmp_path: Path) -> None:
    """1 GiB workspaces: two pooled blanks and a warm interpreter's slot cost their metadata
    only, and fifty sessions that each wrote 10 KB take under 10 MB of the state filesystem
    in all (allocated in full, they took 53 GiB)."""
    settings = {
        **SETTINGS,
        "SANDBOX_WORKSPACE_MB": "1024",
        "SANDBOX_WORKSPACE_HEADROOM_MB": "64",
        "SANDBOX_MIN_FREE_DISK_MB": "64",
        "SANDBOX_WORKSPACE_POOL": "2",
        "SANDBOX_INTERPRETER_WARM": "python=1",
    }
    with state_filesystem(tmp_path, 6 * 1024) as work:
        state = work / "state"
        before = used_bytes(state)
        with running_server(work, **settings) as server:

            def mounted(kind: str) -> int:
                return int(metric(server, "srt_workspaces_mounted{", f'kind="{kind}"'))

            await eventually(
                lambda: mounted("blank") == 2 and mounted("slot") == 1, 60, "blanks, warm slot"
            )
            idle_images, idle_used = image_bytes(state), used_bytes(state) - before
            print(f"blanks and warm slot: images {idle_images} B, state fs {idle_used} B")
            assert idle_images < 3 * 160 * 1024, idle_images  # (about 60 KiB each)
            assert idle_used < 4 * MIB, idle_used

            async with open_client(server.url, TOKEN, "auto") as conn:
                names = [session() for _ in range(50)]
                for batch in range(0, len(names), 10):
                    await asyncio.gather(
                        *(
                            conn.ok("write_file", path="f.bin", content="x" * 10_000, session=s)
                            for s in names[batch : batch + 10]
                        )
                    )
                got = await conn.ok("read_file", path="f.bin", session=names[-1])
                assert got["content"] == "x" * 10_000
            images, used = image_bytes(state), used_bytes(state) - before
            print(f"50 sessions of 10 KB: images {images} B, state fs {used} B")
            assert used < 50 * 200 * 1024, used  # (about 110 KiB each)
            assert images < 50 * 160 * 1024, images


def test_a_workspace_images_metadata_is_where_dumpe2fs_says(tmp_path: Path) -> None:
    """The ranges the watchdog allocates when it stops a workspace (its metadata: bitmaps,
    inode tables, journal) are read right from the image (checked against dumpe2fs and
    debugfs), and a new thin 1 GiB image costs the host under 64 KiB (52 KiB measured; the
    64 KiB mkfs zeroes at its end given back)."""
    from sandbox_runtime.workspaces.diskspace import punch_unwritten
    from sandbox_runtime.workspaces.ext4meta import metadata_bytes, metadata_ranges
    from sandbox_runtime.workspaces.images import mkfs_argv

    image = tmp_path / "ws.img"
    with open(image, "wb") as f:
        f.truncate(1024 * MIB)
    subprocess.run(mkfs_argv(image, 65536, (0, 0)), check=True)
    assert punch_unwritten(image) == 64 * 1024
    assert image.stat().st_blocks * 512 < 64 * 1024
    assert subprocess.run(["e2fsck", "-fn", str(image)], capture_output=True).returncode == 0
    blocks: set[int] = set()
    for offset, length in metadata_ranges(image):
        blocks.update(range(offset // 4096, (offset + length) // 4096))
    dump = subprocess.run(["dumpe2fs", str(image)], capture_output=True, text=True).stdout
    for start, end in re.findall(r"Inode table at (\d+)-(\d+)", dump):
        assert set(range(int(start), int(end) + 1)) <= blocks
    for at in re.findall(r"(?:Block|Inode) bitmap at (\d+)", dump):
        assert int(at) in blocks
    journal = subprocess.run(
        ["debugfs", "-R", "stat <8>", str(image)], capture_output=True, text=True
    ).stdout
    first, last = re.search(r"\(0-\d+\):(\d+)-(\d+)", journal).groups()  # type: ignore[union-attr]
    assert set(range(int(first), int(last) + 1)) <= blocks
    assert len(blocks) * 4096 <= metadata_bytes(1024, 65536)


async def test_a_workspace_allocated_before_gives_its_free_space_back(tmp_path: Path) -> None:
    """An image allocated in full under SANDBOX_WORKSPACE_RESERVE=allocate is trimmed to what
    it holds when a thin server mounts it; its files are kept."""
    settings = {**SETTINGS, "SANDBOX_WORKSPACE_MB": "64"}
    s = session()
    with running_server(tmp_path, **settings, SANDBOX_WORKSPACE_RESERVE="allocate") as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            await conn.ok("write_file", path="kept.txt", content="kept", session=s)
    (image,) = (tmp_path / "state" / "workspaces").glob("ws-*.img")
    assert image.stat().st_blocks * 512 >= 64 * MIB
    with running_server(tmp_path, **settings) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            got = await conn.ok("read_file", path="kept.txt", session=s)
            assert got["content"] == "kept"
            assert image.stat().st_blocks * 512 < 8 * MIB


async def test_an_unmounted_idle_workspace_gives_back_its_journal(tmp_path: Path) -> None:
    """A workspace pushed out by the mount cap (unmounted, idle) keeps its files and costs
    what it holds: its journal, written by each fsync'd file (up to 4 MiB), is given back."""
    settings = {**SETTINGS, "SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL": "1"}
    first, other = session(), session()
    with running_server(tmp_path, **settings) as server:
        async with open_client(server.url, TOKEN, "auto") as conn:
            for i in range(40):
                await conn.ok("write_file", path=f"f{i}", content="x" * 4000, session=first)
            (image,) = (tmp_path / "state" / "workspaces").glob("ws-*.img")
            mounted = image.stat().st_blocks * 512
            await conn.ok("write_file", path="g", content="y", session=other)  # (pushes it out)
            idle = image.stat().st_blocks * 512
            print(f"image while mounted {mounted} B, unmounted {idle} B")
            assert idle < mounted - 400 * 1024, (mounted, idle)
            got = await conn.ok("read_file", path="f39", session=first)
            assert got["content"] == "x" * 4000
    argv = ["e2fsck", "-fn", str(image)]
    check = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
