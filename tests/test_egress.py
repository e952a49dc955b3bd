"""Network egress end to end: a real server, real sandboxes, the netlab's origins and DNS.

One lab and one server for the module. The server allows a few `.test` names (and the
lab's /30 as a CIDR, so the host's own address is refused by the host-address rule alone),
asks the lab's DNS server, and bounds connections (16) and bytes (64 MiB) per sandbox. Every
test sends its traffic from inside a sandbox, through the relay and the host proxy, and
checks what the origins, the DNS server and the execution's events saw. No public host is
named anywhere.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import ipaddress
import json
import os
import signal
import textwrap
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import (
    Conn,
    Mode,
    ServerProcess,
    Servers,
    alive,
    eventually,
    open_client,
    proc_cmdline,
    process_tree,
    sandbox_uid,
    traversable_by_others,
)
from netlab import NetLab, netlab_fixture

pytestmark = pytest.mark.e2e

TOKEN = "egress-test-token-0123456789"
ALLOW = (
    "allowed.test,*.allowed.test,allowed.test:8080,rebind.test,loop.test,meta.test,hostself.test"
)
MAX_CONNECTIONS = 16
MAX_MB = 64
MAX_EVENTS = 50  # denial events the proxy reports per sandbox (more are only counted)
PROXY_MARKER = "sandbox_runtime.egress.proxy"

lab = netlab_fixture(scope="module", name="lab")


def dns_mapping(lab: NetLab) -> dict[str, list[str]]:
    """Every name the tests use resolves (a refused name that was looked up would show in the
    DNS log, and would lead somewhere): the allowed ones and the refused ones alike."""
    origin = [lab.origin_ip]
    return {
        "allowed.test": origin,
        "*.allowed.test": origin,  # deny.allowed.test too
        "other.test": origin,
        "allowed.test.evil": origin,
        "evil": origin,
        "loop.test": ["127.0.0.1"],
        "rebind.test": ["127.0.0.1"],
        "meta.test": ["169.254.169.254"],
        "hostself.test": [lab.host_ip],
    }


@pytest.fixture(scope="module")
def server(lab: NetLab, tmp_path_factory: pytest.TempPathFactory, serve: Servers) -> ServerProcess:
    lab.set_dns(dns_mapping(lab))
    workdir = tmp_path_factory.mktemp("egress")
    # The server's TMPDIR (its private directory, egress sockets included) where the tests
    # can find it; the proxy runs as the sandbox user, so it must be traversable.
    tmpdir = workdir / "tmp"
    tmpdir.mkdir()
    traversable_by_others(tmpdir)
    running = serve(
        workdir=workdir,
        TMPDIR=str(tmpdir),
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_EGRESS_ALLOW=ALLOW,
        SANDBOX_EGRESS_DENY="deny.allowed.test",
        SANDBOX_EGRESS_ALLOW_CIDRS=str(lab_network(lab)),
        SANDBOX_EGRESS_RESOLVER=lab.resolver,
        SANDBOX_EGRESS_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
        SANDBOX_EGRESS_MAX_MB=str(MAX_MB),
        SANDBOX_EGRESS_CONNECT_TIMEOUT="5",
    )
    assert running.health().get("egress", "ok") == "ok", running.health()
    return running


def lab_network(lab: NetLab) -> ipaddress.IPv4Network:
    network = ipaddress.ip_interface(f"{lab.host_ip}/30").network
    assert isinstance(network, ipaddress.IPv4Network)
    assert ipaddress.ip_address(lab.origin_ip) in network
    return network


# -- helpers --------------------------------------------------------------------------------

# Sends raw requests to the relay's port (one connection each) and reports what came back.
PROBE = r"""
import base64, json, re, socket, sys, time

def exchange(raw, head_only, timeout=8.0):
    out = {"sent": raw[:200].decode("latin-1")}
    data, error, closed = b"", None, False
    try:
        sock = socket.create_connection(("127.0.0.1", 3128), timeout=timeout)
    except OSError as exc:
        return {**out, "error": f"connect: {exc}", "status": None, "code": None}
    deadline = time.monotonic() + timeout
    try:
        sock.sendall(raw)
        while time.monotonic() < deadline:
            if head_only and b"\r\n\r\n" in data:
                break
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            data += chunk
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    match = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
    return {
        **out,
        "status": lines[0] if data else None,
        "code": int(match.group(1)) if match else None,
        "denied": headers.get("x-egress-denied"),
        "connection": headers.get("connection"),
        "responses": len(re.findall(rb"(?:^|\r\n)HTTP/1\.[01] \d{3} ", data)),
        "body": body[:4000].decode("latin-1"),
        "closed": closed,
        "error": error,
    }

items = json.loads(base64.b64decode(sys.argv[1]))
print(json.dumps([exchange(base64.b64decode(raw), head_only) for raw, head_only in items]))
"""

# Opens N connections to the relay's port at once, each asking CONNECT allowed.test:443,
# holding the ones that get through; prints how many got which answer.
FLOOD = r"""
import errno, json, selectors, socket, sys, time

N, SECONDS = int(sys.argv[1]), float(sys.argv[2])
REQUEST = b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n"
selector = selectors.DefaultSelector()
outcome, data, held = {}, {}, []

def failed_connect(err):
    return "reset" if err == errno.ECONNRESET else f"connect_errno_{err}"

for i in range(N):
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        outcome[i] = f"socket_errno_{exc.errno}"
        continue
    sock.setblocking(False)
    err = sock.connect_ex(("127.0.0.1", 3128))
    if err not in (0, errno.EINPROGRESS):
        outcome[i] = failed_connect(err)
        sock.close()
        continue
    data[sock] = b""
    selector.register(sock, selectors.EVENT_WRITE, i)

def done(sock, i, what):
    outcome[i] = what
    selector.unregister(sock)
    if what == "200":
        held.append(sock)  # the tunnel stays open until the program ends
    else:
        sock.close()

