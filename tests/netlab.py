"""A network lab for egress tests: origin servers and a DNS server in a network namespace.

No test reaches the internet. NetLab makes a network namespace joined to the host's by a veth
pair on a random /30 of 10.213.0.0/16 (plus, if IPv6 works, a random ULA /64), and runs
tests/netlab_origin.py inside it, bound on the namespace's end only:

    HTTP  on 80, 8080 and 8081 (8081: a port a policy can leave out)
    HTTPS on 443 and 8443, with a server certificate from the lab's own CA
    DNS   on UDP and TCP 53, answering from a mapping the test sets (set_dns)

The host's end (`host_ip`) is an address of the host itself, so a proxy on the host reaches
the origins through the veth, and a test can check the proxy refuses the host's own address
(host_server). Origins and DNS log every connection, request and question (requests(),
dns_queries()), so a test can assert a refused request never reached an origin and a refused
name was never looked up.

    with NetLab() as lab:
        urllib.request.urlopen(lab.url("/hello", port=8080))        # "hello from origin 8080"
        lab.set_dns({"allowed.test": [lab.origin_ip], "loop.test": ["127.0.0.1"]})
        ...                                                          # a resolver: lab.resolver

As a fixture: `netlab` below (session-scoped), or `lab = netlab_fixture(scope="module",
name="lab")` in a test module for a lab of its own. NetLab needs root and iproute2; without
them start() raises RuntimeError (tests error out rather than skip: CI has both).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import http.server
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import dns.exception
import dns.message
import dns.query
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ORIGIN_SCRIPT = Path(__file__).resolve().with_name("netlab_origin.py")
REQUIREMENT = "NetLab requires root and iproute2 (apt-get install iproute2)"

LAB_NET = ipaddress.IPv4Network("10.213.0.0/16")
HTTP_PORTS = (80, 8080, 8081)
HTTPS_PORTS = (443, 8443)
DNS_PORT = 53

# The server certificate's DNS names (the lab's IP addresses are added as IP SANs).
DEFAULT_NAMES = (
    "allowed.test",
    "*.allowed.test",
    "other.test",
    "denied.test",
    "rebind.test",
    "loop.test",
    "meta.test",
    "hostself.test",
)

# Namespaces of labs whose test process died without close(): found here and removed by the
# next lab to start (see _sweep_stale). /run is a tmpfs, cleared at boot like the namespaces.
REGISTRY = Path("/run/srt-netlab")
# Held while picking a free subnet and creating it, so concurrent labs never pick the same one.
SETUP_LOCK = Path(tempfile.gettempdir()) / "srt-netlab.lock"

START_TIMEOUT = 15.0


# ---------------------------------------------------------------------------------------------
# iproute2
# ---------------------------------------------------------------------------------------------


def _require_privileges() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise RuntimeError(REQUIREMENT)


def _ip(*args: str) -> str:
    """Run `ip args...`; raises RuntimeError with ip's own message on failure."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _ip_quiet(*args: str) -> None:
    """`ip args...` for cleanup: what is already gone is fine."""
    with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
        _ip(*args)


def _used_networks(
    family: Literal["-4", "-6"],
) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every network on the host's addresses and routes (any table) of one family."""
    used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in _ip("-o", family, "addr", "show").splitlines():
        words = line.split()
        for key in ("inet", "inet6"):
            if key in words:
                used.append(ipaddress.ip_interface(words[words.index(key) + 1]).network)
    route_types = {"unicast", "local", "broadcast", "multicast", "anycast", "unreachable",
                   "blackhole", "prohibit", "throw", "nat"}  # fmt: skip
    for line in _ip(family, "route", "show", "table", "all").splitlines():
        words = line.split()
        if words and words[0] in route_types:
            words = words[1:]
        if not words or words[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(words[0], strict=False))
    return used


def _netns_pids(ns: str) -> list[int]:
    try:
        return [int(p) for p in _ip("netns", "pids", ns).split()]
    except (RuntimeError, ValueError):
        return []


