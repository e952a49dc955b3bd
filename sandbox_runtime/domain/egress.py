"""The egress policy: allow/deny rules, address vetting, narrowing; the proxy's settings.

Pure logic, standard library only. The proxy parses an authority with `parse_authority`
(hosts.py: canonical hosts and authorities; its names are importable from here too), asks
`EgressPolicy.check_name` before any DNS lookup, resolves once, asks
`EgressPolicy.vet_address` for every returned address and dials only a vetted one.
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sandbox_runtime.domain.hosts import MAX_HOST, as_ip, parse_port
from sandbox_runtime.domain.hosts import EgressDenied as EgressDenied
from sandbox_runtime.domain.hosts import IPAddress as IPAddress
from sandbox_runtime.domain.hosts import canonical_host as canonical_host
from sandbox_runtime.domain.hosts import is_ip as is_ip
from sandbox_runtime.domain.hosts import parse_authority as parse_authority
from sandbox_runtime.errors import InvalidRequestError, PolicyViolationError

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_PORTS: frozenset[int] = frozenset({80, 443})

# Refused unless inside an allowed CIDR: "this network" (0.0.0.0 dials the local host),
# private, CGNAT, loopback, link-local (the metadata services), IETF assignments, documentation
# (TEST-NET-1/2/3), the deprecated 6to4 relay anycast, benchmarking, multicast, reserved and
# broadcast. IPv6 outside 2000::/3 (ULA, link-local, multicast, ...) is refused too, and inside
# it the IETF assignments (Teredo 2001::/32, benchmarking, ORCHID) and documentation.
_V4_REFUSED = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8 10.0.0.0/8 100.64.0.0/10 127.0.0.0/8 169.254.0.0/16 172.16.0.0/12 "
        "192.0.0.0/24 192.0.2.0/24 192.88.99.0/24 192.168.0.0/16 198.18.0.0/15 "
        "198.51.100.0/24 203.0.113.0/24 224.0.0.0/4 240.0.0.0/4"
    ).split()
)
_V6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
_V6_REFUSED = tuple(ipaddress.IPv6Network(n) for n in ("2001::/23", "2001:db8::/32", "3fff::/20"))
_V6_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_V6_COMPAT = ipaddress.IPv6Network("::/96")  # includes :: and ::1
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")
# Credential endpoints, refused even inside an allowed CIDR unless a CIDR names exactly them:
# instance metadata (AWS, GCP, Azure, OpenStack...), AWS ECS task credentials, AWS EKS pod
# identity, Alibaba Cloud metadata, Azure WireServer, AWS IPv6 metadata and pod identity.
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254 169.254.170.2 169.254.170.23 100.100.100.200 168.63.129.16 "
        "fd00:ec2::254 fd00:ec2::23"
    ).split()
)


@dataclass(frozen=True)
class Rule:
    """One allow/deny entry: an exact name, or ``*.name`` for strict subdomains of it."""

    name: str  # canonical; for a wildcard, the suffix after "*."
    wildcard: bool = False
    port: int | None = None  # None: the default ports (allow) or every port (deny)

    @property
    def ports(self) -> frozenset[int]:
        return DEFAULT_PORTS if self.port is None else frozenset({self.port})

    def matches_name(self, host: str) -> bool:
        """Whether the canonical name `host` is this name (or a strict subdomain of it)."""
        return host.endswith("." + self.name) if self.wildcard else host == self.name

    def denies(self, host: str, port: int) -> bool:
        """As a deny rule: the name matches and the rule has no port or this port."""
        return self.matches_name(host) and self.port in (None, port)

    def covers(self, other: Rule) -> bool:
        """Whether every name `other` matches is matched by this rule (ports aside)."""
        if not self.wildcard:
            return not other.wildcard and other.name == self.name
        return (other.wildcard and other.name == self.name) or self.matches_name(other.name)

    def __str__(self) -> str:
        text = f"*.{self.name}" if self.wildcard else self.name
        return text if self.port is None else f"{text}:{self.port}"


def _entries(text: str) -> list[str]:
    if not isinstance(text, str):
        raise ValueError(f"egress entries must be a comma-separated string, not {text!r}")
    return [e.strip() for e in text.split(",") if e.strip()]


def _parse_rule(entry: str) -> Rule:
    host, port = entry, None
    if entry.startswith("["):
        raise ValueError(f"egress rule {entry!r}: IP literals are not names; list them as CIDRs")
    if ":" in entry:
        host, _, port_text = entry.rpartition(":")
        try:
            port = parse_port(port_text)
        except EgressDenied:
            raise ValueError(f"egress rule {entry!r}: the port must be 1-65535") from None
    wildcard = host.startswith("*.")
    try:
        name = canonical_host(host[2:] if wildcard else host)
    except EgressDenied:
        raise ValueError(f"egress rule {entry!r}: not a host name or *.name") from None
    if as_ip(name) is not None:
        raise ValueError(f"egress rule {entry!r}: IP literals are not names; list them as CIDRs")
    return Rule(name, wildcard, port)


def parse_rules(text: str) -> list[Rule]:
    """Parse comma-separated ``name``, ``*.name``, ``name:port`` entries (blanks skipped).

    Raises ValueError naming the first bad entry (IP literals, ``*`` anywhere but a leading
    ``*.``, a bad name or port).
    """
    rules: list[Rule] = []
    for entry in _entries(text):
        rule = _parse_rule(entry)
        if rule not in rules:
            rules.append(rule)
    return rules


def parse_cidrs(text: str) -> list[IPNetwork]:
    """Parse comma-separated networks (``10.1.2.0/24``, ``fd00::/8``; an address is /32, /128).

    Raises ValueError naming the first bad entry (host bits set, zone ids, non-standard
    spellings such as ``127.1``).
    """
    networks: list[IPNetwork] = []
    for entry in _entries(text):
        try:
            if "%" in entry:
                raise ValueError("zone ids are not allowed")
            network = ipaddress.ip_network(entry, strict=True)
        except ValueError as exc:
            raise ValueError(f"egress CIDR {entry!r}: {exc}") from None
        if network not in networks:
            networks.append(network)
    return networks


def _within(inner: IPNetwork, outer: IPNetwork) -> bool:
    if isinstance(inner, ipaddress.IPv4Network) and isinstance(outer, ipaddress.IPv4Network):
        return inner.subnet_of(outer)
    if isinstance(inner, ipaddress.IPv6Network) and isinstance(outer, ipaddress.IPv6Network):
        return inner.subnet_of(outer)
    return False


def _embedded_v4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, compatible, NAT64, 6to4, Teredo)."""
    value = int(address)
    if address in _V6_MAPPED or address in _NAT64 or (address in _V6_COMPAT and value > 1):
        return [ipaddress.IPv4Address(value & 0xFFFFFFFF)]
    if address in _SIX_TO_FOUR:
        return [ipaddress.IPv4Address((value >> 80) & 0xFFFFFFFF)]
    if address.teredo is not None:  # 2001::/32: the server's and the (inverted) client's
        return list(address.teredo)
    return []


