"""The E2B API under hostile input, on the wire (the real server, SANDBOX_E2B=true).

Another principal's sandbox (its id known, the access token guessed), path traversal in
/files, oversized and malformed Connect frames, streams a client abandons, the per-key cap on
sandboxes, features we do not have.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import ServerProcess, Servers

pytestmark = pytest.mark.e2e

ALICE = "e2b_" + "a1" * 20
BOB = "e2b_" + "b2" * 20
CAP = 3


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve(
        "e2b-hostile",
        SANDBOX_E2B="true",
        SANDBOX_AUTH_TOKENS=f"alice:{ALICE},bob:{BOB}",
        SANDBOX_E2B_MAX_SANDBOXES=str(CAP),
        SANDBOX_MAX_UPLOAD_MB="4",
        SANDBOX_MAX_PER_SESSION="12",  # (ten processes at once in one sandbox)
    )


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=30) as client:
        yield client


def create(http: httpx2.Client, key: str = ALICE, **body: Any) -> dict[str, Any]:
    resp = http.post(
        "/v2/sandboxes", json={"templateID": "base", **body}, headers={"X-API-KEY": key}
    )
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


def envd(sandbox: dict[str, Any], token: str | None = None) -> dict[str, str]:
    return {
        "E2b-Sandbox-Id": sandbox["sandboxID"],
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sandbox["envdAccessToken"] if token is None else token,
    }


def frame(message: Any, flags: int = 0) -> bytes:
    data = json.dumps(message).encode() if not isinstance(message, bytes) else message
    return struct.pack(">BI", flags, len(data)) + data


def frames(body: bytes) -> list[tuple[int, Any]]:
    out = []
    while body:
        flags, length = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5 : 5 + length])))
        body = body[5 + length :]
    return out


def start(http: httpx2.Client, sandbox: dict[str, Any], command: str) -> httpx2.Response:
    message = {"process": {"cmd": "/bin/bash", "args": ["-c", command]}}
    return http.post(
        "/process.Process/Start",
        content=frame(message),
        headers={**envd(sandbox), "Content-Type": "application/connect+json"},
    )


def kill(http: httpx2.Client, sandbox: dict[str, Any], key: str = ALICE) -> None:
    http.delete(f"/sandboxes/{sandbox['sandboxID']}", headers={"X-API-KEY": key})


def test_another_principals_sandbox_is_not_there(http: httpx2.Client) -> None:
    """Bob knows Alice's sandbox id: the control plane answers 404 for every verb, envd with a
    guessed token answers exactly as for an id that does not exist, and Alice's sandbox lives."""
    alice = create(http)
    sid = alice["sandboxID"]
    bob = {"X-API-KEY": BOB}
    assert http.get(f"/sandboxes/{sid}", headers=bob).status_code == 404
    assert http.delete(f"/sandboxes/{sid}", headers=bob).status_code == 404
    assert (
        http.post(f"/sandboxes/{sid}/timeout", json={"timeout": 1}, headers=bob).status_code == 404
    )
    assert http.post(f"/sandboxes/{sid}/pause", headers=bob).status_code == 404
    assert sid not in [s["sandboxID"] for s in http.get("/v2/sandboxes", headers=bob).json()]
    guessed = http.get("/health", headers=envd(alice, token="guessed-token"))
    unknown = http.get("/health", headers=envd({**alice, "sandboxID": "inotthereatall000000"}, "x"))
    assert guessed.status_code == unknown.status_code == 502
    assert guessed.json()["message"].replace(sid, "ID") == unknown.json()["message"].replace(
        "inotthereatall000000", "ID"
    )
    refused = http.post(
        "/process.Process/Start",
        content=frame({"process": {"cmd": "/bin/true"}}),
        headers={**envd(alice, token="guessed"), "Content-Type": "application/connect+json"},
    )
    assert refused.status_code == 502
    assert http.get("/health", headers={**envd(alice), "X-Access-Token": ""}).status_code == 401
    odd = {**envd(alice), "X-Access-Token": "t\u00e9st".encode("latin-1")}
    assert http.get("/health", headers=odd).status_code == 502  # (not a 500)
    assert http.get(f"/sandboxes/{sid}", headers={"X-API-KEY": ALICE}).json()["state"] == "running"
    assert http.get("/v2/sandboxes", headers={"X-API-KEY": "e2b_" + "0" * 40}).status_code == 401
    assert http.get("/v2/sandboxes").status_code == 401
    kill(http, alice)