deadline = time.monotonic() + SECONDS
while len(outcome) < N and time.monotonic() < deadline:
    for key, mask in selector.select(timeout=0.5):
        sock, i = key.fileobj, key.data
        if mask & selectors.EVENT_WRITE:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                done(sock, i, failed_connect(err))
                continue
            try:
                sock.send(REQUEST)
            except (ConnectionResetError, BrokenPipeError):
                done(sock, i, "reset")
                continue
            except OSError as exc:
                done(sock, i, f"send_{type(exc).__name__}")
                continue
            selector.modify(sock, selectors.EVENT_READ, i)
            continue
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            done(sock, i, "reset")
            continue
        except OSError as exc:
            done(sock, i, f"recv_{type(exc).__name__}")
            continue
        data[sock] += chunk
        if b"\r\n\r\n" in data[sock] or not chunk:
            got = data[sock]
            done(sock, i, got.split(b" ")[1].decode() if got.startswith(b"HTTP/1.") else "closed")
for key in list(selector.get_map().values()):
    outcome.setdefault(key.data, "pending")
counts = {}
for what in outcome.values():
    counts[what] = counts.get(what, 0) + 1
print(json.dumps(counts), flush=True)
"""


def session(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def stream(result: dict[str, Any], kind: str = "stdout") -> str:
    return "".join(e.get("data") or "" for e in result["output"] if e["type"] == kind)


def denials(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in result["output"] if e["type"] == "network_denied"]


def denied_set(result: dict[str, Any]) -> set[tuple[str, int, str]]:
    return {(e.get("host", ""), e.get("port", 0), e.get("reason", "")) for e in denials(result)}


def describe(result: dict[str, Any]) -> str:
    """An execution's outcome for a failure message."""
    return (
        f"status={result.get('status')} exit={result.get('exit_code')} "
        f"reason={result.get('reason')} error={result.get('error')}\n"
        f"--- stdout\n{stream(result)[-3000:]}\n--- stderr\n{stream(result, 'stderr')[-3000:]}\n"
        f"--- denials\n{denials(result)}"
    )


async def sh(conn: Conn, command: str, sid: str, **args: Any) -> dict[str, Any]:
    args.setdefault("timeout_seconds", 60)
    return await conn.ok("execute_code", command=command, session=sid, **args)


async def prepare(conn: Conn, sid: str, lab: NetLab) -> None:
    """The lab's CA and the helper programs in the session's workspace."""
    await conn.ok("write_file", path="ca.pem", content=lab.ca_pem.decode(), session=sid)
    await conn.ok("write_file", path="probe.py", content=PROBE, session=sid)
    await conn.ok("write_file", path="flood.py", content=FLOOD, session=sid)


