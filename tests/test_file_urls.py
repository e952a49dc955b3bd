"""Signed file URLs (create_file_url + plain HTTP on /files/{token}/{name}): real servers, the
official MCP client for the tools, curl and httpx2 for the transfers, nginx and three replicas
for forwarding to a session's home."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx2
import pytest
from mcp_harness import (
    CLUSTER_SECRET,
    Conn,
    ServerProcess,
    Servers,
    eventually,
    memory_of,
    open_client,
)
from topology_harness import TOKEN as TOPOLOGY_TOKEN
from topology_harness import Topology, running_topology

from sandbox_runtime.sessions.signing import ClusterSigner

pytestmark = pytest.mark.e2e

TOKEN = "file-urls-token-0123456789"
MiB = 1024 * 1024
BIG_MB = 200
UPLOAD_LIMIT_MB = 256
RSS_GROWTH_LIMIT_MB = 40
TOPOLOGY_MB = 64  # each replica's workspace size (and upload limit)


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    """Room for the 200 MB transfers; uploads capped below the workspace's size."""
    return serve(
        "urls",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_WORKSPACE_MB="512",
        SANDBOX_MAX_UPLOAD_MB=str(UPLOAD_LIMIT_MB),
    )


@pytest.fixture(scope="module")
def small(serve: Servers) -> ServerProcess:
    """A 32 MiB workspace quota with uploads allowed past it (else 413 would come first)."""
    return serve(
        "urls-small",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_WORKSPACE_MB="32",
        SANDBOX_MAX_UPLOAD_MB="64",
    )


# -- helpers ----------------------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def http() -> httpx2.AsyncClient:
    return httpx2.AsyncClient(trust_env=False, timeout=30.0)


async def file_url(conn: Conn, session: str, path: str, method: str = "GET", **more: Any) -> str:
    made = await conn.ok("create_file_url", path=path, method=method, session=session, **more)
    assert made["method"] == method and made["expires_at"] > time.time() - 1
    return str(made["url"])


async def sandbox(conn: Conn, session: str, command: str) -> str:
    """Run `command` in the session's sandbox; its stdout (exit code 0 asserted)."""
    result = await conn.ok("execute_code", command=command, session=session)
    assert result["exit_code"] == 0, result
    return "".join(e.get("data") or "" for e in result["output"] if e["type"] == "stdout")


async def only(conn: Conn, session: str, names: list[str]) -> bool:
    """Whether the workspace holds just `names` as the sandbox sees it, hidden files too."""
    return (await sandbox(conn, session, "ls -A")).split() == names


async def uploading(conn: Conn, session: str) -> bool:
    """Whether an upload's file (beside its target, hidden from list_files) is there."""
    names = (await sandbox(conn, session, "ls -A")).split()
    return any(n.startswith(".srt-upload-") for n in names)


async def write_bytes(conn: Conn, session: str, path: str, data: bytes) -> None:
    content = base64.b64encode(data).decode()
    await conn.ok("write_file", path=path, content=content, encoding="base64", session=session)


def parts_of(url: str) -> tuple[str, str, str]:
    """(scheme://host:port, token, quoted name) of a file URL."""
    split = urlsplit(url)
    empty, files, token, name = split.path.split("/", 3)
    assert empty == "" and files == "files" and "/" not in name, url
    return f"{split.scheme}://{split.netloc}", token, name


def with_token(url: str, token: str) -> str:
    base, _, name = parts_of(url)
    return f"{base}/files/{token}/{name}"


def with_name(url: str, name: str) -> str:
    base, token, _ = parts_of(url)
    return f"{base}/files/{token}/{quote(name, safe='')}"


def with_base(url: str, base: str) -> str:
    _, token, name = parts_of(url)
    return f"{base}/files/{token}/{name}"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def payload_of(url: str) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads(unb64(parts_of(url)[1].split(".")[0]))
    return payload


def re_encoded(url: str, **changes: Any) -> str:
    """The URL with its token's payload changed and re-encoded as the server encodes it, the
    MAC kept: what someone without the key can do to a URL they hold."""
    payload = {**payload_of(url), **changes}
    encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode()
    mac = parts_of(url)[1].split(".")[1]
    return with_token(url, f"{b64(encoded)}.{mac}")


def flipped(text: str, index: int) -> str:
    """`text` with the base64url character at `index` changed (a middle one: all 6 bits of it
    are significant, so the decoded bytes change)."""
    new = "B" if text[index] == "A" else "A"
    return text[:index] + new + text[index + 1 :]