def test_files_paths_stay_in_the_workspace(http: httpx2.Client) -> None:
    """`..`, absolute paths elsewhere, a link the sandbox made to /etc/passwd, a multipart
    file named `../../x`: each refused; nothing is read or written outside."""
    sandbox = create(http)
    h = envd(sandbox)
    for path in (
        "../../etc/passwd",
        "/etc/passwd",
        "/home/user/../../etc/passwd",
        "/proc/self/environ",
    ):
        resp = http.get("/files", params={"path": path}, headers=h)
        assert resp.status_code == 400, (path, resp.status_code, resp.text)
        assert "root:" not in resp.text
    frames_ = frames(
        start(http, sandbox, "ln -s /etc/passwd /home/user/link; ln -s / /home/user/root").content
    )
    assert frames_[-1] == (2, {}), frames_
    for path in ("link", "root/etc/passwd"):
        resp = http.get("/files", params={"path": path}, headers=h)
        assert resp.status_code in (400, 403, 404), (path, resp.status_code)
        assert "root:" not in resp.text
    resp = http.post(
        "/files",
        params={"path": "../outside"},
        content=b"x",
        headers={**h, "Content-Type": "application/octet-stream"},
    )
    assert resp.status_code == 400
    resp = http.post("/files", files={"file": ("../../../tmp/evil-e2b", b"x")}, headers=h)
    assert resp.status_code == 400, resp.text
    # through the link: written as a new file beside it, never into /etc
    resp = http.post(
        "/files",
        params={"path": "root/tmp/evil"},
        content=b"x",
        headers={**h, "Content-Type": "application/octet-stream"},
    )
    assert resp.status_code >= 400
    kill(http, sandbox)


def test_uploads_are_bounded(http: httpx2.Client) -> None:
    """Past SANDBOX_MAX_UPLOAD_MB (4 here): refused, plain or gzip (a small body that inflates
    past it), nothing left behind."""
    import gzip

    sandbox = create(http)
    h = {**envd(sandbox), "Content-Type": "application/octet-stream"}
    resp = http.post("/files", params={"path": "big"}, content=b"x" * (5 * 2**20), headers=h)
    assert resp.status_code == 413, resp.text
    bomb = gzip.compress(b"\0" * (64 * 2**20))
    assert len(bomb) < 2**20
    resp = http.post(
        "/files", params={"path": "bomb"}, content=bomb, headers={**h, "Content-Encoding": "gzip"}
    )
    assert resp.status_code in (400, 413), resp.text
    resp = http.post("/files", files={"file": ("big2", b"y" * (5 * 2**20))}, headers=envd(sandbox))
    assert resp.status_code == 413, resp.text
    listing = http.post(
        "/filesystem.Filesystem/ListDir",
        json={"path": "/home/user"},
        headers={**envd(sandbox), "Content-Type": "application/json"},
    )
    assert listing.status_code == 200 and listing.json().get("entries", []) == []
    small = gzip.compress(b"hello gzip")
    resp = http.post(
        "/files", params={"path": "g.txt"}, content=small, headers={**h, "Content-Encoding": "gzip"}
    )
    assert resp.status_code == 200, resp.text
    assert (
        http.get("/files", params={"path": "g.txt"}, headers=envd(sandbox)).content == b"hello gzip"
    )
    kill(http, sandbox)