async def probe(
    conn: Conn, sid: str, requests: list[bytes | tuple[bytes, bool]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Send each raw request on its own connection to the relay; (answers, the execution)."""
    items = [(r, False) if isinstance(r, bytes) else r for r in requests]
    payload = json.dumps([(base64.b64encode(raw).decode(), head) for raw, head in items])
    arg = base64.b64encode(payload.encode()).decode()
    result = await sh(conn, f"python3 probe.py {arg}", sid)
    assert result["exit_code"] == 0, describe(result)
    answers = json.loads(stream(result).strip().splitlines()[-1])
    return answers, result


def lines_of(result: dict[str, Any]) -> dict[str, str]:
    """`key=value` lines of a command's stdout."""
    out = {}
    for line in stream(result).splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def proxy_pids(server: ServerProcess) -> list[int]:
    return [p for p in process_tree(server.pid) if PROXY_MARKER in (proc_cmdline(p) or "")]


def metric(server: ServerProcess, prefix: str, *labels: str) -> float:
    return server.metric(TOKEN, prefix, *labels)


def warm_kernels(server: ServerProcess) -> int:
    """The server's pooled (warm) python interpreters, from /metrics."""
    return int(metric(server, "srt_interpreters{", 'state="warm"', "python"))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def egress_dir(server: ServerProcess) -> Path:
    """The server's egress sockets' directory on the host (TMPDIR/srt-sandbox-*/egress)."""
    found = list((server.workdir / "tmp").glob("srt-sandbox-*/egress"))
    assert len(found) == 1, f"expected one server private dir with egress/, found {found}"
    return found[0]


async def output_until(
    conn: Conn, sid: str, execution_id: str, done: Any, within: float
) -> dict[str, Any]:
    """Long-poll an execution's output until done(all events so far) or the deadline; returns
    {"output": [...], "status": ...} with every event read."""
    events: list[dict[str, Any]] = []
    cursor = "0"
    status = None
    deadline = time.monotonic() + within
    while True:
        page = await conn.ok(
            "get_execution_output",
            execution_id=execution_id,
            last_event_id=cursor,
            wait=True,
            wait_seconds=1,
            session=sid,
        )
        events += page["output"]
        cursor = page["next_cursor"]
        status = page["status"]
        result = {"output": events, "status": status, "exit_code": page.get("exit_code")}
        if done(result):
            return result
        assert time.monotonic() < deadline, f"timed out waiting:\n{describe(result)}"


def finished(result: dict[str, Any]) -> bool:
    return result["status"] not in ("pending", "running")


# -- 1. allowed names --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_allowed_names_work_over_http_connect_and_urllib(
    server: ServerProcess, lab: NetLab, mode: Mode
) -> None:
    sid = session("allowed")
    urllib_code = textwrap.dedent(
        """\
        import ssl, urllib.request
        plain = urllib.request.urlopen("http://allowed.test/hello", timeout=10).read()
        ctx = ssl.create_default_context(cafile="ca.pem")
        tls = urllib.request.urlopen("https://allowed.test/hello", timeout=10, context=ctx).read()
        print("urllib_http=" + plain.decode().strip())
        print("urllib_https=" + tls.decode().strip())
        """
    )
    async with open_client(server.url, TOKEN, mode) as conn:
        await prepare(conn, sid, lab)
        await conn.ok("write_file", path="fetch.py", content=urllib_code, session=sid)
        lab.clear_logs()
        result = await sh(
            conn,
            'echo "proxy=$HTTP_PROXY|$HTTPS_PROXY|$ALL_PROXY|$NO_PROXY"\n'
            'echo "http=$(curl -sS --fail http://allowed.test/hello)"\n'
            'echo "https=$(curl -sS --fail --cacert ca.pem https://allowed.test/hello)"\n'
            'echo "www=$(curl -sS --fail --cacert ca.pem https://www.allowed.test:443/hello)"\n'
            'echo "port8080=$(curl -sS --fail http://allowed.test:8080/hello)"\n'
            "python3 fetch.py\n",
            sid,
        )
    got = lines_of(result)
    assert result["exit_code"] == 0, describe(result)
    proxy = "http://127.0.0.1:3128"
    assert got.get("proxy") == f"{proxy}|{proxy}|{proxy}|localhost,127.0.0.1,::1", describe(result)
    assert got.get("http") == "hello from origin 80", describe(result)
    assert got.get("https") == "hello from origin 443", describe(result)
    assert got.get("www") == "hello from origin 443", describe(result)
    assert got.get("port8080") == "hello from origin 8080", describe(result)
    assert got.get("urllib_http") == "hello from origin 80", describe(result)
    assert got.get("urllib_https") == "hello from origin 443", describe(result)
    assert not denials(result), describe(result)
    seen = {(r["port"], r["tls"], r["host"], r["sni"]) for r in lab.requests()}
    assert seen == {
        (80, False, "allowed.test", None),
        (443, True, "allowed.test", "allowed.test"),
        (443, True, "www.allowed.test", "www.allowed.test"),
        (8080, False, "allowed.test:8080", None),
    }, lab.requests()
    # Every request came from the host (the proxy), none from a sandbox's own address.
    assert {r["client"] for r in lab.requests()} == {lab.host_ip}, lab.requests()


# -- 2. refused names are never looked up ------------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_refused_names_get_403_an_event_and_no_lookup(
    server: ServerProcess, lab: NetLab, mode: Mode
) -> None:
    sid = session("refused")
    async with open_client(server.url, TOKEN, mode) as conn:
        await prepare(conn, sid, lab)
        lab.clear_logs()
        result = await sh(
            conn,
            "curl -sS -i http://other.test/hello; echo\n"
            "curl -sS -i http://deny.allowed.test/hello; echo\n"
            "echo \"connect=$(curl -sS -o /dev/null -w '%{http_connect}' --cacert ca.pem "
            'https://other.test/hello)"\n'
            "echo \"connect_denied=$(curl -sS -o /dev/null -w '%{http_connect}' --cacert ca.pem "
            'https://deny.allowed.test/hello)"\n'
            # A refusal the proxy sends without reading the (large) body still arrives.
            "head -c 8000000 /dev/zero > /tmp/body\n"
            "echo \"post=$(curl -sS -o /dev/null -w '%{http_code}' -H 'Expect:' "
            '--data-binary @/tmp/body http://other.test/upload)"\n',
            sid,
        )
    out = stream(result)
    assert "HTTP/1.1 403 Forbidden" in out, describe(result)
    assert "X-Egress-Denied: not_allowed" in out, describe(result)
    assert "egress denied: not_allowed (other.test:80)" in out, describe(result)
    assert "X-Egress-Denied: denied" in out, describe(result)
    assert "egress denied: denied (deny.allowed.test:80)" in out, describe(result)
    got = lines_of(result)
    assert got.get("connect") == "403" and got.get("connect_denied") == "403", describe(result)
    assert got.get("post") == "403", describe(result)
    assert denied_set(result) == {
        ("other.test", 80, "not_allowed"),
        ("deny.allowed.test", 80, "denied"),
        ("other.test", 443, "not_allowed"),
        ("deny.allowed.test", 443, "denied"),
    }, describe(result)
    for event in denials(result):
        assert event["message"] == (
            f"egress denied: {event['reason']} ({event['host']}:{event['port']})"
        )
    queries = lab.dns_queries()
    assert "other.test" not in queries and "deny.allowed.test" not in queries, queries
    assert lab.requests() == [] and lab.connections() == [], lab.requests()


# -- 3. allowed names that resolve somewhere internal -------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []
    lock = threading.Lock()

    def do_GET(self) -> None:
        with self.lock:
            self.seen.append(self.headers.get("Host", ""))
        body = b"host-self\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def test_names_resolving_to_internal_addresses_are_refused(
    server: ServerProcess, lab: NetLab
) -> None:
    sid = session("internal")
    host_server = lab.host_server(80)  # the host's own address, on an allowed port
    # (HostServer logs nothing: count what reaches it ourselves.)
    recorder = type("Recorder", (_Recorder,), {"seen": []})
    host_server._server.RequestHandlerClass = recorder
    try:
        direct = await asyncio.to_thread(
            lambda: urllib.request.urlopen(host_server.url, timeout=5).read()
        )
        assert direct == b"host-self\n" and recorder.seen, "the host server is not reachable"
        recorder.seen.clear()
        async with open_client(server.url, TOKEN, "auto") as conn:
            await prepare(conn, sid, lab)
            lab.clear_logs()
            result = await sh(
                conn,
                "for name in loop.test meta.test hostself.test rebind.test; do\n"
                '  echo "$name=$(curl -sS -o /dev/null -D - http://$name/ '
                "| tr -d '\\r' | grep -i '^x-egress-denied' | cut -d' ' -f2)\"\n"
                "done\n"
                "echo \"tls=$(curl -sS -o /dev/null -w '%{http_connect}' --cacert ca.pem "
                'https://loop.test/)"\n',
                sid,
            )
    finally:
        host_server.close()
    got = lines_of(result)
    assert got.get("loop.test") == "private_address", describe(result)
    assert got.get("meta.test") == "metadata_address", describe(result)
    assert got.get("hostself.test") == "local_address", describe(result)
    assert got.get("rebind.test") == "private_address", describe(result)
    assert got.get("tls") == "403", describe(result)
    assert denied_set(result) == {
        ("loop.test", 80, "private_address"),
        ("meta.test", 80, "metadata_address"),
        ("hostself.test", 80, "local_address"),
        ("rebind.test", 80, "private_address"),
        ("loop.test", 443, "private_address"),
    }, describe(result)
    assert recorder.seen == [], f"the host's own server was reached: {recorder.seen}"
    assert lab.requests() == [], lab.requests()
    # These names are allowed: the proxy looked them up (and then refused the addresses).
    assert {"loop.test", "meta.test", "hostself.test"} <= set(lab.dns_queries())


