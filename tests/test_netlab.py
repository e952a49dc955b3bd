"""The network lab itself (tests/netlab.py), seen from the host: no sandbox, no proxy.

The origins answer over the veth pair, TLS verifies against the lab's CA, the DNS server
answers from the mapping set_dns() writes and logs every question, and close() (also after a
start() that failed) leaves no namespace, veth or temp dir behind.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import dns.exception
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.resolver
import pytest
from netlab import HTTP_PORTS, HTTPS_PORTS, NetLab, netlab_fixture

pytestmark = pytest.mark.integration

lab = netlab_fixture(scope="module", name="lab")

# urllib must not pick up a proxy from the environment: these requests go straight to the lab.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    with DIRECT.open(url, timeout=timeout) as resp:
        return resp.status, resp.read()


def tls_request(
    lab: NetLab, port: int, server_name: str, request: bytes, address: str | None = None
) -> bytes:
    """One request over TLS to the origin at `address`, verified against the lab CA with
    SNI `server_name`; returns the whole answer (the origin closes: Connection: close)."""
    context = ssl.create_default_context(cafile=str(lab.ca_path))
    raw = socket.create_connection((address or lab.origin_ip, port), timeout=5)
    with context.wrap_socket(raw, server_hostname=server_name) as tls:
        tls.sendall(request)
        chunks = []
        while data := tls.recv(65536):
            chunks.append(data)
        return b"".join(chunks)


def split_response(answer: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return lines[0], headers, body


def query(lab: NetLab, name: str, rdtype: str = "A", tcp: bool = False) -> dns.message.Message:
    q = dns.message.make_query(name, rdtype)
    if tcp:
        return dns.query.tcp(q, lab.origin_ip, timeout=3)
    return dns.query.udp(q, lab.origin_ip, timeout=3)


def addresses(response: dns.message.Message) -> list[str]:
    return sorted(rd.to_text() for rrset in response.answer for rd in rrset)


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def test_addresses_and_namespace(lab: NetLab) -> None:
    host, origin = lab.host_ip, lab.origin_ip
    assert host.startswith("10.213.") and origin.startswith("10.213.")
    assert int(origin.rsplit(".", 1)[1]) == int(host.rsplit(".", 1)[1]) + 1
    assert lab.resolver == f"{origin}:53"
    assert lab.ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert len(lab.veth_host) <= 15 and len(lab.veth_ns) <= 15
    assert lab.ca_path.read_bytes() == lab.ca_pem
    assert lab.url("/x") == f"http://{origin}/x"
    assert lab.url("/x", port=8443, tls=True, host="allowed.test") == "https://allowed.test:8443/x"
    assert lab.url("/x", tls=True) == f"https://{origin}/x"


# ---------------------------------------------------------------------------------------------
# HTTP and HTTPS from the host
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", HTTP_PORTS)
def test_hello_on_every_http_port(lab: NetLab, port: int) -> None:
    assert get(lab.url("/hello", port=port)) == (200, f"hello from origin {port}\n".encode())


def test_echo_shows_the_request(lab: NetLab) -> None:
    lab.clear_logs()
    conn = http.client.HTTPConnection(lab.origin_ip, 8080, timeout=5)
    conn.request("GET", "/echo?x=1", headers={"X-Probe": "one"})
    echo = json.loads(conn.getresponse().read())
    conn.request("POST", "/echo", body=b"z" * 100_000, headers={"Content-Type": "text/plain"})
    posted = json.loads(conn.getresponse().read())  # same connection: keep-alive works
    conn.close()

    assert echo["method"] == "GET" and echo["path"] == "/echo?x=1"
    assert echo["headers"]["host"] == f"{lab.origin_ip}:8080"
    assert echo["headers"]["x-probe"] == "one"
    assert echo["port"] == 8080 and echo["tls"] is False
    assert echo["client"] == lab.host_ip
    assert posted["method"] == "POST" and posted["body_length"] == 100_000
    assert posted["headers"]["content-length"] == "100000"

    requests = lab.requests()
    assert [(r["method"], r["target"], r["port"]) for r in requests] == [
        ("GET", "/echo?x=1", 8080),
        ("POST", "/echo", 8080),
    ]
    assert len(lab.connections()) == 1


def test_curl_from_the_host(lab: NetLab) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (the python clients above cover the same)")
    plain = subprocess.run(
        ["curl", "-sS", "--noproxy", "*", "--max-time", "5", lab.url("/hello", port=8081)],
        capture_output=True,
        check=True,
    )
    assert plain.stdout == b"hello from origin 8081\n"
    # HTTPS by name, the name pinned to origin_ip (no resolver involved), verified by the CA.
    secure = subprocess.run(
        [
            "curl",
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "5",
            "--cacert",
            str(lab.ca_path),
            "--resolve",
            f"allowed.test:8443:{lab.origin_ip}",
            "https://allowed.test:8443/hello",
        ],
        capture_output=True,
        check=True,
    )
    assert secure.stdout == b"hello from origin 8443\n"


@pytest.mark.parametrize("port", HTTPS_PORTS)
def test_https_verifies_against_the_lab_ca(lab: NetLab, port: int) -> None:
    request = b"GET /echo HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
    answer = tls_request(lab, port, "allowed.test", request)
    status, headers, body = split_response(answer)
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == "application/json"
    echo = json.loads(body)
    assert echo["tls"] is True and echo["sni"] == "allowed.test" and echo["port"] == port
    assert echo["headers"]["host"] == "allowed.test"

    hello = b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    # The wildcard name and the IP SAN verify too.
    assert split_response(tls_request(lab, port, "deep.allowed.test", hello))[2] == (
        f"hello from origin {port}\n".encode()
    )
    assert split_response(tls_request(lab, port, lab.origin_ip, hello))[0].endswith("200 OK")


def test_https_refuses_a_name_the_certificate_lacks(lab: NetLab) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_request(lab, 443, "unlisted.test", b"GET /hello HTTP/1.1\r\n\r\n")


def test_bytes_and_slow(lab: NetLab) -> None:
    status, body = get(lab.url("/bytes/1000000"))
    assert status == 200 and len(body) == 1_000_000
    assert body == (b"0123456789abcdef" * 62_500)

    started = time.monotonic()
    status, body = get(lab.url("/slow/3000?rate=10000", port=8080))
    elapsed = time.monotonic() - started
    assert status == 200 and body == (b"0123456789abcdef" * 188)[:3000]
    assert 0.2 <= elapsed < 3, elapsed  # 3000 bytes at 10000/s: about 0.3 s


def test_many_connections_at_once(lab: NetLab) -> None:
    """The origin is asynchronous: 300 connections open at the same time all get answers."""
    socks = [socket.create_connection((lab.origin_ip, 80), timeout=10) for _ in range(300)]
    try:
        for s in socks:
            s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")

        def answer(s: socket.socket) -> bytes:
            chunks = []
            while data := s.recv(4096):
                chunks.append(data)
            return b"".join(chunks)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(answer, socks))
    finally:
        for s in socks:
            s.close()
    assert all(a.endswith(b"hello from origin 80\n") for a in answers)


def test_ipv6_origins(lab: NetLab) -> None:
    if lab.origin_ip6 is None:
        pytest.skip("IPv6 is off on this host: the lab is IPv4-only")
    assert get(lab.url("/hello", host=lab.origin_ip6)) == (200, b"hello from origin 80\n")
    request = b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answer = tls_request(lab, 443, "allowed.test", request, address=lab.origin_ip6)
    assert answer.endswith(b"hello from origin 443\n")


def test_host_server_answers_on_the_host_address(lab: NetLab) -> None:
    with lab.host_server() as server:
        assert server.host == lab.host_ip
        assert get(server.url) == (200, b"host-self\n")
    with pytest.raises(OSError):
        get(server.url, timeout=2)


# ---------------------------------------------------------------------------------------------
# DNS
# ---------------------------------------------------------------------------------------------


def test_dns_answers_from_the_mapping(lab: NetLab) -> None:
    lab.reset_dns()
    lab.clear_logs()
    answer = query(lab, "allowed.test")
    assert answer.rcode() == dns.rcode.NOERROR and answer.flags & dns.flags.AA
    assert addresses(answer) == [lab.origin_ip]
    assert addresses(query(lab, "ALLOWED.Test.", tcp=True)) == [lab.origin_ip]
    assert addresses(query(lab, "a.b.allowed.test")) == [lab.origin_ip]  # *.allowed.test
    assert addresses(query(lab, "loop.test")) == ["127.0.0.1"]
    assert addresses(query(lab, "hostself.test")) == [lab.host_ip]
    # v4 only by default: AAAA is NOERROR without an answer; unknown names are NXDOMAIN.
    aaaa = query(lab, "allowed.test", "AAAA")
    assert aaaa.rcode() == dns.rcode.NOERROR and aaaa.answer == []
    assert query(lab, "nowhere.test").rcode() == dns.rcode.NXDOMAIN
    assert query(lab, "allowed.test.evil").rcode() == dns.rcode.NXDOMAIN

    assert lab.dns_queries() == [
        "allowed.test",
        "allowed.test",
        "a.b.allowed.test",
        "loop.test",
        "hostself.test",
        "allowed.test",
        "nowhere.test",
        "allowed.test.evil",
    ]
    log = lab.dns_log()
    assert [r["proto"] for r in log[:2]] == ["udp", "tcp"]
    assert log[5]["type"] == "AAAA" and log[0]["client"] == lab.host_ip
    assert "denied.test" not in lab.dns_queries()


def test_set_dns_takes_effect_at_once(lab: NetLab) -> None:
    try:
        assert addresses(query(lab, "rebind.test")) == [lab.origin_ip]
        lab.set_dns({"rebind.test": ["127.0.0.1", "::1"], "Mixed.Case.Test.": ["10.213.0.9"]})
        assert addresses(query(lab, "rebind.test")) == ["127.0.0.1"]
        assert addresses(query(lab, "rebind.test", "AAAA")) == ["::1"]
        assert addresses(query(lab, "mixed.case.test")) == ["10.213.0.9"]
        assert query(lab, "allowed.test").rcode() == dns.rcode.NXDOMAIN  # replaced, not merged

        lab.set_dns({"broken.test": "SERVFAIL", "silent.test": "TIMEOUT"})
        assert query(lab, "broken.test").rcode() == dns.rcode.SERVFAIL
        with pytest.raises(dns.exception.Timeout):
            dns.query.udp(dns.message.make_query("silent.test", "A"), lab.origin_ip, timeout=0.3)
    finally:
        lab.reset_dns()


def test_a_stub_resolver_pointed_at_the_lab(lab: NetLab) -> None:
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [lab.origin_ip]
    assert [r.to_text() for r in resolver.resolve("other.test", "A")] == [lab.origin_ip]
    with pytest.raises(dns.resolver.NXDOMAIN):
        resolver.resolve("unknown.test", "A")


# ---------------------------------------------------------------------------------------------
# Cleanup
# ---------------------------------------------------------------------------------------------


def leftovers(lab: NetLab) -> list[str]:
    """What of `lab` still exists on the host."""
    found = []
    if lab.ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
        found.append(f"netns {lab.ns}")
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    if lab.veth_host in links:
        found.append(f"link {lab.veth_host}")
    if lab.dir != Path() and lab.dir.exists():
        found.append(f"dir {lab.dir}")
    if Path("/run/srt-netlab", lab.ns).exists():
        found.append("registry entry")
    return found


def test_close_leaves_nothing_behind() -> None:
    own = NetLab(ipv6=False)
    with own:
        assert get(own.url("/hello")) == (200, b"hello from origin 80\n")
        origin_pid = own._proc.pid if own._proc else 0
    assert leftovers(own) == []
    with pytest.raises(ProcessLookupError):
        os.kill(origin_pid, 0)
    own.close()  # again: nothing to do, no error


def test_failed_start_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    own = NetLab(ipv6=False, start_timeout=0.5)

    def never_ready(self: NetLab) -> None:
        raise OSError("probe refused (simulated)")

    monkeypatch.setattr(NetLab, "_probe", never_ready)
    with pytest.raises(RuntimeError, match=r"not ready within 0\.5s") as failure:
        own.start()
    assert "simulated" in str(failure.value)
    assert leftovers(own) == []


def test_origin_crash_is_reported_with_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    own = NetLab(ipv6=False)
    own.http_ports = (80, 80)  # the second bind fails: the origin exits at once
    with pytest.raises(RuntimeError, match="exited with") as failure:
        own.start()
    assert "address already in use" in str(failure.value).lower()
    assert leftovers(own) == []