def test_multipart_headers_are_bounded(http: httpx2.Client) -> None:
    """A part's headers over the multipart parser's bounds (one header's size, their count),
    and a body that is not multipart, are a 400 saying so (they were a bare 500)."""
    sandbox = create(http)
    boundary = "b0undary"

    def body(headers: str) -> Iterator[bytes]:
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="h.txt"\r\n'
        ).encode()
        yield headers.encode()
        yield f"\r\nhi\r\n--{boundary}--\r\n".encode()

    def chunked(headers: str) -> Iterator[bytes]:
        whole = b"".join(body(headers))
        for i in range(0, len(whole), 65536):
            yield whole[i : i + 65536]

    h = {**envd(sandbox), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    long_value = "X-Junk: " + "j" * (3 * 2**20) + "\r\n"
    resp = http.post("/files", content=chunked(long_value), headers=h)
    assert resp.status_code == 400, resp.text
    assert "multipart body is malformed: Maximum header size" in resp.json()["message"]
    many = "".join(f"X-{i}: v\r\n" for i in range(5000))
    resp = http.post("/files", content=chunked(many), headers=h)
    assert resp.status_code == 400 and "malformed" in resp.json()["message"], resp.text
    resp = http.post("/files", content=b"--b0undary\r\nnot a header line\r\n\r\n", headers=h)
    assert resp.status_code == 400 and "malformed" in resp.json()["message"], resp.text
    fine = http.post("/files", content=chunked("X-Fine: 1\r\n"), headers=h)
    assert fine.status_code == 200, fine.text
    assert http.get("/files", params={"path": "h.txt"}, headers=envd(sandbox)).content == b"hi"
    kill(http, sandbox)


def test_oversized_and_malformed_connect_messages(http: httpx2.Client) -> None:
    """A frame announcing 64 MiB, a truncated header, a frame that is not JSON, a unary body
    over the limit, a stream with the wrong content type: each a Connect error naming the
    problem; the server reads no more than the limit."""
    sandbox = create(http)
    stream = {**envd(sandbox), "Content-Type": "application/connect+json"}
    cases = [
        (struct.pack(">BI", 0, 64 * 2**20) + b"{}", "resource_exhausted"),
        (b"\x00\x00", "invalid_argument"),
        (frame(b"{not json"), "invalid_argument"),
        (frame([1, 2]), "invalid_argument"),
        (frame({}, flags=0x01), "unimplemented"),
    ]
    for body, code in cases:
        resp = http.post("/process.Process/Start", content=body, headers=stream)
        assert resp.status_code == 200
        last = frames(resp.content)[-1]
        assert last[0] == 2 and last[1]["error"]["code"] == code, (body[:20], last)
    unary = {**envd(sandbox), "Content-Type": "application/json"}
    resp = http.post("/process.Process/List", content=b"[" * (5 * 2**20), headers=unary)
    assert resp.status_code == 429 and resp.json()["code"] == "resource_exhausted"
    resp = http.post("/process.Process/List", content=b"{bad", headers=unary)
    assert resp.status_code == 400 and resp.json()["code"] == "invalid_argument"
    resp = http.post("/process.Process/Start", content=b"{}", headers=unary)
    assert resp.status_code == 400 and "connect+json" in resp.json()["message"]
    resp = http.post(
        "/filesystem.Filesystem/WatchDir", content=frame({"path": "/home/user"}), headers=stream
    )
    assert resp.status_code == 501 and resp.json()["code"] == "unimplemented"
    resp = http.post(
        "/process.Process/SendInput",
        json={"process": {"pid": 1}, "input": {"stdin": "!!notbase64"}},
        headers=unary,
    )
    assert resp.json()["code"] in ("invalid_argument", "not_found")
    kill(http, sandbox)


def test_abandoned_streams_leave_nothing(server: ServerProcess, http: httpx2.Client) -> None:
    """Ten Start streams of a chatty command, each dropped after its first frames: the
    processes run on (as E2B's do) and are listed; once they are killed the server holds no
    more sockets than before (each stream's read ended with its client), and nothing of theirs
    is left running."""
    sandbox = create(http)
    headers = {**envd(sandbox), "Content-Type": "application/connect+json"}
    message = {
        "process": {"cmd": "/bin/bash", "args": ["-c", "while :; do echo tick; sleep 0.05; done"]}
    }
    start(http, sandbox, "true")  # (the session's first call: its workspace made)
    before = sockets(server)
    for _ in range(10):
        with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=30) as client:
            with client.stream(
                "POST", "/process.Process/Start", content=frame(message), headers=headers
            ) as resp:
                got = b""
                for chunk in resp.iter_bytes():
                    got += chunk
                    if got.count(b'"stdout"') >= 2 or len(got) > 4096:
                        break
                assert b'"start"' in got
    # While the processes still run, the dropped streams hold nothing of the server's.
    deadline = time.monotonic() + 15
    while sockets(server) > before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sockets(server) <= before + 1, (before, sockets(server))
    unary = {**envd(sandbox), "Content-Type": "application/json"}
    listed = http.post("/process.Process/List", json={}, headers=unary).json()["processes"]
    assert len(listed) == 10
    for process in listed:
        resp = http.post(
            "/process.Process/SendSignal",
            json={"process": {"pid": process["pid"]}, "signal": "SIGNAL_SIGKILL"},
            headers=unary,
        )
        assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = (
            http.post("/process.Process/List", json={}, headers=unary).json().get("processes", [])
        )
        if not left and sockets(server) <= before:
            break
        time.sleep(0.3)
    assert left == []
    assert sockets(server) <= before, (before, sockets(server))
    assert not any("tick" in cmd for _, cmd in server.descendants())
    kill(http, sandbox)