# -- 4. IP literals ---------------------------------------------------------------------------


async def test_ip_literals_in_every_spelling_have_one_canonical_form(
    server: ServerProcess, lab: NetLab
) -> None:
    sid = session("literals")
    host_int = int(ipaddress.IPv4Address(lab.host_ip))
    origin_int = int(ipaddress.IPv4Address(lab.origin_ip))
    refused = {
        "127.1": "127.0.0.1",
        "2130706433": "127.0.0.1",
        "0x7f000001": "127.0.0.1",
        "0177.0.0.1": "127.0.0.1",
        "[::ffff:127.0.0.1]": "::ffff:7f00:1",
        "[::1]": "::1",
        "[::ffff:7f00:1]": "::ffff:7f00:1",
        "169.254.169.254": "169.254.169.254",
        "0xa9fea9fe": "169.254.169.254",
        lab.host_ip: lab.host_ip,
        str(host_int): lab.host_ip,
    }
    allowed = [
        str(origin_int),
        hex(origin_int),
        ".".join(f"0{int(p):o}" for p in lab.origin_ip.split(".")),
    ]
    requests: list[bytes | tuple[bytes, bool]] = []
    for spelling in refused:
        requests.append(f"GET http://{spelling}/hello HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        requests.append(f"CONNECT {spelling}:443 HTTP/1.1\r\n\r\n".encode())
    for spelling in allowed:
        requests.append(f"GET http://{spelling}/hello HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    requests.append((f"CONNECT {hex(origin_int)}:443 HTTP/1.1\r\n\r\n".encode(), True))
    async with open_client(server.url, TOKEN, "legacy") as conn:
        await prepare(conn, sid, lab)
        lab.clear_logs()
        answers, result = await probe(conn, sid, requests)
    n = 2 * len(refused)
    for i, canonical in enumerate(refused.values()):
        # Outside the CIDRs: not_allowed by name; the host's own address: in the CIDR, but
        # refused as local when dialled.
        reason = "local_address" if canonical == lab.host_ip else "not_allowed"
        for answer in answers[2 * i : 2 * i + 2]:
            assert (answer["code"], answer["denied"]) == (403, reason), answer
    for answer in answers[n : n + len(allowed)]:
        assert answer["code"] == 200 and answer["body"] == "hello from origin 80\n", answer
    assert answers[-1]["code"] == 200 and "Connection established" in answers[-1]["status"]
    # The refusals name each address in its one canonical spelling.
    expected = set()
    for canonical in refused.values():
        reason = "local_address" if canonical == lab.host_ip else "not_allowed"
        expected |= {(canonical, 80, reason), (canonical, 443, reason)}
    assert denied_set(result) == expected, describe(result)
    # What reached the origin: the canonical dotted quad as Host, whatever the spelling.
    hosts = [r["host"] for r in lab.requests() if r["port"] == 80]
    assert hosts == [lab.origin_ip] * len(allowed), lab.requests()
    assert lab.dns_queries() == [], lab.dns_queries()  # literals are never looked up


# -- 5. names in odd spellings ------------------------------------------------------------------


async def test_odd_spellings_and_injections_are_refused(server: ServerProcess, lab: NetLab) -> None:
    sid = session("spell")
    ok = b"GET http://ALLOWED.Test./hello HTTP/1.1\r\nHost: whatever\r\n\r\n"
    bad = {
        b"GET http://allowed.test../hello HTTP/1.1\r\n\r\n": ("bad_host", 400),
        b"GET http://allowed.test.evil/hello HTTP/1.1\r\n\r\n": ("not_allowed", 403),
        b"CONNECT allowed.test.evil:443 HTTP/1.1\r\n\r\n": ("not_allowed", 403),
        b"GET http://allowed.test@other.test/ HTTP/1.1\r\n\r\n": ("bad_host", 400),
        b"GET http://allowed.test:80@other.test/ HTTP/1.1\r\n\r\n": ("bad_port", 400),
        b"GET http://allowed.test\\@other.test/ HTTP/1.1\r\n\r\n": ("bad_host", 400),
        b"CONNECT allowed.test@other.test:443 HTTP/1.1\r\n\r\n": ("bad_host", 400),
        b"CONNECT allowed.test%2eevil:443 HTTP/1.1\r\n\r\n": ("bad_host", 400),
        b"GET http://allowed.test%2eevil/ HTTP/1.1\r\n\r\n": ("bad_host", 400),
        "CONNECT allowed.tést:443 HTTP/1.1\r\n\r\n".encode(): ("bad_request", 400),
        b"GET http://xn--allowed-.test/ HTTP/1.1\r\n\r\n": ("bad_host", 400),
        "GET http://\u0430llowed.test/ HTTP/1.1\r\n\r\n".encode(): ("bad_request", 400),
        b"CONNECT allowed.test\r\nother.test:443 HTTP/1.1\r\n\r\n": ("bad_request", 400),
        b"GET http://allowed.test\rother.test/ HTTP/1.1\r\n\r\n": ("bad_request", 400),
        b"GET http://allowed.test/ HTTP/1.1\r\nX: a\rHost: other.test\r\n\r\n": (
            "bad_request",
            400,
        ),
        b"GET http://allowed.test/ HTTP/1.1\r\n Host: other.test\r\n\r\n": ("bad_request", 400),
        b"CONNECT allowed.test:0 HTTP/1.1\r\n\r\n": ("bad_port", 400),
        b"CONNECT allowed.test:65536 HTTP/1.1\r\n\r\n": ("bad_port", 400),
        b"CONNECT allowed.test:99999 HTTP/1.1\r\n\r\n": ("bad_port", 400),
        b"CONNECT allowed.test:+443 HTTP/1.1\r\n\r\n": ("bad_port", 400),
        b"CONNECT allowed.test HTTP/1.1\r\n\r\n": ("bad_port", 400),
        b"GET http://allowed.test:0/ HTTP/1.1\r\n\r\n": ("bad_port", 400),
        b"GET http://allowed.test:99999/ HTTP/1.1\r\n\r\n": ("bad_port", 400),
        b"GET https://allowed.test/ HTTP/1.1\r\n\r\n": ("https_needs_connect", 400),
        b"GET /hello HTTP/1.1\r\nHost: allowed.test\r\n\r\n": ("not_a_proxy_request", 400),
    }
    async with open_client(server.url, TOKEN, "auto") as conn:
        await prepare(conn, sid, lab)
        lab.clear_logs()
        answers, result = await probe(conn, sid, [ok, *bad])
    assert answers[0]["code"] == 200 and answers[0]["body"] == "hello from origin 80\n", answers[0]
    for answer, (raw, (reason, code)) in zip(answers[1:], bad.items(), strict=True):
        assert (answer["code"], answer["denied"]) == (code, reason), (raw, answer)
    reasons = sorted(e["reason"] for e in denials(result))
    assert reasons == sorted(reason for reason, _ in bad.values()), describe(result)
    # Only the good request reached an origin, as the canonical name.
    assert [(r["port"], r["host"]) for r in lab.requests()] == [(80, "allowed.test")]
    assert set(lab.dns_queries()) == {"allowed.test"}, lab.dns_queries()


# -- 6. Host headers and pipelining ------------------------------------------------------------


async def test_host_header_is_the_checked_authority_and_one_request_per_connection(
    server: ServerProcess, lab: NetLab
) -> None:
    sid = session("host")
    first = b"GET http://allowed.test/echo HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    pipelined = [
        first + b"GET http://other.test/echo HTTP/1.1\r\nHost: other.test\r\n\r\n",
        first + b"GET /echo HTTP/1.1\r\nHost: other.test\r\n\r\n",
        # Keep-alive asked for, and a second request in origin form: still only one.
        b"GET http://allowed.test/echo HTTP/1.1\r\nHost: allowed.test\r\n"
        b"Connection: keep-alive\r\nProxy-Connection: keep-alive\r\n\r\n"
        b"GET /hello HTTP/1.1\r\nHost: other.test\r\n\r\n",
    ]
    async with open_client(server.url, TOKEN, "auto") as conn:
        await prepare(conn, sid, lab)
        lab.clear_logs()
        result = await sh(conn, "curl -sS -H 'Host: other.test' http://allowed.test/echo", sid)
        echo = json.loads(stream(result))
        assert echo["headers"]["host"] == "allowed.test", echo
        assert [v for k, v in echo["header_list"] if k.lower() == "host"] == ["allowed.test"]
        assert echo["headers"].get("connection") == "close", echo
        assert "proxy-connection" not in echo["headers"], echo
        answers, result = await probe(conn, sid, pipelined)
    for answer in answers:
        assert answer["code"] == 200 and answer["responses"] == 1, answer
        assert answer["closed"] and answer["error"] is None, answer
        assert json.loads(answer["body"])["headers"]["host"] == "allowed.test", answer
    requests = lab.requests()
    assert [r["host"] for r in requests] == ["allowed.test"] * 4, requests
    assert all(r["target"] == "/echo" for r in requests), requests
    assert "other.test" not in lab.dns_queries()
    assert not denials(result), describe(result)


# -- 7. ports ---------------------------------------------------------------------------------


async def test_ports_outside_the_policy_are_refused(server: ServerProcess, lab: NetLab) -> None:
    sid = session("ports")
    async with open_client(server.url, TOKEN, "legacy") as conn:
        await prepare(conn, sid, lab)
        lab.clear_logs()
        result = await sh(
            conn,
            "curl -sS -i http://allowed.test:8081/hello; echo\n"
            "curl -sS -i http://www.allowed.test:8080/hello; echo\n"
            "echo \"tls8443=$(curl -sS -o /dev/null -w '%{http_connect}' --cacert ca.pem "
            'https://allowed.test:8443/hello)"\n'
            'echo "tunnel8080=$(curl -sS -p http://allowed.test:8080/hello)"\n'
            "echo \"tunnel8081=$(curl -sS -p -o /dev/null -w '%{http_connect}' "
            'http://allowed.test:8081/hello)"\n',
            sid,
        )
    out = stream(result)
    assert "403 Forbidden" in out and "X-Egress-Denied: port_not_allowed" in out, describe(result)
    assert "egress denied: port_not_allowed (allowed.test:8081)" in out, describe(result)
    assert "egress denied: port_not_allowed (www.allowed.test:8080)" in out, describe(result)
    assert "hello from origin 8081" not in out, describe(result)
    got = lines_of(result)
    assert got.get("tls8443") == "403", describe(result)
    # A port allowed for the name is allowed for CONNECT too (curl -p: HTTP in a tunnel).
    assert got.get("tunnel8080") == "hello from origin 8080", describe(result)
    assert got.get("tunnel8081") == "403", describe(result)
    assert denied_set(result) == {
        ("allowed.test", 8081, "port_not_allowed"),
        ("www.allowed.test", 8080, "port_not_allowed"),
        ("allowed.test", 8443, "port_not_allowed"),
    }, describe(result)
    assert len(denials(result)) == 4, describe(result)  # 8081 twice: GET, then CONNECT
    assert {r["port"] for r in lab.connections()} == {8080}, lab.connections()


# -- 8. no direct route ----------------------------------------------------------------------


async def test_no_route_but_the_proxy_and_none_without_network(
    server: ServerProcess, lab: NetLab
) -> None:
    sid = session("route")
    connect = (
        'python3 -c "import socket, sys\n'
        "try:\n"
        "    s = socket.socket(); s.settimeout(3)\n"
        "    s.connect((sys.argv[1], int(sys.argv[2]))); print('connect=connected')\n"
        "except OSError as e:\n"
        "    print('connect=failed', e.errno)\" "
    )
    direct = (
        f"curl -sS --max-time 5 --noproxy '*' http://{lab.origin_ip}/hello; "
        'echo "curl=$?"\n' + connect + f"{lab.origin_ip} 80\n"
    )
    async with open_client(server.url, TOKEN, "auto") as conn:
        await prepare(conn, sid, lab)
        lab.clear_logs()
        result = await sh(conn, direct, sid)
        got = lines_of(result)
        assert got.get("curl") not in (None, "0"), describe(result)
        assert got.get("connect", "").startswith("failed"), describe(result)
        assert "hello from origin" not in stream(result), describe(result)

        off = await sh(
            conn,
            'echo "env=$(env | grep -ci proxy)"\n'
            'echo "dir=$(ls -A /run/srt-egress 2>/dev/null | head -1)"\n'
            "curl -sS --max-time 5 http://allowed.test/hello; "
            'echo "proxied=$?"\n' + connect + "127.0.0.1 3128\n" + direct,
            sid,
            sandbox_config={"network": False},
        )
    got = lines_of(off)
    assert got.get("env") == "0", describe(off)
    assert got.get("dir") == "", describe(off)  # no socket (the directory may exist)
    assert got.get("proxied") not in (None, "0"), describe(off)
    assert got.get("curl") not in (None, "0"), describe(off)
    assert stream(off).count("connect=failed") == 2, describe(off)
    assert "hello from origin" not in stream(off), describe(off)
    assert lab.connections() == [] and lab.dns_queries() == [], lab.connections()


# -- 9. one socket per sandbox ---------------------------------------------------------------


async def test_a_sandbox_reaches_only_its_own_socket(server: ServerProcess, lab: NetLab) -> None:
    sid_a, sid_b = session("sock-a"), session("sock-b")
    base = egress_dir(server)
    async with open_client(server.url, TOKEN, "auto") as conn:
        await prepare(conn, sid_b, lab)
        started = await conn.ok(
            "execute_code_async",
            command='echo "inode=$(stat -c %i /run/srt-egress/proxy.sock)"; '
            'echo "listing=$(ls -A /run/srt-egress | tr "\\n" " ")"; echo ready=1; sleep 30',
            session=sid_a,
        )
        a_id = started["execution_id"]
        a_out = await output_until(
            conn, sid_a, a_id, lambda r: "ready=1" in stream(r) or finished(r), 20
        )
        a = lines_of(a_out)
        assert a.get("listing") == "proxy.sock", describe(a_out)
        inode_a = int(a["inode"])
        a_dirs = [d for d in base.iterdir() if (d / "proxy.sock").exists()
                  and (d / "proxy.sock").stat().st_ino == inode_a]  # fmt: skip
        assert len(a_dirs) == 1, f"A's socket (inode {inode_a}) not found under {base}"
        a_dir = a_dirs[0]
        assert (a_dir / "proxy.sock").stat().st_mode & 0o777 == 0o600
        assert a_dir.stat().st_mode & 0o777 == 0o700

        b = await sh(
            conn,
            'echo "inode=$(stat -c %i /run/srt-egress/proxy.sock)"\n'
            'echo "listing=$(ls -A /run/srt-egress | tr "\\n" " ")"\n'
            f'echo "a_path=$(ls {a_dir} 2>&1 | head -1)"\n'
            f'echo "a_in_unix=$(grep -c {a_dir.name}/ /proc/net/unix)"\n'
            "echo \"a_procs=$(cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -c 'slee[p] 30')\"\n"
            'python3 -c "import socket\n'
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect('{a_dir}/proxy.sock'); print('a_connect=connected')\n"
            "except OSError as e:\n"
            "    print('a_connect=failed', e.errno)\"\n"
            'echo "hello=$(curl -sS http://allowed.test/hello)"\n'
            "echo \"write=$(touch /run/srt-egress/x 2>&1 | grep -c 'Read-only')\"\n",
            sid_b,
        )
        got = lines_of(b)
        assert got.get("listing") == "proxy.sock", describe(b)
        assert int(got["inode"]) != inode_a, describe(b)
        assert "No such file" in got.get("a_path", ""), describe(b)
        assert got.get("a_in_unix") == "0", describe(b)
        assert got.get("a_procs") == "0", describe(b)  # (A's processes are not B's to see)
        assert got.get("a_connect", "").startswith("failed"), describe(b)
        assert got.get("hello") == "hello from origin 80", describe(b)
        assert got.get("write") == "1", describe(b)
        inode_b = int(got["inode"])

        assert a_dir.exists(), "A's socket went away while A runs"
        await conn.ok("cancel_execution", execution_id=a_id, force=True, session=sid_a)
        await output_until(conn, sid_a, a_id, finished, 20)
    await eventually(lambda: not a_dir.exists(), 10, f"A's socket dir {a_dir} to be removed")
    left = {(d / "proxy.sock").stat().st_ino for d in base.iterdir() if (d / "proxy.sock").exists()}
    assert inode_a not in left and inode_b not in left, (inode_a, inode_b, left)


# -- 11. a flood of connections ---------------------------------------------------------------


async def test_a_thousand_connects_are_bounded(server: ServerProcess, lab: NetLab) -> None:
    sid = session("flood")
    (proxy,) = proxy_pids(server)
    async with open_client(server.url, TOKEN, "auto") as conn:
        await prepare(conn, sid, lab)
        fds_before = open_fds(proxy)
        lab.clear_logs()
        result = await sh(conn, "python3 flood.py 1000 25", sid, timeout_seconds=60)
        assert result["exit_code"] == 0, describe(result)
        counts = json.loads(stream(result).strip().splitlines()[-1])
        assert sum(counts.values()) == 1000, counts
        tunnels = counts.get("200", 0)
        assert 1 <= tunnels <= MAX_CONNECTIONS, counts
        # A refusal is a 503, or (when the relay has every descriptor it may open taken by
        # the flood) a reset: the program hears it at once either way, and nothing waits.
        assert set(counts) <= {"200", "503", "closed", "reset"}, counts
        assert counts.get("503", 0) >= 1000 - MAX_CONNECTIONS - 100, counts
        events = denials(result)
        assert 1 <= len(events) <= MAX_EVENTS + 5, len(events)
        assert {e["reason"] for e in events} == {"connection_limit"}, events[:5]
        assert len([c for c in lab.connections() if c["port"] == 443]) <= MAX_CONNECTIONS

        # Every refused connection was closed: the proxy holds no more descriptors than before.
        await eventually(
            lambda: open_fds(proxy) <= fds_before + 2,
            10,
            f"the proxy's descriptors ({open_fds(proxy)}) back to about {fds_before}",
        )
        assert server.health()["status"] == "ok"
        after = await sh(conn, "curl -sS --fail http://allowed.test/hello", sid)
        assert stream(after) == "hello from origin 80\n", describe(after)


# -- 12. no widening --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_caller_cannot_widen_the_policy_only_narrow_it(
    server: ServerProcess, lab: NetLab, mode: Mode
) -> None:
    sid = session("widen")
    wider = [
        ["other.test"],
        ["*.test"],
        ["allowed.test:8081"],
        ["deny.allowed.test"],
        [f"{lab.origin_ip.rsplit('.', 1)[0]}.0/24"],
        ["10.0.0.0/8"],
    ]
    async with open_client(server.url, TOKEN, mode) as conn:
        await prepare(conn, sid, lab)
        for network in wider:
            message = await conn.error(
                "execute_code",
                command="echo should-not-run",
                sandbox_config={"network": network},
                session=sid,
            )
            assert "cannot widen" in message, (network, message)
        message = await conn.error(
            "run_code", code="1", sandbox_config={"network": ["other.test"]}, session=sid
        )
        assert "cannot widen" in message, message

        lab.clear_logs()
        narrowed = await sh(
            conn,
            'echo "plain=$(curl -sS http://allowed.test/hello)"\n'
            "echo \"www=$(curl -sS -o /dev/null -w '%{http_connect}' --cacert ca.pem "
            'https://www.allowed.test/hello)"\n'
            "echo \"port8080=$(curl -sS -o /dev/null -w '%{http_code}' "
            'http://allowed.test:8080/hello)"\n'
            "echo \"origin=$(curl -sS -o /dev/null -w '%{http_code}' "
            f'http://{lab.origin_ip}/hello)"\n',
            sid,
            sandbox_config={"network": ["allowed.test"]},
        )
    got = lines_of(narrowed)
    assert got.get("plain") == "hello from origin 80", describe(narrowed)
    assert got.get("www") == "403", describe(narrowed)
    assert got.get("port8080") == "403", describe(narrowed)
    # The CIDRs carry over when the caller names none.
    assert got.get("origin") == "200", describe(narrowed)
    assert denied_set(narrowed) == {
        ("www.allowed.test", 443, "not_allowed"),
        ("allowed.test", 8080, "port_not_allowed"),
    }, describe(narrowed)
    assert {r["host"] for r in lab.requests()} == {"allowed.test", lab.origin_ip}