def exact_addresses(cidrs: Sequence[IPNetwork]) -> frozenset[IPAddress]:
    """The single addresses among `cidrs` (/32, /128): what the operator named exactly."""
    return frozenset(net.network_address for net in cidrs if net.prefixlen == net.max_prefixlen)


def _vet(
    address: IPAddress, cidrs: Sequence[IPNetwork], exact: frozenset[IPAddress] | None = None
) -> str | None:
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        return "private_address"  # a zone only means something for link-local and multicast
    named = exact_addresses(cidrs) if exact is None else exact
    embedded = _embedded_v4(address) if isinstance(address, ipaddress.IPv6Address) else []
    for candidate in (address, *embedded):
        if candidate in METADATA_ADDRESSES and candidate not in named:
            return "metadata_address"
    if any(address in net for net in cidrs):
        return None
    if isinstance(address, ipaddress.IPv4Address):
        return "private_address" if any(address in net for net in _V4_REFUSED) else None
    if address in _V6_MAPPED or address in _NAT64 or address in _SIX_TO_FOUR:
        return _vet(embedded[0], cidrs, exact)  # the IPv4 address is where the packets go
    # Outside 2000::/3: ::, ::1, IPv4-compatible ::a.b.c.d (never dialled), 64:ff9b:1::/48,
    # ULA, link-local, multicast...; inside it: Teredo, benchmarking, documentation.
    if address not in _V6_GLOBAL_UNICAST or any(address in net for net in _V6_REFUSED):
        return "private_address"
    return None


