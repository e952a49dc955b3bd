"""Hosts and authorities as a proxy request names them: one canonical spelling, or refused.

Pure logic, standard library only: the egress policy (egress.py) decides on the canonical
host; the proxy splits a request's authority with `parse_authority`; the settings check the
DNS servers they name with it.
"""

from __future__ import annotations

import ipaddress
import re

from sandbox_runtime.errors import PolicyViolationError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_HOST = 300  # longer than any name (253) or IPv6 literal: refused before any parsing
# One DNS label: letters, digits, '_' and '-', never starting or ending with '-'.
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?")
# A last label inet_aton (and the WHATWG URL parser) would read as a number: the host is an IP.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
_V6_TEXT = re.compile(r"[0-9a-f:.]+")
_PORT = re.compile(r"[0-9]{1,5}")


class EgressDenied(PolicyViolationError):
    """A host, port or address refused by the egress policy; `reason` is machine-readable."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _bad_host(raw: object, why: str) -> EgressDenied:
    return EgressDenied("bad_host", f"{repr(raw)[:80]} {why}")


def canonical_host(raw: str) -> str:
    """The one canonical spelling of a host from a CONNECT authority or an absolute URL.

    Names are lowercased with one trailing dot stripped; IP literals in every inet_aton
    spelling (``127.1``, ``2130706433``, ``0x7f.1``, ``0177.0.0.1``) become dotted quads, and
    ``[v6]`` literals their compressed form without brackets (a bare IPv6 literal is accepted
    too, so the result is a fixed point). Raises `EgressDenied` (reason ``"bad_host"``) for
    anything else: whitespace or control characters, ``@ % / \\ ? #``, non-ASCII, empty or
    over-long labels, zone ids, a number that is not a valid IPv4 address.
    """
    if not isinstance(raw, str) or not raw or len(raw) > MAX_HOST or not raw.isascii():
        raise _bad_host(raw, "is empty, too long or not ASCII")
    host = raw.lower()
    if host.startswith("["):
        if not host.endswith("]"):
            raise _bad_host(raw, "has an unclosed bracket")
        return _canonical_v6(host[1:-1], raw)
    if ":" in host:
        return _canonical_v6(host, raw)
    if host.endswith("."):
        host = host[:-1]
    labels = host.split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        return _canonical_v4(labels, raw)
    if len(host) > 253:
        raise _bad_host(raw, "is longer than 253 characters")
    for label in labels:
        if len(label) > 63 or not _LABEL.fullmatch(label):
            raise _bad_host(raw, "is not a valid host name")
    return host


def _canonical_v6(text: str, raw: str) -> str:
    if not _V6_TEXT.fullmatch(text) or ":" not in text:
        raise _bad_host(raw, "is not a bracketed IPv6 literal (no zone ids)")
    try:
        address = ipaddress.IPv6Address(text)
    except ValueError:
        raise _bad_host(raw, "is not an IPv6 literal") from None
    if address.ipv4_mapped is not None:  # one spelling, whatever this Python's str() prefers
        return f"::ffff:{(int(address) >> 16) & 0xFFFF:x}:{int(address) & 0xFFFF:x}"
    return address.compressed


def _inet_part(part: str) -> int | None:
    if part.startswith("0x"):
        digits, base = part[2:], 16
        ok = bool(digits) and all(c in "0123456789abcdef" for c in digits)
    elif part.startswith("0") and len(part) > 1:
        digits, base = part[1:], 8
        ok = all(c in "01234567" for c in digits)
    else:
        digits, base = part, 10
        ok = bool(digits) and all(c in "0123456789" for c in digits)
    return int(digits, base) if ok else None


def _canonical_v4(parts: list[str], raw: str) -> str:
    """inet_aton's reading of a, a.b, a.b.c or a.b.c.d (each decimal, 0octal or 0xhex)."""
    values = [_inet_part(p) for p in parts]
    if len(parts) > 4 or any(v is None for v in values):
        raise _bad_host(raw, "looks numeric but is not an IPv4 address")
    numbers = [v for v in values if v is not None]
    *leading, last = numbers
    if any(v > 255 for v in leading) or last >= 256 ** (4 - len(leading)):
        raise _bad_host(raw, "has an IPv4 part out of range")
    value = last
    for i, v in enumerate(leading):
        value |= v << (8 * (3 - i))
    return str(ipaddress.IPv4Address(value))


def as_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_ip(host: str) -> bool:
    """Whether `host` (any spelling `canonical_host` accepts) is an IP literal. Never raises."""
    try:
        return as_ip(canonical_host(host)) is not None
    except EgressDenied:
        return False


def parse_port(text: str) -> int:
    if not _PORT.fullmatch(text) or not 1 <= int(text) <= 65535:
        raise EgressDenied("bad_port", f"{text[:20]!r} is not a port 1-65535")
    return int(text)


def parse_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """Split ``host[:port]`` or ``[v6][:port]`` into the canonical host and the port.

    The port is 1-5 decimal digits in 1-65535; without one, `default_port` is used.
    Raises `EgressDenied`: reason ``"bad_host"`` (see `canonical_host`; an IPv6 literal
    without brackets too) or ``"bad_port"`` (malformed, out of range, or missing when
    `default_port` is None).
    """
    if not isinstance(authority, str) or len(authority) > MAX_HOST + 6:
        raise _bad_host(authority, "is not an authority")
    port_text: str | None
    if authority.startswith("["):
        end = authority.find("]")
        host, rest = authority[: end + 1], authority[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise _bad_host(authority, "is not [IPv6]:port")
        port_text = rest[1:] if rest else None
    elif authority.count(":") > 1:
        raise _bad_host(authority, "is an IPv6 literal without brackets")
    else:
        host, colon, port_text = authority.partition(":")
        port_text = port_text if colon else None
    canonical = canonical_host(host)
    if port_text is not None:
        return canonical, parse_port(port_text)
    if default_port is None or not 1 <= default_port <= 65535:
        raise EgressDenied("bad_port", f"{repr(authority)[:80]} has no port")
    return canonical, default_port