# -- 13. the byte budget ---------------------------------------------------------------------


async def test_the_byte_budget_cuts_a_large_download(server: ServerProcess, lab: NetLab) -> None:
    sid = session("bytes")
    counted_before = metric(server, "srt_egress_bytes_total ")
    async with open_client(server.url, TOKEN, "auto") as conn:
        await prepare(conn, sid, lab)
        lab.clear_logs()
        result = await sh(
            conn,
            "curl -sS -o /dev/null -w 'size=%{size_download}\\n' "
            'http://allowed.test/bytes/100000000; echo "rc=$?"\n'
            'curl -sS -i http://allowed.test/hello; echo "after=$?"\n',
            sid,
        )
    got = lines_of(result)
    assert got.get("rc") not in (None, "0"), describe(result)
    size = int(got.get("size", "-1"))
    assert 0 < size <= MAX_MB * 1024 * 1024, describe(result)
    reasons = [e["reason"] for e in denials(result)]
    assert "byte_limit" in reasons, describe(result)
    # The budget is spent: the next request is refused before anything is dialled.
    assert "X-Egress-Denied: byte_limit" in stream(result), describe(result)
    assert [r["target"] for r in lab.requests()] == ["/bytes/100000000"], lab.requests()
    # The sandbox's bytes are counted once it has ended (its socket closed): all it moved,
    # with the one read (at most the proxy's 256 KiB chunk) that crossed the budget and was
    # dropped.
    counted = metric(server, "srt_egress_bytes_total ") - counted_before
    assert size <= counted <= MAX_MB * 1024 * 1024 + 256 * 1024, (counted, size)
    assert metric(server, "srt_egress_denied_total{", 'reason="byte_limit"') >= 1