def vet_address(address: str | IPAddress, policy: EgressPolicy | None = None) -> str | None:
    """Why `address` may not be dialled (a reason string), or None if it may. Never raises.

    Reasons: ``"bad_address"`` (not an address), ``"metadata_address"``, ``"private_address"``
    (loopback, private, link-local, CGNAT, multicast, reserved, documentation, ... and IPv6
    forms embedding such an IPv4 address). The policy's allowed CIDRs permit such addresses,
    except metadata addresses, which only a CIDR naming exactly that address permits.
    """
    if isinstance(address, str):
        try:
            address = ipaddress.ip_address(address)
        except ValueError:
            return "bad_address"
    if not isinstance(address, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return "bad_address"
    if policy is None:
        return _vet(address, ())
    return _vet(address, policy.allow_cidrs, policy.exact)


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one host and port (`host` canonical unless it was refused)."""

    allowed: bool
    host: str
    port: int
    reason: str | None = None


class EgressPolicy:
    """Allowed names, denied names and allowed address ranges; empty allow lists = no network.

    Raises ValueError on construction for a bad rule or CIDR (see `parse_rules`, `parse_cidrs`).
    """

    def __init__(
        self,
        allow: str,
        deny: str = "",
        allow_cidrs: str = "",
        exact: frozenset[IPAddress] | None = None,
    ) -> None:
        self.allow_rules: tuple[Rule, ...] = tuple(parse_rules(allow))
        self.deny_rules: tuple[Rule, ...] = tuple(parse_rules(deny))
        self.allow_cidrs: tuple[IPNetwork, ...] = tuple(parse_cidrs(allow_cidrs))
        # Addresses the operator named exactly (metadata addresses and the host's own are
        # refused but for these). A narrowing keeps its parent's: a caller naming one address
        # of an allowed range does not make it exact.
        self.exact: frozenset[IPAddress] = (
            exact_addresses(self.allow_cidrs) if exact is None else exact
        )
        # Whose sandbox this is, for the secret rules (secrets.py's SecretsGrant; None: no
        # secret goes through this sandbox's socket).
        self.grant: Any = None

    def granting(self, grant: Any) -> EgressPolicy:
        """A copy of this policy whose sandbox gets the secret rules `grant` allows."""
        policy = copy.copy(self)
        policy.grant = grant
        return policy

    @property
    def enabled(self) -> bool:
        return bool(self.allow_rules or self.allow_cidrs)

    def __repr__(self) -> str:
        return f"EgressPolicy({self.describe()!r})"

    def check_name(self, host: str, port: int) -> Decision:
        """Decide on `host` (any spelling) and `port` before any DNS lookup. Never raises.

        Reasons: ``"bad_host"``, ``"bad_port"``, ``"egress_disabled"``, ``"denied"`` (a deny
        rule: they win), ``"not_allowed"`` (no allow rule; an IP literal outside the allowed
        CIDRs), ``"port_not_allowed"``, and `vet_address`'s for an IP literal in a CIDR.
        """
        try:
            name = canonical_host(host)
        except EgressDenied as exc:
            return Decision(False, str(host)[:MAX_HOST], port, exc.reason)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            return Decision(False, name, port, "bad_port")
        if not self.enabled:
            return Decision(False, name, port, "egress_disabled")
        address = as_ip(name)
        if address is not None:
            if not any(address in net for net in self.allow_cidrs):
                return Decision(False, name, port, "not_allowed")
            reason = _vet(address, self.allow_cidrs, self.exact)
            return Decision(reason is None, name, port, reason)
        if any(rule.denies(name, port) for rule in self.deny_rules):
            return Decision(False, name, port, "denied")
        named = [rule for rule in self.allow_rules if rule.matches_name(name)]
        if not named:
            return Decision(False, name, port, "not_allowed")
        if not any(port in rule.ports for rule in named):
            return Decision(False, name, port, "port_not_allowed")
        return Decision(True, name, port, None)

    def vet_address(self, address: str | IPAddress) -> str | None:
        """See the module's `vet_address`, with this policy's CIDRs. Never raises."""
        return vet_address(address, self)

    def narrow(self, request: bool | str | Sequence[str] | None) -> EgressPolicy:
        """A per-execution narrowing: False/None = no network, True = this policy unchanged,
        otherwise entries (a list, or a comma string; none at all = no network), each within
        this policy. Requested CIDRs (or bare addresses) replace the allowed CIDRs and must each
        lie within one; without any, the CIDRs carry over. Deny rules always carry over.

        Raises InvalidRequestError for a malformed request or entry, PolicyViolationError
        ("cannot widen the egress policy") for an entry outside this policy or denied by it.
        """
        deny = ",".join(map(str, self.deny_rules))
        if request is None or request is False:
            return EgressPolicy("", deny, exact=self.exact)
        if request is True:
            return self
        items = [request] if isinstance(request, str) else request
        if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
            raise InvalidRequestError("network must be false or a list of egress rules")
        rules: list[Rule] = []
        cidrs: list[IPNetwork] = []
        for entry in (e for item in items for e in _entries(item)):
            try:
                if "/" in entry or as_ip(entry.strip("[]")) is not None:
                    cidrs.append(self._narrow_cidr(entry))
                else:
                    rules.append(self._narrow_rule(entry))
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
        if not rules and not cidrs:
            return EgressPolicy("", deny, exact=self.exact)
        kept = cidrs if cidrs else list(self.allow_cidrs)
        return EgressPolicy(
            ",".join(map(str, rules)), deny, ",".join(map(str, kept)), exact=self.exact
        )

    def _narrow_cidr(self, entry: str) -> IPNetwork:
        (network,) = parse_cidrs(entry.strip("[]"))
        if not any(_within(network, allowed) for allowed in self.allow_cidrs):
            raise PolicyViolationError(
                f"cannot widen the egress policy: {entry!r} is outside the allowed CIDRs"
            )
        return network

    def _narrow_rule(self, entry: str) -> Rule:
        rule = _parse_rule(entry)
        for port in sorted(rule.ports):
            if any(d.covers(rule) and d.port in (None, port) for d in self.deny_rules):
                raise PolicyViolationError(f"cannot widen the egress policy: {entry!r} is denied")
            if not any(a.covers(rule) and port in a.ports for a in self.allow_rules):
                raise PolicyViolationError(
                    f"cannot widen the egress policy: {entry!r} is not within the allowed rules"
                )
        return rule

    def describe(self) -> dict[str, Any]:
        """The policy as a JSON-ready dict (for doctor and health)."""
        return {
            "enabled": self.enabled,
            "allow": [str(rule) for rule in self.allow_rules],
            "deny": [str(rule) for rule in self.deny_rules],
            "allow_cidrs": [str(network) for network in self.allow_cidrs],
            "default_ports": sorted(DEFAULT_PORTS),
            "metadata_addresses": sorted(str(a) for a in METADATA_ADDRESSES),
        }


@dataclass
class EgressSettings:
    """What the egress proxy's supervisor needs besides a policy (from the settings)."""

    connect_timeout: float = 10.0
    idle_timeout: float = 120.0
    max_connections: int = 64  # per sandbox, at once
    max_bytes: int = 0  # per sandbox (execution or interpreter), both ways; 0: unbounded
    max_total: int = 1024  # through the proxy, at once
    resolvers: list[tuple[str, int]] = field(default_factory=list)