def sockets(server: ServerProcess) -> int:
    """The server's open sockets (its listener, its store, its clients' connections)."""
    fds = Path(f"/proc/{server.pid}/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            pass
    return count


def test_sandboxes_per_key_are_capped(http: httpx2.Client) -> None:
    """SANDBOX_E2B_MAX_SANDBOXES (3 here): the next create is a 429 saying how to get room;
    killing one makes room."""
    made = [create(http, BOB) for _ in range(CAP)]
    resp = http.post("/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": BOB})
    assert resp.status_code == 429 and "kill one" in resp.json()["message"]
    kill(http, made[0], BOB)
    made[0] = create(http, BOB)
    for sandbox in made:
        kill(http, sandbox, BOB)


def test_what_we_do_not_have_says_so(http: httpx2.Client) -> None:
    """An unknown template is a 400 naming the ones we run; volumes, template builds,
    metrics, network rules: a 501 naming the feature. Aliases of ours work."""
    key = {"X-API-KEY": ALICE}
    resp = http.post("/v2/sandboxes", json={"templateID": "my-custom"}, headers=key)
    assert resp.status_code == 400 and "code-interpreter-v1" in resp.json()["message"]
    for body, feature in (
        ({"templateID": "base", "volumeMounts": [{"name": "v", "path": "/data"}]}, "volumes"),
        ({"templateID": "base", "network": {"denyOut": ["0.0.0.0/0"]}}, "network rules"),
        ({"templateID": "base", "mcp": {"x": {}}}, "MCP gateway"),
        ({"templateID": "base", "secure": False}, "secure=False"),
    ):
        resp = http.post("/v2/sandboxes", json=body, headers=key)
        assert resp.status_code == 501 and feature in resp.json()["message"], resp.text
    for method, path, feature in (
        ("POST", "/v3/templates", "templates"),
        ("GET", "/volumes", "volumes"),
        ("GET", "/sandboxes/metrics", "metrics"),
    ):
        resp = http.request(method, path, headers=key)
        assert resp.status_code == 501 and feature in resp.json()["message"], resp.text
    offline = create(http, allow_internet_access=False)
    info = http.get(f"/sandboxes/{offline['sandboxID']}", headers=key).json()
    assert info["allowInternetAccess"] is False
    kill(http, offline)
    sandbox = create(http, templateID="code-interpreter")
    assert sandbox["templateID"] == "code-interpreter-v1"
    assert http.get(f"/sandboxes/{sandbox['sandboxID']}/metrics", headers=key).status_code == 501
    kill(http, sandbox)