# -- 14. interpreters --------------------------------------------------------------------------


async def test_run_code_goes_through_the_proxy_and_reports_denials(
    server: ServerProcess, lab: NetLab
) -> None:
    sid = session("interp")
    async with open_client(server.url, TOKEN, "auto") as conn:
        lab.clear_logs()
        ok = await conn.ok(
            "run_code",
            code="import urllib.request\n"
            "reply = urllib.request.urlopen('http://allowed.test/hello', timeout=10)\n"
            "print(reply.read().decode())",
            timeout_seconds=60,
            session=sid,
        )
        assert stream(ok).strip() == "hello from origin 80", describe(ok)
        assert not denials(ok), describe(ok)
        refused = await conn.ok(
            "run_code",
            code="import urllib.error\n"
            "try:\n"
            "    urllib.request.urlopen('http://other.test/hello', timeout=10)\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code, e.headers.get('X-Egress-Denied'))",
            timeout_seconds=60,
            session=sid,
        )
    assert stream(refused).strip() == "403 not_allowed", describe(refused)
    assert denied_set(refused) == {("other.test", 80, "not_allowed")}, describe(refused)
    assert [r["host"] for r in lab.requests()] == ["allowed.test"], lab.requests()
    assert "other.test" not in lab.dns_queries()


def test_the_proxy_runs_as_the_sandbox_user_with_nothing_to_gain(
    server: ServerProcess,
) -> None:
    """It dropped root the way sandboxes' spawner does: every id the sandbox uid, no groups,
    no capability in any set (the bounding set too), no_new_privs, not dumpable."""
    (pid,) = proxy_pids(server)
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    uid = str(sandbox_uid())
    assert status["Uid"].split() == [uid] * 4, status["Uid"]
    assert status.get("Groups", "").strip() == ""
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    assert status["NoNewPrivs"].strip() == "1"
    assert os.stat(f"/proc/{pid}/environ").st_uid == 0  # not dumpable: its files stay root's