def curl(*args: str, out: Path | str = os.devnull, timeout: float = 60.0) -> int:
    """curl with `args`, the body to `out`; the HTTP status (0: no answer)."""
    done = subprocess.run(
        ["curl", "-sS", "--noproxy", "*", "-o", str(out), "-w", "%{http_code}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    status = int(done.stdout.strip() or "0")
    assert status, f"curl {args} got no answer: {done.stderr}"
    return status


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


def make_file(path: Path, size_mb: int) -> str:
    """A file of random bytes written a MiB at a time; its sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(size_mb):
            chunk = os.urandom(MiB)
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


def rss_bytes(pid: int) -> int:
    return memory_of(pid)["VmRSS"]


class RssWatch:
    """The peak resident memory of a process while the block runs, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes(self.pid))
            self.samples += 1
            if self._stop.wait(0.05):
                return

    def __enter__(self) -> RssWatch:
        self.before = self.peak = rss_bytes(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.before) / MiB


async def head_then_range(url: str) -> tuple[bytes, bytes]:
    """A HEAD and a `Range: bytes=0-0` GET pipelined on one connection: the HEAD's whole
    answer, and the first line after it (had the HEAD sent a body, this would be body bytes,
    not the GET's status line)."""
    split = urlsplit(url)
    reader, writer = await asyncio.open_connection(split.hostname, split.port)
    try:
        host = split.netloc.encode()
        writer.write(
            b"HEAD " + split.path.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\n\r\n"
            b"GET " + split.path.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\n"
            b"Range: bytes=0-0\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        following = await asyncio.wait_for(reader.readline(), 10)
        return head, following
    finally:
        writer.close()


async def raw_put(url: str, length: int) -> bytes:
    """The status line of the answer to a PUT declaring `length` bytes and sending none."""
    async with partial_put(url, length, b"") as reader:
        return await asyncio.wait_for(reader.readline(), 10)


@contextlib.asynccontextmanager
async def partial_put(url: str, length: int, body: bytes) -> AsyncIterator[asyncio.StreamReader]:
    """A PUT declaring `length` bytes that has sent `body` so far; the connection is cut at
    the end of the block."""
    split = urlsplit(url)
    reader, writer = await asyncio.open_connection(split.hostname, split.port)
    try:
        writer.write(
            f"PUT {split.path} HTTP/1.1\r\nHost: {split.netloc}\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
        )
        writer.write(body)
        await writer.drain()
        yield reader
    finally:
        writer.close()


async def log_showing(server: ServerProcess, lines: list[str]) -> str:
    """The server's log once it shows every one of `lines` (10 s at most)."""

    def found() -> str | None:
        text = server.stderr_text()
        return text if all(line in text for line in lines) else None

    return str(await eventually(found, 10, f"the log lines {lines}"))


def header_of(block: bytes, name: str) -> str | None:
    for line in block.decode("latin-1").split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name:
            return value.strip()
    return None


# -- round trips ------------------------------------------------------------------------------


async def test_text_and_binary_round_trip_through_urls(server: ServerProcess) -> None:
    session = unique("rt")
    text = "héllo wörld\nsecond line\n".encode()
    blob = os.urandom(3 * MiB) + bytes(range(256))
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        for path, data in (("notes/hello.txt", text), ("bin/blob.dat", blob)):
            put = await file_url(conn, session, path, "PUT")
            assert put.startswith(f"{server.base_url}/files/"), (
                put
            )  # the Host the tool was called on
            uploaded = await client.put(put, content=data)
            assert uploaded.status_code == 201, uploaded.text
            assert uploaded.json() == {"path": path, "size": len(data)}
            get = await file_url(conn, session, path)
            downloaded = await client.get(get)
            assert downloaded.status_code == 200, downloaded.text
            assert downloaded.content == data
            assert downloaded.headers["content-length"] == str(len(data))
        # What the URLs wrote is what the tools and the sandbox see, and the other way round.
        read = await conn.ok("read_file", path="notes/hello.txt", session=session)
        assert read["content"] == text.decode() and read["size"] == len(text)
        listed = await sandbox(conn, session, "sha256sum bin/blob.dat; printf made > out.bin")
        assert listed.split()[0] == hashlib.sha256(blob).hexdigest()
        made = await client.get(await file_url(conn, session, "out.bin"))
        assert made.status_code == 200 and made.content == b"made"
        # A PUT URL replaces an existing file.
        again = await client.put(await file_url(conn, session, "out.bin", "PUT"), content=b"new")
        assert again.status_code == 201
        assert (await conn.ok("read_file", path="out.bin", session=session))["content"] == "new"


async def test_head_and_ranges(server: ServerProcess) -> None:
    session = unique("range")
    data = bytes(range(100))
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        await write_bytes(conn, session, "r.bin", data)
        url = await file_url(conn, session, "r.bin")
        head = await client.head(url)
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == "100"
        assert head.headers["accept-ranges"] == "bytes"
        raw_head, following = await head_then_range(url)
        assert (
            raw_head.startswith(b"HTTP/1.1 200") and header_of(raw_head, "content-length") == "100"
        )
        assert following.startswith(b"HTTP/1.1 206"), (raw_head, following)  # no HEAD body
        cases = {
            "bytes=0-9": (data[:10], "bytes 0-9/100"),
            "bytes=-5": (data[-5:], "bytes 95-99/100"),
            "bytes=10-": (data[10:], "bytes 10-99/100"),
            "bytes=90-1000": (data[90:], "bytes 90-99/100"),
            "bytes=42-42": (data[42:43], "bytes 42-42/100"),
        }
        for wanted, (body, content_range) in cases.items():
            got = await client.get(url, headers={"Range": wanted})
            assert got.status_code == 206, (wanted, got.status_code, got.text)
            assert got.content == body, wanted
            assert got.headers["content-range"] == content_range, wanted
            assert got.headers["content-length"] == str(len(body)), wanted
        for unsatisfiable in ("bytes=100-", "bytes=500-600", "bytes=-0"):
            got = await client.get(url, headers={"Range": unsatisfiable})
            assert got.status_code == 416, (unsatisfiable, got.status_code)
            assert got.headers["content-range"] == "bytes */100", unsatisfiable
        whole = await client.get(url, headers={"Range": "bytes=0-"})
        assert whole.status_code == 200 and whole.content == data  # the whole file: plain 200
        etag = whole.headers["etag"]
        unchanged = await client.get(url, headers={"If-None-Match": etag})
        assert unchanged.status_code == 304 and unchanged.content == b""


async def test_downloads_are_inert_attachments(server: ServerProcess) -> None:
    session = unique("inert")
    page = "<html><script>alert(document.cookie)</script></html>"
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        await sandbox(
            conn,
            session,
            f"printf '%s' '{page}' > page.html; printf '<svg onload=alert(1)/>' > pic.svg; "
            "printf 'plain' > readme.txt",
        )
        for name, body in (("page.html", page.encode()), ("pic.svg", b"<svg onload=alert(1)/>")):
            got = await client.get(await file_url(conn, session, name))
            assert got.status_code == 200 and got.content == body, name
            assert got.headers["content-type"] == "application/octet-stream", name
            assert got.headers["content-disposition"].startswith("attachment;"), name
            assert f'filename="{name}"' in got.headers["content-disposition"], name
            assert got.headers["x-content-type-options"] == "nosniff", name
            assert "sandbox" in got.headers["content-security-policy"], name
        plain = await client.get(await file_url(conn, session, "readme.txt"))
        assert plain.headers["content-type"].startswith("text/plain")
        assert plain.headers["content-disposition"].startswith("attachment;")
        assert "sandbox" in plain.headers["content-security-policy"]


async def test_200_mb_each_way_with_flat_server_memory(
    server: ServerProcess, tmp_path: Path
) -> None:
    session = unique("big")
    source, back = tmp_path / "source.bin", tmp_path / "back.bin"
    digest = await asyncio.to_thread(make_file, source, BIG_MB)
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("write_file", path="warm.txt", content="x", session=session)  # mounted
        put = await file_url(conn, session, "big.bin", "PUT")
        with RssWatch(server.pid) as upload:
            status = await asyncio.to_thread(curl, "-T", str(source), put)
        assert status == 201
        assert upload.samples >= 3, "the upload was too quick to sample"
        assert upload.growth_mb < RSS_GROWTH_LIMIT_MB, (
            f"the server's RSS grew {upload.growth_mb:.0f} MB during a {BIG_MB} MB upload"
        )
        assert (await sandbox(conn, session, "sha256sum big.bin")).split()[0] == digest
        get = await file_url(conn, session, "big.bin")
        with RssWatch(server.pid) as download:
            status = await asyncio.to_thread(curl, get, out=back)
        assert status == 200
        assert download.samples >= 3, "the download was too quick to sample"
        assert download.growth_mb < RSS_GROWTH_LIMIT_MB, (
            f"the server's RSS grew {download.growth_mb:.0f} MB during a {BIG_MB} MB download"
        )
        assert back.stat().st_size == BIG_MB * MiB
        assert await asyncio.to_thread(sha256_of, back) == digest
        await conn.ok("delete_file", path="big.bin", session=session)


# -- refusals ---------------------------------------------------------------------------------


async def test_an_expired_url_is_refused(server: ServerProcess) -> None:
    session = unique("exp")
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        await conn.ok("write_file", path="e.txt", content="soon gone", session=session)
        made = await conn.ok("create_file_url", path="e.txt", expires_in_seconds=1, session=session)
        expires_at = made["expires_at"]
        assert time.time() <= expires_at <= time.time() + 2  # (rounded up to a second)
        answers: list[tuple[float, int, str]] = []

        async def refused() -> bool:
            got = await client.get(made["url"])
            answers.append((time.time(), got.status_code, got.text))
            return got.status_code == 403

        await eventually(refused, 10, "the URL to expire", interval=0.05)
        at, _, text = answers[-1]
        assert "expired" in text
        assert at >= expires_at - 0.05, "refused before its expiry"
        for when, status, body in answers[:-1]:
            assert status == 200 and body == "soon gone", (when, status, body)
            assert when < expires_at + 0.5, "still served after its expiry"
        # A fresh URL for the same file works: the refusal was the expiry.
        fresh = await client.get(await file_url(conn, session, "e.txt"))
        assert fresh.status_code == 200 and fresh.text == "soon gone"


async def test_a_tampered_token_is_refused(server: ServerProcess) -> None:
    session = unique("tamper")
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        await conn.ok("write_file", path="t.txt", content="the real thing", session=session)
        url = await file_url(conn, session, "t.txt")
        _, token, _ = parts_of(url)
        payload, mac = token.split(".")
        forgeries = {
            "payload flipped": f"{flipped(payload, len(payload) // 2)}.{mac}",
            "payload's first char flipped": f"{flipped(payload, 0)}.{mac}",
            "mac flipped": f"{payload}.{flipped(mac, len(mac) // 2)}",
            "mac truncated": f"{payload}.{mac[:-4]}",
            "mac missing": f"{payload}.",
            "no mac": payload,
            "two dots": f"{payload}.{mac}.{mac}",
            "not base64": f"{payload}.!!!!",
        }
        for what, forged in forgeries.items():
            got = await client.get(with_token(url, forged))
            assert got.status_code == 403, (what, got.status_code, got.text)
            assert "the real thing" not in got.text, what
        genuine = await client.get(url)
        assert genuine.status_code == 200 and genuine.text == "the real thing"


async def test_a_url_names_one_file(server: ServerProcess) -> None:
    session = unique("path")
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        await conn.ok("write_file", path="dir/a.txt", content="file a", session=session)
        await conn.ok("write_file", path="dir/b.txt", content="file b", session=session)
        url = await file_url(conn, session, "dir/a.txt")
        assert parts_of(url)[2] == "a.txt" and payload_of(url)["f"] == "dir/a.txt"
        other_name = await client.get(with_name(url, "b.txt"))
        assert other_name.status_code == 404 and "file b" not in other_name.text
        for path in ("dir/b.txt", "b.txt", "/workspace/dir/b.txt"):
            forged = re_encoded(with_name(url, "b.txt"), f=path)
            got = await client.get(forged)
            assert got.status_code == 403, (path, got.status_code, got.text)
            assert "file b" not in got.text
        assert (await client.get(url)).text == "file a"
        # A PUT URL's path cannot be moved either: nothing is written at the other path.
        put = await file_url(conn, session, "dir/a.txt", "PUT")
        moved = await client.put(re_encoded(with_name(put, "b.txt"), f="dir/b.txt"), content=b"x")
        assert moved.status_code == 403
        assert (await conn.ok("read_file", path="dir/b.txt", session=session))[
            "content"
        ] == "file b"


async def test_a_url_is_for_its_method_only(server: ServerProcess) -> None:
    session = unique("method")
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        await conn.ok("write_file", path="m.txt", content="original", session=session)
        get = await file_url(conn, session, "m.txt")
        put = await file_url(conn, session, "m.txt", "PUT")
        as_put = await client.put(get, content=b"overwritten")
        assert as_put.status_code == 403 and "GET" in as_put.text
        for method in ("GET", "HEAD"):
            answer = await client.request(method, put)
            assert answer.status_code == 403, (method, answer.status_code)
        for method in ("DELETE", "POST", "PATCH"):
            answer = await client.request(method, get)
            assert answer.status_code == 405, (method, answer.status_code)
            assert answer.headers["allow"] == "GET, HEAD, PUT"
        forged = await client.put(re_encoded(get, m="PUT"), content=b"overwritten")
        assert forged.status_code == 403
        assert (await conn.ok("read_file", path="m.txt", session=session))["content"] == "original"
        assert (await client.get(get)).text == "original"


async def test_a_url_cannot_be_turned_into_another_sessions(server: ServerProcess) -> None:
    mine, theirs = unique("mine"), unique("theirs")
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        await conn.ok("write_file", path="secret.txt", content="my own", session=mine)
        await conn.ok("write_file", path="secret.txt", content="THEIR SECRET", session=theirs)
        my_get = await file_url(conn, mine, "secret.txt")
        my_put = await file_url(conn, mine, "secret.txt", "PUT")
        their_get = await file_url(conn, theirs, "secret.txt")
        theirs_payload = payload_of(their_get)
        assert payload_of(my_get)["s"] != theirs_payload["s"]
        for url, method in ((my_get, "GET"), (my_put, "PUT")):
            for changes in (
                {"s": theirs_payload["s"]},
                {"s": theirs_payload["s"], "p": theirs_payload["p"]},
                {"p": "someone-else"},
            ):
                forged = re_encoded(url, **changes)
                got = await client.request(
                    method, forged, content=b"x" if method == "PUT" else None
                )
                assert got.status_code == 403, (method, changes, got.status_code, got.text)
                assert "THEIR SECRET" not in got.text
        assert (await client.get(their_get)).text == "THEIR SECRET"
        assert (await client.get(my_get)).text == "my own"


async def test_tokens_stay_out_of_the_server_log(server: ServerProcess) -> None:
    session = unique("log")
    got_name, put_name = f"{session}.txt", f"{session}-put.txt"
    async with open_client(server.url, TOKEN, "auto") as conn, http() as client:
        await conn.ok("write_file", path=got_name, content="x", session=session)
        url = await file_url(conn, session, got_name)
        put = await file_url(conn, session, put_name, "PUT")
        forged = flipped(parts_of(url)[1], 5)
        assert (await client.get(url)).status_code == 200
        assert (await client.put(put, content=b"y")).status_code == 201
        assert (await client.head(with_token(url, forged))).status_code == 403
    log = await log_showing(
        server,
        [
            f'"GET /files/<token>/{got_name} HTTP/1.1" 200',
            f'"PUT /files/<token>/{put_name} HTTP/1.1" 201',
            f'"HEAD /files/<token>/{got_name} HTTP/1.1" 403',
        ],
    )
    for token in (parts_of(url)[1], parts_of(put)[1], forged):
        payload, mac = token.split(".")
        assert payload not in log and mac not in log, "a file URL's token reached the log"


async def test_a_credential_in_a_query_string_stays_out_of_the_server_log(
    server: ServerProcess,
) -> None:
    """A client that puts its token in the URL (`/mcp?token=...`, `?api_key=`): the access log
    keeps the parameter's name, never its value."""
    secret = f"query-secret-{unique('q')}"
    async with http() as client:
        for path in (f"/mcp?token={secret}", f"/health?api_key={secret}&x=1"):
            await client.get(server.url.removesuffix("/mcp") + path)
    log = await log_showing(
        server, ['"GET /mcp?token=<redacted> HTTP/1.1"', "/health?api_key=<redacted>&x=<redacted>"]
    )
    assert secret not in log, "a credential in a query string reached the log"


async def test_an_upload_over_the_limit_gets_413(server: ServerProcess) -> None:
    session = unique("limit")
    async with open_client(server.url, TOKEN, "auto") as conn:
        await conn.ok("write_file", path="keep.txt", content="kept", session=session)
        put = await file_url(conn, session, "huge.bin", "PUT")
        # Declared too big: refused before a byte of the body is sent.
        status = await raw_put(put, (UPLOAD_LIMIT_MB + 1) * MiB)
        assert status.startswith(b"HTTP/1.1 413"), status
        # Chunked, no length: refused once the body passes the limit.
        script = f"head -c {(UPLOAD_LIMIT_MB + 8) * MiB} /dev/zero | curl -sS --noproxy '*' "
        script += f"-o /dev/null -w '%{{http_code}}' -H 'Transfer-Encoding: chunked' -T - '{put}'"
        done = await asyncio.to_thread(
            subprocess.run, ["bash", "-c", script], capture_output=True, text=True, timeout=60
        )
        assert done.stdout.strip() == "413", (done.stdout, done.stderr)
        listing = await conn.ok("list_files", session=session)
        assert [e["path"] for e in listing["entries"]] == ["keep.txt"]
        assert listing["usage"]["bytes_used"] < 8 * MiB, "the refused upload's bytes stayed"
        assert await only(conn, session, ["keep.txt"]), "the refused upload left a file"


async def test_an_upload_past_the_quota_gets_507_and_leaves_the_old_file(
    small: ServerProcess, tmp_path: Path
) -> None:
    session = unique("quota")
    original = os.urandom(MiB)
    large = tmp_path / "large.bin"
    await asyncio.to_thread(make_file, large, 48)
    async with open_client(small.url, TOKEN, "auto") as conn:
        await write_bytes(conn, session, "data.bin", original)
        put = await file_url(conn, session, "data.bin", "PUT")
        get = await file_url(conn, session, "data.bin")
        before = (await conn.ok("list_files", session=session))["usage"]["bytes_used"]
        # With a Content-Length the quota refuses it up front; without, at the first write
        # past the quota (ENOSPC), the partial file then removed.
        chunked = ["-H", "Transfer-Encoding: chunked"]
        for how, extra in (("declared", []), ("chunked", chunked)):
            status = await asyncio.to_thread(curl, *extra, "-T", str(large), put)
            assert status == 507, (how, status)
            back = tmp_path / f"back-{how}.bin"
            assert await asyncio.to_thread(curl, get, out=back) == 200
            assert back.read_bytes() == original, f"{how}: the previous file changed"
            listing = await conn.ok("list_files", session=session)
            assert [e["path"] for e in listing["entries"]] == ["data.bin"], how
            assert listing["usage"]["bytes_used"] <= before + MiB, f"{how}: space not given back"
            assert await only(conn, session, ["data.bin"]), f"{how}: the upload left a file"
        # The workspace still takes an upload that fits.
        fits = tmp_path / "fits.bin"
        digest = await asyncio.to_thread(make_file, fits, 8)
        assert await asyncio.to_thread(curl, "-T", str(fits), put) == 201
        assert (await sandbox(conn, session, "sha256sum data.bin")).split()[0] == digest


async def cut_off_upload_leaves_nothing(conn: Conn, session: str, put: str) -> None:
    """Cut a PUT to `put` off after 4 of its 8 MiB: its bytes and file go away (the
    session's workspace holds data.bin only)."""
    before = (await conn.ok("list_files", session=session))["usage"]["bytes_used"]
    async with partial_put(put, 8 * MiB, os.urandom(4 * MiB)):
        await eventually(lambda: uploading(conn, session), 15, "the upload to reach the workspace")
        listing = await conn.ok("list_files", session=session)
        assert [e["path"] for e in listing["entries"]] == ["data.bin"]  # (never listed)

    async def cleaned() -> bool:
        usage = (await conn.ok("list_files", session=session))["usage"]["bytes_used"]
        return usage <= before + 64 * 1024 and await only(conn, session, ["data.bin"])

    await eventually(cleaned, 15, "the cut-off upload to be removed")


async def test_a_cut_off_upload_leaves_nothing(small: ServerProcess) -> None:
    session = unique("cut")
    async with open_client(small.url, TOKEN, "auto") as conn, http() as client:
        await conn.ok("write_file", path="data.bin", content="before", session=session)
        await cut_off_upload_leaves_nothing(
            conn, session, await file_url(conn, session, "data.bin", "PUT")
        )
        got = await client.get(await file_url(conn, session, "data.bin"))
        assert got.status_code == 200 and got.text == "before"


# -- through nginx, from replicas that are not the session's home ----------------------------


def cluster_address(topology: Topology, rid: str) -> str:
    beat = json.loads(topology.redis.cli_raw("get", f"replica:{rid}"))
    return str(beat["cluster_address"])


def incarnation_of(topology: Topology, rid: str) -> str:
    """The process replica `rid` runs as now (its heartbeat's): proofs for it name it."""
    return str(json.loads(topology.redis.cli_raw("get", f"replica:{rid}"))["incarnation"])


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    with running_topology(
        tmp_path_factory.mktemp("urls-topology"), SANDBOX_WORKSPACE_MB=str(TOPOLOGY_MB)
    ) as topology:
        yield topology


async def test_urls_work_from_any_replica_and_through_nginx(topology: Topology) -> None:
    home, other, third = list(topology.replicas)
    session = unique("fwd")
    nginx = f"http://127.0.0.1:{topology.nginx.port}"
    name = f"{session}.bin"  # (the access logs show file names: this test's own)
    first, second = os.urandom(2 * MiB + 7), os.urandom(MiB + 3)
    async with open_client(topology.replicas[home].url, TOPOLOGY_TOKEN, "auto") as on_home:
        await on_home.ok("write_file", path="start.txt", content="here", session=session)
    assert topology.home_of("default", session) == home
    async with (
        open_client(topology.session_url(session), TOPOLOGY_TOKEN, "auto") as conn,
        http() as client,
    ):
        put = await file_url(conn, session, f"up/{name}", "PUT")
        assert put.startswith(f"{nginx}/files/"), put  # the host the client called
        direct = topology.replicas[other].base_url
        # PUT on a replica that is not the home, GET through nginx and from the third replica.
        uploaded = await client.put(with_base(put, direct), content=first)
        assert uploaded.status_code == 201, uploaded.text
        assert uploaded.json() == {"path": f"up/{name}", "size": len(first)}
        get = await file_url(conn, session, f"up/{name}")
        assert get.startswith(f"{nginx}/files/"), get
        for base in (nginx, direct, topology.replicas[third].base_url):
            got = await client.get(with_base(get, base))
            assert got.status_code == 200 and got.content == first, base
            assert got.headers["content-disposition"].startswith("attachment;"), base
            assert got.headers["x-content-type-options"] == "nosniff", base
            assert "sandbox" in got.headers["content-security-policy"], base
        # PUT through nginx, read back from the non-home replica: ranges and HEAD forwarded.
        assert (await client.put(put, content=second)).status_code == 201
        remote = with_base(get, direct)
        assert (await client.get(remote)).content == second
        part = await client.get(remote, headers={"Range": "bytes=-5"})
        assert part.status_code == 206 and part.content == second[-5:]
        assert (
            part.headers["content-range"]
            == f"bytes {len(second) - 5}-{len(second) - 1}/{len(second)}"
        )
        head = await client.head(remote)
        assert head.status_code == 200 and head.headers["content-length"] == str(len(second))
        beyond = await client.get(remote, headers={"Range": f"bytes={len(second)}-"})
        assert beyond.status_code == 416
        assert beyond.headers["content-range"] == f"bytes */{len(second)}"
        # Refusals on the non-home replica too.
        assert (await client.put(remote, content=b"x")).status_code == 403
        tampered = with_token(remote, flipped(parts_of(remote)[1], 3))
        assert (await client.get(tampered)).status_code == 403
        # The file is on the home only, and the sandbox there sees it.
        digest = (await sandbox(conn, session, f"sha256sum up/{name}")).split()[0]
        assert digest == hashlib.sha256(second).hexdigest()
        assert topology.home_of("default", session) == home
    # The non-home replica served the transfers itself (forwarding to the home over the
    # cluster listener), and the home got them there.
    lines = {
        other: [
            f'"PUT /files/<token>/{name} HTTP/1.1" 201',
            f'"GET /files/<token>/{name} HTTP/1.1" 206',
        ],
        home: [
            f'"PUT /cluster/v1/files/<token>/{name} HTTP/1.1" 201',
            f'"GET /cluster/v1/files/<token>/{name} HTTP/1.1" 206',
        ],
    }
    for rid, wanted in lines.items():
        log = await log_showing(topology.replicas[rid], wanted)
        assert parts_of(get)[1].split(".")[1] not in log, "a file URL's token reached the log"


async def test_odd_file_names_survive_forwarding(topology: Topology) -> None:
    home, other, _ = list(topology.replicas)
    session = unique("odd")
    data = b"odd name\n"
    nginx = f"http://127.0.0.1:{topology.nginx.port}"
    names = ["sp ace.txt", "per%20cent.txt", "q?uery#frag.txt", "ünï çødé.txt", "semi;colon+plus"]
    async with open_client(topology.replicas[home].url, TOPOLOGY_TOKEN, "auto") as conn:
        async with http() as client:
            for name in names:
                await write_bytes(conn, session, f"odd/{name}", data)
                get = await file_url(conn, session, f"odd/{name}")
                assert get.startswith(f"{topology.replicas[home].base_url}/files/"), get
                local = await client.get(get)
                assert local.status_code == 200 and local.content == data, (name, local.text)
                for base in (topology.replicas[other].base_url, nginx):
                    forwarded = await client.get(with_base(get, base))
                    assert forwarded.status_code == 200, (name, base, forwarded.text)
                    assert forwarded.content == data, (name, base)
                    quoted = quote(name, safe="")
                    assert f"filename*=UTF-8''{quoted}" in forwarded.headers["content-disposition"]
                put = await file_url(conn, session, f"odd/{name}", "PUT")
                moved = await client.put(
                    with_base(put, topology.replicas[other].base_url), content=b"new\n"
                )
                assert moved.status_code == 201, (name, moved.status_code, moved.text)
                read = await conn.ok("read_file", path=f"odd/{name}", session=session)
                assert read["content"] == "new\n", name


async def test_the_cluster_file_path_needs_a_peer_signature(topology: Topology) -> None:
    home, other, _ = list(topology.replicas)
    session = unique("peer")
    async with (
        open_client(topology.replicas[home].url, TOPOLOGY_TOKEN, "auto") as conn,
        http() as client,
    ):
        await conn.ok("write_file", path="c.txt", content="cluster", session=session)
        get = await file_url(conn, session, "c.txt")
        put = await file_url(conn, session, "c.txt", "PUT")
        _, token, name = parts_of(get)
        path = f"/cluster/v1/files/{token}/{name}"
        address = cluster_address(topology, home)
        inc = incarnation_of(topology, home)
        wrong_secret = ClusterSigner("a-different-secret-0123456789", "x")
        for headers in (
            {},
            {"x-srt-cluster-signature": "v1,1,abc,def"},
            {"x-srt-cluster-signature": wrong_secret.sign_call(home, inc, "GET", path, None)},
            # Signed right, but for another replica, or another method.
            {
                "x-srt-cluster-signature": ClusterSigner(CLUSTER_SECRET, "x").sign_call(
                    other, inc, "GET", path, None
                )
            },
            {
                "x-srt-cluster-signature": ClusterSigner(CLUSTER_SECRET, "x").sign_call(
                    home, inc, "PUT", path, None
                )
            },
        ):
            refused = await client.get(f"http://{address}{path}", headers=headers)
            assert refused.status_code == 403, (headers, refused.status_code)
            assert "cluster" not in refused.text
        put_path = f"/cluster/v1/files/{parts_of(put)[1]}/{name}"
        unsigned_put = await client.put(f"http://{address}{put_path}", content=b"intruder")
        assert unsigned_put.status_code == 403
        # The same request signed by a peer is served: the refusals were the signature's.
        signed = ClusterSigner(CLUSTER_SECRET, "x").sign_call(home, inc, "GET", path, None)
        served = await client.get(
            f"http://{address}{path}", headers={"x-srt-cluster-signature": signed}
        )
        assert served.status_code == 200 and served.text == "cluster"
        replayed = await client.get(
            f"http://{address}{path}", headers={"x-srt-cluster-signature": signed}
        )
        assert replayed.status_code == 403
        # The public port and nginx do not serve the cluster path at all.
        nginx = f"http://127.0.0.1:{topology.nginx.port}"
        for base in (nginx, topology.replicas[home].base_url):
            hidden = await client.get(f"{base}{path}", headers={"x-srt-cluster-signature": signed})
            assert hidden.status_code == 404, (base, hidden.status_code)
        assert (await conn.ok("read_file", path="c.txt", session=session))["content"] == "cluster"


async def test_forwarded_uploads_refused_or_cut_off_leave_nothing(
    topology: Topology, tmp_path: Path
) -> None:
    home, other, _ = list(topology.replicas)
    session = unique("fwdq")
    large = tmp_path / "large.bin"
    await asyncio.to_thread(make_file, large, 62)  # under the upload limit, over what is free
    async with (
        open_client(topology.replicas[home].url, TOPOLOGY_TOKEN, "auto") as conn,
        http() as client,
    ):
        await conn.ok("write_file", path="data.bin", content="before", session=session)
        put = with_base(
            await file_url(conn, session, "data.bin", "PUT"), topology.replicas[other].base_url
        )
        get = with_base(
            await file_url(conn, session, "data.bin"), topology.replicas[other].base_url
        )
        status = await raw_put(put, (TOPOLOGY_MB + 1) * MiB)
        assert status.startswith(b"HTTP/1.1 413"), status
        for how, extra in (("declared", []), ("chunked", ["-H", "Transfer-Encoding: chunked"])):
            status_code = await asyncio.to_thread(curl, *extra, "-T", str(large), put)
            assert status_code == 507, (how, status_code)
            got = await client.get(get)
            assert got.status_code == 200 and got.text == "before", how
            assert await only(conn, session, ["data.bin"]), how
        await cut_off_upload_leaves_nothing(conn, session, put)
        assert (await client.get(get)).text == "before"
    assert topology.home_of("default", session) == home