def test_a_kill_during_a_pause_is_final(server: ServerProcess, http: httpx2.Client) -> None:
    """A kill answered while a pause is still taking its snapshot: the pause's end did write
    the record back (paused, listed, counted against the cap); now it finds it gone."""
    import threading

    key = {"X-API-KEY": ALICE}
    sandbox = create(http)
    made = start(http, sandbox, "head -c 40M /dev/urandom > a.bin")  # (a slow snapshot)
    assert frames(made.content)[-1] == (2, {}), made.content[-200:]
    paused: dict[str, httpx2.Response] = {}

    def pause() -> None:
        with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=60) as other:
            paused["answer"] = other.post(f"/sandboxes/{sandbox['sandboxID']}/pause", headers=key)

    thread = threading.Thread(target=pause)
    thread.start()
    time.sleep(0.05)
    assert http.delete(f"/sandboxes/{sandbox['sandboxID']}", headers=key).status_code == 204
    thread.join()
    assert paused["answer"].status_code in (204, 404), paused["answer"].text
    assert http.get(f"/sandboxes/{sandbox['sandboxID']}", headers=key).status_code == 404
    listed = http.get("/v2/sandboxes", params={"state": "running,paused"}, headers=key).json()
    assert sandbox["sandboxID"] not in [s["sandboxID"] for s in listed]


def test_two_connects_to_a_paused_sandbox_resume_it_once(
    server: ServerProcess, http: httpx2.Client
) -> None:
    """Two processes connect to a paused sandbox at once: one resumes it (201), the other
    waits for that and connects to the running sandbox (200). Both resumed it, the second
    restoring the snapshot again over what was written since the first."""
    import threading

    key = {"X-API-KEY": ALICE}
    sandbox = create(http)
    made = start(http, sandbox, "head -c 40M /dev/urandom > a.bin")  # (a slow restore)
    assert frames(made.content)[-1] == (2, {}), made.content[-200:]
    paused = http.post(f"/sandboxes/{sandbox['sandboxID']}/pause", headers=key)
    assert paused.status_code == 204, paused.text
    answers: list[int] = []

    def connect() -> None:
        with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=120) as other:
            url = f"/sandboxes/{sandbox['sandboxID']}/connect"
            answers.append(other.post(url, json={"timeout": 60}, headers=key).status_code)

    threads = [threading.Thread(target=connect) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == [200, 201]
    kill(http, sandbox)


def test_a_timeout_whose_pause_fails_still_ends_the_sandbox(http: httpx2.Client) -> None:
    """autoPause, but the workspace is too large to snapshot: the timeout ends the sandbox
    anyway (it was retried every second, running on past its timeout, for ever)."""
    key = {"X-API-KEY": ALICE}
    sandbox = create(http, autoPause=True, timeout=3)
    made = start(http, sandbox, "head -c 70M /dev/urandom > big.bin; sleep 600 &")
    assert frames(made.content)[-1] == (2, {}), made.content[-200:]
    deadline = time.monotonic() + 30
    status = 200
    while time.monotonic() < deadline and status == 200:
        time.sleep(0.5)
        status = http.get(f"/sandboxes/{sandbox['sandboxID']}", headers=key).status_code
    assert status == 404
    listing = http.post(
        "/process.Process/List",
        json={},
        headers={**envd(sandbox), "Content-Type": "application/json"},
    )
    assert listing.status_code == 502 and "not found" in listing.json()["message"]


def test_auto_pause_at_the_timeout_keeps_the_files(http: httpx2.Client) -> None:
    """autoPause: at its timeout the sandbox is paused (its files in a snapshot), not killed;
    its envd answers 'paused' meanwhile; connect resumes it with its files."""
    sandbox = create(http, autoPause=True, timeout=2)
    octet = {**envd(sandbox), "Content-Type": "application/octet-stream"}
    resp = http.post("/files", params={"path": "kept.txt"}, content=b"still here", headers=octet)
    assert resp.status_code == 200, resp.text
    key = {"X-API-KEY": ALICE}
    deadline = time.monotonic() + 20
    state = "running"
    while time.monotonic() < deadline and state == "running":
        time.sleep(0.3)
        state = http.get(f"/sandboxes/{sandbox['sandboxID']}", headers=key).json()["state"]
    assert state == "paused"
    resp = http.get("/files", params={"path": "kept.txt"}, headers=envd(sandbox))
    assert resp.status_code == 502 and "paused" in resp.json()["message"]
    resp = http.post(
        f"/sandboxes/{sandbox['sandboxID']}/connect", json={"timeout": 60}, headers=key
    )
    assert resp.status_code == 201, resp.text
    resumed = resp.json()
    got = http.get("/files", params={"path": "kept.txt"}, headers=envd(resumed))
    assert got.content == b"still here"
    kill(http, resumed)