# -- 10. the proxy dies (last: the other tests want the first proxy) ---------------------------


async def test_a_killed_proxy_leaves_no_network_until_the_next_sandbox(
    server: ServerProcess, lab: NetLab
) -> None:
    sid = session("kill")
    pids = proxy_pids(server)
    assert len(pids) == 1, f"expected one egress proxy process, found {pids}"
    old = pids[0]
    script = textwrap.dedent(
        f"""\
        curl -sS -o /dev/null 'http://allowed.test/slow/20000000?rate=1000000'
        echo "first=$?"
        sleep 0.5
        curl -sS --max-time 5 http://allowed.test/hello; echo "second=$?"
        curl -sS --max-time 5 --cacert ca.pem https://allowed.test/hello; echo "second_tls=$?"
        python3 -c "import urllib.request
        try:
            urllib.request.urlopen('http://allowed.test/hello', timeout=5); print('urllib=ok')
        except OSError as e:
            print('urllib=failed', type(e).__name__)"
        curl -sS --max-time 5 --noproxy '*' http://{lab.origin_ip}/hello; echo "direct=$?"
        """
    )
    async with open_client(server.url, TOKEN, "legacy") as conn:
        await prepare(conn, sid, lab)
        lab.clear_logs()
        started = await conn.ok("execute_code_async", command=script, session=sid)
        eid = started["execution_id"]
        await eventually(
            lambda: any("/slow/" in r["target"] for r in lab.requests()), 15, "the download"
        )
        await asyncio.sleep(0.5)
        os.kill(old, signal.SIGKILL)
        await eventually(lambda: not alive(old), 5, "the proxy to die")
        lab.clear_logs()
        out = await output_until(conn, sid, eid, finished, 40)
        got = lines_of(out)
        assert got.get("first") not in (None, "0"), describe(out)
        assert got.get("second") not in (None, "0"), describe(out)
        assert got.get("second_tls") not in (None, "0"), describe(out)
        assert got.get("urllib", "").startswith("failed"), describe(out)
        assert got.get("direct") not in (None, "0"), describe(out)
        assert "hello from origin" not in stream(out), describe(out)
        assert lab.requests() == [], lab.requests()

        # The next sandbox starts a new proxy and has network again.
        again = await sh(conn, "curl -sS --fail http://allowed.test/hello", sid)
        assert stream(again) == "hello from origin 80\n", describe(again)
    new = proxy_pids(server)
    assert len(new) == 1 and new[0] != old, (old, new)
    assert "egress proxy stopped" in server.stderr_text()
    assert server.health()["status"] == "ok"