def _remove_netns(ns: str, veth_host: str) -> None:
    """Kill whatever still runs in `ns`, then delete the veth pair and the namespace.

    The veth goes first and explicitly: deleting a namespace frees its devices only later,
    in the kernel's own time, so a test looking right after close() could still see it."""
    for pid in _netns_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _ip_quiet("link", "del", veth_host)
    _ip_quiet("netns", "del", ns)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale() -> None:
    """Remove the namespaces (and temp dirs) of labs whose test process is gone."""
    if not REGISTRY.is_dir():
        return
    for entry in REGISTRY.glob("srtlab-*"):
        try:
            owner = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(int(owner.get("pid", 0))):
            continue
        _remove_netns(entry.name, owner.get("veth_host", ""))
        directory = Path(owner.get("dir", ""))
        if directory.name.startswith("srt-netlab-"):
            shutil.rmtree(directory, ignore_errors=True)
        entry.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Certificates
# ---------------------------------------------------------------------------------------------


def _make_certs(names: Sequence[str], addresses: Sequence[str]) -> tuple[bytes, bytes, bytes]:
    """A fresh CA and a server certificate it signs: (CA PEM, server cert PEM, key PEM)."""
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandbox-runtime netlab CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return (
        ca_cert.public_bytes(serialization.Encoding.PEM),
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


# ---------------------------------------------------------------------------------------------
# The host's own server (host_server)
# ---------------------------------------------------------------------------------------------


class _HostSelfHandler(http.server.BaseHTTPRequestHandler):
    def _answer(self, with_body: bool) -> None:
        body = b"host-self\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(True)

    def do_POST(self) -> None:
        self._answer(True)

    def do_HEAD(self) -> None:
        self._answer(False)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: pytest output stays readable


class HostServer:
    """A tiny HTTP server in the test process's (the host's) network namespace, answering
    `host-self` to everything; a thread. Closing it twice is fine."""

    def __init__(self, host: str, port: int) -> None:
        self._server = http.server.ThreadingHTTPServer((host, port), _HostSelfHandler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # close() waits up to one interval
            name=f"netlab-host-{self.port}",
            daemon=True,
        )
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> HostServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The lab
# ---------------------------------------------------------------------------------------------


class NetLab:
    """A network namespace with origin HTTP/HTTPS servers and a DNS server; see the module
    docstring. Addresses and names are known after start(); close() undoes everything,
    also after a start() that failed halfway, and may be called any number of times."""

    def __init__(
        self,
        names: Sequence[str] = DEFAULT_NAMES,
        *,
        ipv6: bool = True,
        dns_ttl: int = 0,
        start_timeout: float = START_TIMEOUT,
        workdir: Path | str | None = None,
    ) -> None:
        """`names`: the server certificate's DNS names; `ipv6`: also try a ULA pair (left out
        quietly where IPv6 does not work); `dns_ttl`: the TTL of DNS answers (0: resolvers
        that cache ask again every time, so set_dns() applies at once); `workdir`: where the
        lab's temp dir is made (default: the system's temp dir)."""
        if not names:
            raise ValueError("NetLab needs at least one certificate name")
        self.names = tuple(names)
        self.ipv6 = ipv6
        self.dns_ttl = dns_ttl
        self.start_timeout = start_timeout
        self._workdir = Path(workdir) if workdir is not None else None

        hex_id = secrets.token_hex(3)
        self.ns = f"srtlab-{hex_id}"
        self.veth_host = f"sl{hex_id}h"  # at most 15 characters, as the kernel wants
        self.veth_ns = f"sl{hex_id}n"
        self.host_ip = ""
        self.origin_ip = ""
        self.host_ip6: str | None = None
        self.origin_ip6: str | None = None
        self.dir = Path()
        self.ca_pem = b""
        self.http_ports: tuple[int, ...] = HTTP_PORTS
        self.https_ports: tuple[int, ...] = HTTPS_PORTS

        self._proc: subprocess.Popen[bytes] | None = None
        self._host_servers: list[HostServer] = []
        self._registered = False
        self._dir_made = False
        self._started = False
        self._closed = False

    # -- addresses and files ------------------------------------------------------------------

    @property
    def resolver(self) -> str:
        """The lab's DNS server as "address:port"."""
        return f"{self.origin_ip}:{DNS_PORT}"

    @property
    def ca_path(self) -> Path:
        """The lab CA's certificate (PEM, readable by anyone: sandboxes may need it)."""
        return self.dir / "ca.pem"

    @property
    def cert_path(self) -> Path:
        return self.dir / "server.pem"

    @property
    def key_path(self) -> Path:
        return self.dir / "server.key"

    @property
    def origin_log(self) -> Path:
        """The origin process's stdout and stderr."""
        return self.dir / "origin.log"

    @property
    def _dns_map(self) -> Path:
        return self.dir / "dns.json"

    @property
    def _dns_log(self) -> Path:
        return self.dir / "dns.log"

    @property
    def _access_log(self) -> Path:
        return self.dir / "access.log"

    def url(
        self, path: str = "/", port: int | None = None, tls: bool = False, host: str | None = None
    ) -> str:
        """An origin URL: `host` defaults to origin_ip (an IPv6 literal gets its brackets),
        `port` to 80 or 443, left out of the URL when it is the scheme's default."""
        scheme, default = ("https", 443) if tls else ("http", 80)
        port = default if port is None else port
        host = host or self.origin_ip
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        netloc = host if port == default else f"{host}:{port}"
        return f"{scheme}://{netloc}{path if path.startswith('/') else '/' + path}"

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> NetLab:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> NetLab:
        """Make the namespace, the certificates and the origins; returns once every port
        accepts connections from the host and the DNS server answers (RuntimeError with the
        origin's output otherwise)."""
        if self._started:
            raise RuntimeError("NetLab.start() called twice")
        _require_privileges()
        self._started = True
        try:
            _sweep_stale()
            self.dir = Path(tempfile.mkdtemp(prefix="srt-netlab-", dir=self._workdir))
            self._dir_made = True
            self.dir.chmod(0o755)  # ca.pem must be readable by an unprivileged sandbox
            self._create_network()
            self._write_certs()
            self.set_dns(self.default_dns())
            self._start_origin()
            self._wait_ready()
            self.clear_logs()  # the readiness probes are not the test's traffic
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop the origins and host servers, delete the namespace, veth pair and temp dir."""
        if self._closed:
            return
        self._closed = True
        for server in self._host_servers:
            with contextlib.suppress(Exception):
                server.close()
        self._host_servers.clear()
        if self._proc is not None:
            _kill_group(self._proc)
            self._proc = None
        if self._registered:
            _remove_netns(self.ns, self.veth_host)
            (REGISTRY / self.ns).unlink(missing_ok=True)
            self._registered = False
        if self._dir_made:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._dir_made = False

    def _create_network(self) -> None:
        # Registered before anything exists, so a crash at any point below leaves something
        # the next lab's _sweep_stale removes.
        REGISTRY.mkdir(mode=0o755, exist_ok=True)
        (REGISTRY / self.ns).write_text(
            json.dumps({"pid": os.getpid(), "veth_host": self.veth_host, "dir": str(self.dir)})
        )
        self._registered = True
        with open(SETUP_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            net = self._pick_subnet()
            host_addr, origin_addr = list(net.hosts())
            self.host_ip, self.origin_ip = str(host_addr), str(origin_addr)
            _ip("netns", "add", self.ns)
            _ip("link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns)
            _ip("link", "set", self.veth_ns, "netns", self.ns)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.veth_host)
            _ip("link", "set", self.veth_host, "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
            _ip("-n", self.ns, "addr", "add", f"{self.origin_ip}/30", "dev", self.veth_ns)
            _ip("-n", self.ns, "link", "set", self.veth_ns, "up")
            _ip("-n", self.ns, "route", "add", "default", "via", self.host_ip)
            if self.ipv6:
                self._add_ipv6()

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        """A random /30 of 10.213.0.0/16 that no address or route of the host's overlaps."""
        used = _used_networks("-4")
        for _ in range(256):
            third, fourth = random.randrange(256), random.randrange(64) * 4
            net = ipaddress.IPv4Network(f"10.213.{third}.{fourth}/30")
            if not any(net.overlaps(u) for u in used):
                return net
        raise RuntimeError(f"NetLab found no free /30 in {LAB_NET}")

    def _add_ipv6(self) -> None:
        """A random ULA /64 on the veth pair; without it (IPv6 off here) the lab is v4-only."""
        try:
            used = _used_networks("-6")
            for _ in range(16):
                prefix = "fd" + secrets.token_hex(7)  # fd + a 56-bit random network id
                groups = [prefix[i : i + 4] for i in range(0, 16, 4)]
                net = ipaddress.IPv6Network(":".join(groups) + "::/64")
                if not any(net.overlaps(u) for u in used):
                    break
            else:
                return
            host6, origin6 = str(net[1]), str(net[2])
            # nodad: usable (and bindable) at once, not "tentative" for a second or two.
            _ip("-6", "addr", "add", f"{host6}/64", "dev", self.veth_host, "nodad")
            _ip("-n", self.ns, "-6", "addr", "add", f"{origin6}/64", "dev", self.veth_ns, "nodad")
            _ip("-n", self.ns, "-6", "route", "add", "default", "via", host6)
        except RuntimeError:
            return
        self.host_ip6, self.origin_ip6 = host6, origin6

    def _write_certs(self) -> None:
        addresses = [a for a in (self.origin_ip, self.origin_ip6) if a]
        ca_pem, cert_pem, key_pem = _make_certs(self.names, addresses)
        self.ca_pem = ca_pem
        self.ca_path.write_bytes(ca_pem)
        self.ca_path.chmod(0o644)
        self.cert_path.write_bytes(cert_pem)
        self.cert_path.chmod(0o644)
        fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)

    @property
    def files_dir(self) -> Path:
        """The files /auth/simple/ lists and /auth/files/ serves."""
        return self.dir / "files"

    def set_auth(self, accepted: Sequence[str]) -> None:
        """The Authorization or X-Api-Key values /auth/ accepts (takes effect at once)."""
        path = self.dir / "auth.json"
        path.with_suffix(".tmp").write_text(json.dumps(list(accepted)))
        path.with_suffix(".tmp").replace(path)

    def _start_origin(self) -> None:
        config = {
            "binds": [a for a in (self.origin_ip, self.origin_ip6) if a],
            "http_ports": list(self.http_ports),
            "https_ports": list(self.https_ports),
            "cert": str(self.cert_path),
            "key": str(self.key_path),
            "dns_map": str(self._dns_map),
            "dns_ttl": self.dns_ttl,
            "dns_log": str(self._dns_log),
            "access_log": str(self._access_log),
            "ready": str(self.dir / "ready"),
            "auth": str(self.dir / "auth.json"),
            "files": str(self.files_dir),
        }
        self.files_dir.mkdir(exist_ok=True)
        config_path = self.dir / "origin.json"
        config_path.write_text(json.dumps(config, indent=2))
        for log in (self._dns_log, self._access_log):
            log.touch()
        with open(self.origin_log, "wb") as out:
            self._proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.ns,
                    sys.executable,
                    "-u",
                    str(ORIGIN_SCRIPT),
                    str(config_path),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # a group of its own: close() kills it whole
            )

    def _wait_ready(self) -> None:
        """Until every port accepts a connection from the host and DNS answers on UDP and
        TCP, or the origin exits, or start_timeout passes."""
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        ready = self.dir / "ready"
        last_error = "the origin has not said it is ready"
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"netlab origin exited with {self._proc.returncode} while starting:\n"
                    + self.origin_output()
                )
            if ready.exists():
                try:
                    self._probe()
                    return
                except (OSError, dns.exception.DNSException) as e:
                    last_error = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"netlab origin not ready within {self.start_timeout:g}s ({last_error}):\n"
                    + self.origin_output()
                )
            time.sleep(0.05)

    def _probe(self) -> None:
        for address in (a for a in (self.origin_ip, self.origin_ip6) if a):
            for port in (*self.http_ports, *self.https_ports, DNS_PORT):
                with socket.create_connection((address, port), timeout=1.0):
                    pass
            query = dns.message.make_query("netlab-ready.test", "A")
            dns.query.udp(query, address, timeout=1.0)
            dns.query.tcp(query, address, timeout=1.0)

    def origin_output(self) -> str:
        """What the origin process wrote to stdout and stderr so far."""
        try:
            return self.origin_log.read_text(errors="replace")
        except OSError:
            return ""

    # -- DNS ----------------------------------------------------------------------------------

    def default_dns(self) -> dict[str, list[str]]:
        """The mapping start() sets: the named origins at origin_ip, loop.test at 127.0.0.1,
        meta.test at the cloud metadata address, hostself.test at host_ip. IPv4 only, so
        which address a client connects to is certain; add origin_ip6 where a test wants it."""
        origin = [self.origin_ip]
        return {
            "allowed.test": origin,
            "*.allowed.test": origin,
            "other.test": origin,
            "denied.test": origin,
            "rebind.test": origin,
            "loop.test": ["127.0.0.1"],
            "meta.test": ["169.254.169.254"],
            "hostself.test": [self.host_ip],
        }

    def set_dns(self, mapping: Mapping[str, Sequence[str] | str]) -> None:
        """Replace what the DNS server answers, at once (atomically; it reads the file on
        every query). Keys: names, matched case-insensitively without the trailing dot, or
        "*.name" for the names below one. Values: a list of IPv4/IPv6 addresses (A answers
        the v4 ones, AAAA the v6 ones, an empty list is NOERROR without answers), or
        "SERVFAIL", or "TIMEOUT" (no reply at all). Names not in the mapping: NXDOMAIN."""
        normal: dict[str, list[str] | str] = {}
        for name, value in mapping.items():
            key = name.lower().rstrip(".")
            if isinstance(value, str):
                if value not in ("SERVFAIL", "TIMEOUT"):
                    raise ValueError(f"{name}: a list of addresses, SERVFAIL or TIMEOUT")
                normal[key] = value
            else:
                normal[key] = [str(ipaddress.ip_address(a)) for a in value]
        tmp = self._dns_map.with_suffix(".tmp")
        tmp.write_text(json.dumps(normal, indent=2))
        tmp.replace(self._dns_map)

    def reset_dns(self) -> None:
        """Back to default_dns()."""
        self.set_dns(self.default_dns())

    def dns_log(self) -> list[dict[str, Any]]:
        """Every question the DNS server received since the last clear_logs(): records with
        name (lowercase, no trailing dot), type ("A", "AAAA", ...), proto, client, time."""
        return _read_jsonl(self._dns_log)

    def dns_queries(self) -> list[str]:
        """The names asked about since the last clear_logs(), in order, repeats kept."""
        return [r["name"] for r in self.dns_log()]

    # -- origin traffic -----------------------------------------------------------------------

    def requests(self) -> list[dict[str, Any]]:
        """Every HTTP request the origins received since the last clear_logs(): port, tls,
        sni, client, method, target, host (the Host header), time."""
        return [r for r in _read_jsonl(self._access_log) if r.get("kind") == "request"]

    def connections(self) -> list[dict[str, Any]]:
        """Every connection the origins accepted (TLS: once the handshake completed) since
        the last clear_logs(): port, tls, client, time."""
        return [r for r in _read_jsonl(self._access_log) if r.get("kind") == "connection"]

    def clear_logs(self) -> None:
        """Forget the DNS questions, connections and requests seen so far."""
        for log in (self._dns_log, self._access_log):
            with open(log, "w"):
                pass

    # -- the host itself ----------------------------------------------------------------------

    def host_server(self, port: int = 0) -> HostServer:
        """An HTTP server on host_ip:port (0: a free port) in the test process's own network
        namespace, answering "host-self"; for checking a proxy refuses the host's address.
        Close it when done (close() of the lab does it too)."""
        server = HostServer(self.host_ip, port)
        self._host_servers.append(server)
        return server


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process's group, SIGKILL it after 5 s, and reap the process."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return records
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


# ---------------------------------------------------------------------------------------------
# pytest
# ---------------------------------------------------------------------------------------------

Scope = Literal["session", "package", "module", "class", "function"]


def netlab_fixture(
    scope: Scope = "session", name: str = "netlab", **options: Any
) -> Callable[..., Any]:
    """A pytest fixture yielding a started NetLab (options: NetLab's keyword arguments),
    closed after its scope. In a test module: `lab = netlab_fixture(scope="module",
    name="lab")`, then `def test_x(lab: NetLab)`."""

    @pytest.fixture(scope=scope, name=name)
    def _netlab() -> Iterator[NetLab]:
        with NetLab(**options) as lab:
            yield lab

    return _netlab


# A session-wide lab: `from netlab import netlab` in a conftest.py shares it with every test.
netlab = netlab_fixture()
