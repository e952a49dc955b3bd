"""The deployment's CA: made at first start, trusted by sandboxes, used only by the proxy.

The server makes it once (`<state_dir>/egress-ca/ca.pem` and `ca.key`, the key 0600 in a 0700
directory, never bound into a sandbox) and hands both to the proxy over its control channel.
The proxy signs, per host a secret rule binds, a short-lived leaf certificate with one key of
its own made at its start (`Leaves`, a bounded cache of TLS contexts). Sandboxes get the CA's
certificate only, in a trust bundle (the host's CAs plus ours) bound over the system's.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/cert.pem",
)
LEAF_DAYS = 7
MAX_LEAVES = 256  # TLS contexts kept (one per host)


def load_or_create(directory: Path) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of the deployment's CA in `directory`, made if missing."""
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    if cert_path.exists() and key_path.exists():
        return cert_path.read_bytes(), key_path.read_bytes()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandbox_runtime egress CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key_pem)
    cert_path.write_bytes(cert_pem)
    os.chmod(cert_path, 0o644)
    return cert_pem, key_pem


def problem(directory: Path) -> str | None:
    """Why the CA in `directory` cannot be loaded or made (checked before the server starts,
    which makes it only later); None when it can. Makes the directory if missing."""
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    hint = (
        "set SANDBOX_EGRESS_CA_DIR to a directory the server can write (the CA is made there "
        "at start), or make it with `srt-mcp-server secrets ca DIRECTORY` and set "
        "SANDBOX_EGRESS_CA_DIR=DIRECTORY"
    )
    if cert_path.exists() and key_path.exists():
        try:
            x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        except OSError as exc:
            return f"the deployment CA in {directory} cannot be read ({exc.strerror}): {hint}"
        except (ValueError, TypeError):
            return f"the deployment CA in {directory} is not a PEM certificate and key: {hint}"
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            return f"the deployment CA's key in {directory} is not an EC key: {hint}"
        return None
    if cert_path.exists() or key_path.exists():
        return f"the deployment CA in {directory} has only one of ca.pem and ca.key: {hint}"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return f"the deployment CA's directory {directory} cannot be made ({exc.strerror}): {hint}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the deployment CA's directory {directory} cannot be written: {hint}"
    return None


def upstream_problem(path: Path) -> str | None:
    """Why SANDBOX_EGRESS_UPSTREAM_CA_FILE cannot be used; None when it can."""
    try:
        data = path.read_bytes()
        if b"-----BEGIN CERTIFICATE-----" not in data:
            raise ssl.SSLError("no PEM certificate in it")
        upstream_context(data)
    except (ssl.SSLError, ValueError) as exc:  # (before OSError: SSLError is one)
        return f"SANDBOX_EGRESS_UPSTREAM_CA_FILE {path} is not a PEM bundle of CAs ({exc})"
    except OSError as exc:
        return f"SANDBOX_EGRESS_UPSTREAM_CA_FILE {path}: {exc.strerror}"
    return None


def system_bundle() -> bytes:
    """The host's CA bundle (empty if none is found)."""
    for path in SYSTEM_BUNDLES:
        try:
            return Path(path).read_bytes()
        except OSError:
            continue
    return b""


def write_bundle(directory: Path, ca_pem: bytes) -> Path:
    """`directory`/ca-certificates.crt: the host's CAs plus the deployment's (world-readable:
    it is bound into sandboxes; it holds certificates only)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    path = directory / "ca-certificates.crt"
    temp = directory / ".ca-certificates.crt.tmp"
    system = system_bundle()
    temp.write_bytes(system + (b"" if system.endswith(b"\n") or not system else b"\n") + ca_pem)
    os.chmod(temp, 0o644)
    os.replace(temp, path)
    return path


class Leaves:
    """Server-side TLS contexts for the hosts the proxy terminates, signed by the CA."""

    def __init__(
        self,
        ca_cert_pem: bytes,
        ca_key_pem: bytes,
        now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self._now = now
        self._ca = x509.load_pem_x509_certificate(ca_cert_pem)
        key = serialization.load_pem_private_key(ca_key_pem, None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._ca_key = key
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._key_pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # host -> (context, when it is made again: half its leaf's life, so a host in use
        # for longer than a leaf lives never gets an expired one)
        self._contexts: OrderedDict[str, tuple[ssl.SSLContext, datetime.datetime]] = OrderedDict()

    def context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for `host` (canonical)."""
        found = self._contexts.get(host)
        now = self._now()
        if found is not None and now < found[1]:
            self._contexts.move_to_end(host)
            return found[0]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])  # (HTTP/1.1 only inside: see http1.py)
        pem = self._leaf(host, now) + self._key_pem
        # load_cert_chain reads files only: a memfd, never on disk.
        fd = os.memfd_create("leaf", os.MFD_CLOEXEC)
        try:
            os.write(fd, pem)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        self._contexts[host] = (context, now + datetime.timedelta(days=LEAF_DAYS / 2))
        self._contexts.move_to_end(host)
        while len(self._contexts) > MAX_LEAVES:
            self._contexts.popitem(last=False)
        return context

    def _leaf(self, host: str, now: datetime.datetime) -> bytes:
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._ca.subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key()),
                False,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)


def upstream_context(extra_cas: bytes) -> ssl.SSLContext:
    """The client context towards real hosts: the system's trust store (plus `extra_cas`, the
    operator's internal CAs), hostname checked, HTTP/1.1."""
    context = ssl.create_default_context()
    if extra_cas:
        context.load_verify_locations(cadata=extra_cas.decode("ascii"))
    context.set_alpn_protocols(["http/1.1"])
    return context