async def test_a_pooled_interpreter_has_network_after_the_proxy_restarts(
    server: ServerProcess, lab: NetLab
) -> None:
    """A warm (pooled) kernel started before the proxy died is handed to a new session after
    the proxy came back: that session's run_code must have network like a new execution."""
    await eventually(lambda: warm_kernels(server) >= 1, 30, "a warm python interpreter")
    (old,) = proxy_pids(server)
    os.kill(old, signal.SIGKILL)
    await eventually(lambda: not alive(old), 5, "the proxy to die")
    async with open_client(server.url, TOKEN, "auto") as conn:
        again = await sh(conn, "curl -sS --fail http://allowed.test/hello", session("restart"))
        assert stream(again) == "hello from origin 80\n", describe(again)
        assert len(proxy_pids(server)) == 1
        lab.clear_logs()
        result = await conn.call(
            "run_code",
            code="import urllib.request\n"
            "print(urllib.request.urlopen('http://allowed.test/hello', timeout=10).read())",
            timeout_seconds=60,
            session=session("pooled"),
        )
    structured = result.structured_content or {}
    assert "hello from origin 80" in stream(structured), (
        "a new session's interpreter has no network after the proxy restarted (its pooled "
        f"kernel kept the dead proxy's socket):\n{describe(structured)}"
    )
    assert [r["host"] for r in lab.requests()] == ["allowed.test"], lab.requests()
