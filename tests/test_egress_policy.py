"""The egress policy: canonical hosts, authorities, rules, address vetting, narrowing."""

from __future__ import annotations

import ipaddress
import json
import platform
import random
import socket

import pytest

from sandbox_runtime.domain.egress import (
    DEFAULT_PORTS,
    METADATA_ADDRESSES,
    Decision,
    EgressDenied,
    EgressPolicy,
    Rule,
    canonical_host,
    is_ip,
    parse_authority,
    parse_cidrs,
    parse_rules,
    vet_address,
)
from sandbox_runtime.errors import InvalidRequestError, PolicyViolationError

pytestmark = pytest.mark.unit

# Names used here are reserved for examples (RFC 2606/6761): no test names a public host.
ALLOWED = "allowed.example"


def refused(raw: str) -> str:
    """The reason canonical_host gives for refusing `raw` (fails if it accepts it)."""
    with pytest.raises(EgressDenied) as info:
        canonical_host(raw)
    return info.value.reason


# --- canonical_host: IP literals ------------------------------------------------------------

LOOPBACK_SPELLINGS = [
    "127.0.0.1",
    "127.1",  # a.b: the last part fills 24 bits
    "127.0.1",  # a.b.c: the last part fills 16 bits
    "2130706433",  # one decimal number
    "0x7f000001",  # one hex number
    "0X7F000001",
    "0x7f.0.0.1",
    "0x7f.1",
    "0x7F.0x0.0x0.0x1",
    "0177.0.0.1",  # octal
    "0177.1",
    "017700000001",  # one octal number
    "00000000000177.0.0.1",  # octal with many leading zeros
    "0x7f.0.0.01",  # mixed hex, decimal, octal
    "0177.0x0.1",
    "127.0.0.1.",  # one trailing dot
    "2130706433.",
    "0x7f.1.",
]


@pytest.mark.parametrize("raw", LOOPBACK_SPELLINGS)
def test_every_ipv4_spelling_of_loopback_is_one_dotted_quad(raw: str) -> None:
    assert canonical_host(raw) == "127.0.0.1"
    assert is_ip(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("169.254.169.254", "169.254.169.254"),
        ("2852039166", "169.254.169.254"),
        ("0xa9fea9fe", "169.254.169.254"),
        ("0251.0376.0251.0376", "169.254.169.254"),
        ("169.254.43518", "169.254.169.254"),
        ("0xa9.0xfe.0xa9fe", "169.254.169.254"),
        ("0", "0.0.0.0"),
        ("0x0", "0.0.0.0"),
        ("00", "0.0.0.0"),
        ("4294967295", "255.255.255.255"),
        ("0xffffffff", "255.255.255.255"),
        ("10.1.2.3", "10.1.2.3"),
        ("10.66051", "10.1.2.3"),
        ("1.16777215", "1.255.255.255"),
        ("1.2.65535", "1.2.255.255"),
        ("8.8.8.8", "8.8.8.8"),
    ],
)
def test_ipv4_spellings_normalise(raw: str, expected: str) -> None:
    assert canonical_host(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        "256.0.0.1",  # a part over 255
        "1.256.0.1",
        "1.2.3.256",
        "1.2.65536",  # the last part over its 16 bits
        "1.16777216",  # over 24 bits
        "4294967296",  # over 32 bits
        "0x100000000",
        "1.2.3.4.5",  # five parts
        "08.1.1.1",  # 8 and 9 are not octal digits
        "0179.0.0.1",
        "0x.1",  # "0x" with no digits
        "1.0x",
        "0x",
        "0xg.1",
        "example.123",  # a numeric last label makes it an address attempt, never a name
        "allowed.example.0x7f",
        "a.b.c.1",
        "1..1",
        ".1.2.3",
    ],
)
def test_numeric_looking_hosts_that_are_no_valid_address_are_refused(raw: str) -> None:
    assert refused(raw) == "bad_host"
    assert not is_ip(raw)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="compares with glibc's inet_aton")
def test_ipv4_reading_agrees_with_inet_aton_on_random_spellings() -> None:
    """Whatever glibc's resolver would read as an address, we read as the same address."""

    def aton(text: str) -> str | None:
        try:
            return socket.inet_ntoa(socket.inet_aton(text))
        except OSError:
            return None

    rng = random.Random(15)
    checked = 0
    for _ in range(20000):
        raw = "".join(rng.choice("0123456789abcdefxX.") for _ in range(rng.randint(1, 14)))
        stripped = raw[:-1] if raw.endswith(".") else raw
        expected = aton(stripped) if stripped else None
        try:
            got: str | None = canonical_host(raw)
        except EgressDenied:
            got = None
        if expected is not None:
            checked += 1
            assert got == expected, raw
        elif got is not None:  # accepted: then only as a name, never as an address
            assert not is_ip(got), raw
            assert not got.split(".")[-1].isdigit(), raw
    assert checked > 1000


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("[::1]", "::1"),
        ("[0:0:0:0:0:0:0:1]", "::1"),
        ("[::]", "::"),
        ("[::ffff:127.0.0.1]", "::ffff:7f00:1"),
        ("[0:0:0:0:0:ffff:7f00:1]", "::ffff:7f00:1"),
        ("[::FFFF:7F00:0001]", "::ffff:7f00:1"),
        ("[0000:0000:0000:0000:0000:ffff:7f00:0001]", "::ffff:7f00:1"),
        ("[::ffff:169.254.169.254]", "::ffff:a9fe:a9fe"),
        ("[::127.0.0.1]", "::7f00:1"),
        ("[64:ff9b::127.0.0.1]", "64:ff9b::7f00:1"),
        ("[2002:7f00:1::]", "2002:7f00:1::"),
        ("[FD00:EC2::254]", "fd00:ec2::254"),
        ("[2001:DB8:0:0:1:0:0:1]", "2001:db8::1:0:0:1"),
        ("::1", "::1"),  # bare: accepted so that canonical output is a fixed point
        ("::ffff:7f00:1", "::ffff:7f00:1"),
    ],
)
def test_ipv6_literals_normalise_to_the_compressed_form(raw: str, expected: str) -> None:
    assert canonical_host(raw) == expected
    assert is_ip(raw)


@pytest.mark.parametrize(
    "raw",
    [
        "[::1%eth0]",  # zone ids
        "[fe80::1%25eth0]",
        "[fe80::1%1]",
        "[::1",
        "::1]",
        "[]",
        "[127.0.0.1]",  # brackets are for IPv6 only
        "[::ffff:127.1]",  # the embedded IPv4 part must be a dotted quad
        "[::ffff:0x7f.0.0.1]",
        "[1:2:3:4:5:6:7:8:9]",
        "[::1::2]",
        "[:::1]",
        "[12345::1]",
        "[::1].",
        "[[::1]]",
        "[ ::1]",
        "[::g]",
    ],
)
def test_malformed_ipv6_literals_are_refused(raw: str) -> None:
    assert refused(raw) == "bad_host"


# --- canonical_host: names ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("allowed.example", ALLOWED),
        ("ALLOWED.EXAMPLE", ALLOWED),
        ("Allowed.Example.", ALLOWED),  # one trailing dot stripped
        ("localhost", "localhost"),
        ("a", "a"),
        ("_dmarc.allowed.example", "_dmarc.allowed.example"),
        ("a-b.c-d.example", "a-b.c-d.example"),
        ("xn--80ak6aa92e.example", "xn--80ak6aa92e.example"),  # punycode is just a name
        ("XN--80AK6AA92E.example", "xn--80ak6aa92e.example"),
        ("1.2.3.example", "1.2.3.example"),  # numeric labels are fine before the last one
        ("0x7f.example", "0x7f.example"),
        ("example.1a", "example.1a"),
        ("deadbeef", "deadbeef"),  # hex without 0x is not a number to inet_aton
        ("1e3", "1e3"),
    ],
)
def test_names_are_lowercased_with_one_trailing_dot_stripped(raw: str, expected: str) -> None:
    assert canonical_host(raw) == expected
    assert not is_ip(raw)


LONG_LABEL = "a" * 63


@pytest.mark.parametrize(
    "raw",
    [
        "",
        ".",
        "..",
        "allowed.example..",  # two trailing dots
        ".allowed.example",
        "allowed..example",
        "allowed@evil.example",  # userinfo
        "allowed.example@evil.example",
        "user:pass@allowed.example",
        "allowed.example%00",
        "allowed.example%2eevil",
        "allowed.example\x00.evil",
        "allowed.example\r\nHost: evil",
        "allowed.example\n",
        "\rallowed.example",
        "allowed.example\t",
        " allowed.example",
        "allowed.example ",
        "allowed example",
        "allowed.example/evil",
        "allowed.example\\evil",
        "allowed.example?x",
        "allowed.example#x",
        "allowed.example;x",
        "allowed,example",
        "allowed.example:80",  # a port is not part of a host
        "*.allowed.example",  # wildcards belong to rules
        "-allowed.example",
        "allowed-.example",
        "allowed.-example",
        "allowed.\u00e9xample",  # non-ASCII
        "\u0430llowed.example",  # a Cyrillic a
        "allowed.example\u3002",  # ideographic full stop
        "allowed\uff0eexample",  # fullwidth full stop
        "allowed.example\u200b",  # zero-width space
        "\uff41llowed.example",  # fullwidth 'a'
        LONG_LABEL + "a.example",  # a 64-character label
        ".".join([LONG_LABEL] * 4),  # 255 characters
        "a" * 10_000,
    ],
)
def test_malformed_names_are_refused(raw: str) -> None:
    assert refused(raw) == "bad_host"
    assert not is_ip(raw)


def test_length_limits_are_exact() -> None:
    assert canonical_host(LONG_LABEL + ".example") == LONG_LABEL + ".example"
    name_253 = ".".join([LONG_LABEL] * 3 + ["a" * 61])
    assert len(name_253) == 253
    assert canonical_host(name_253) == name_253
    assert canonical_host(name_253 + ".") == name_253  # the trailing dot is not counted
    assert refused(name_253 + "a") == "bad_host"


def test_refusals_are_policy_violations_with_a_safe_message() -> None:
    with pytest.raises(PolicyViolationError) as info:
        canonical_host("evil\r\nX-Injected: 1" + "a" * 500)
    assert isinstance(info.value, EgressDenied)
    assert info.value.reason == "bad_host"
    assert "\r" not in str(info.value) and "\n" not in str(info.value)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("raw", [None, 2130706433, b"allowed.example"])
def test_non_strings_are_refused(raw: object) -> None:
    assert refused(raw) == "bad_host"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw",
    [
        *LOOPBACK_SPELLINGS,
        "ALLOWED.EXAMPLE.",
        "[::ffff:127.0.0.1]",
        "[0:0:0:0:0:0:0:1]",
        "xn--80ak6aa92e.example",
    ],
)
def test_the_canonical_form_is_a_fixed_point(raw: str) -> None:
    once = canonical_host(raw)
    assert canonical_host(once) == once


# --- parse_authority ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("authority", "default", "expected"),
    [
        ("allowed.example:443", None, (ALLOWED, 443)),
        ("ALLOWED.example.:8080", None, (ALLOWED, 8080)),
        ("allowed.example", 80, (ALLOWED, 80)),
        ("allowed.example:1", None, (ALLOWED, 1)),
        ("allowed.example:65535", None, (ALLOWED, 65535)),
        ("allowed.example:00443", None, (ALLOWED, 443)),  # five decimal digits
        ("127.1:80", None, ("127.0.0.1", 80)),
        ("2130706433:443", None, ("127.0.0.1", 443)),
        ("0x7f000001", 443, ("127.0.0.1", 443)),
        ("[::1]:443", None, ("::1", 443)),
        ("[::ffff:127.0.0.1]:80", None, ("::ffff:7f00:1", 80)),
        ("[::1]", 443, ("::1", 443)),
    ],
)
def test_authorities_split_into_canonical_host_and_port(
    authority: str, default: int | None, expected: tuple[str, int]
) -> None:
    assert parse_authority(authority, default) == expected


@pytest.mark.parametrize(
    "authority",
    [
        "allowed.example:0",
        "allowed.example:65536",
        "allowed.example:99999",
        "allowed.example:000443",  # six digits
        "allowed.example:+80",
        "allowed.example:-1",
        "allowed.example: 80",
        "allowed.example:80 ",
        "allowed.example:8 0",
        "allowed.example:0x50",
        "allowed.example:1e3",
        "allowed.example:80.0",
        "allowed.example:",  # an empty port
        "allowed.example:\u0668\u0660",  # Arabic-Indic digits
        "allowed.example:\uff18\uff10",  # fullwidth digits
        "allowed.example:80\r\n",
        "[::1]:",
        "[::1]:0",
        "[::1]:65536",
        "[::1]:443]",
    ],
)
def test_bad_ports_are_refused(authority: str) -> None:
    with pytest.raises(EgressDenied) as info:
        parse_authority(authority, 443)
    assert info.value.reason == "bad_port"


@pytest.mark.parametrize(
    "authority",
    [
        "",
        ":443",
        "allowed@evil.example:443",
        "allowed.example@evil.example:443",
        "user:pass@allowed.example:443",
        "allowed.example%00:443",
        "allowed.example\r\n:443",
        " allowed.example:443",
        "allowed.example.evil\x00:443",
        "::1:443",  # IPv6 needs brackets in an authority
        "::1",
        "fe80::1%eth0:443",
        "[::1]x",
        "[::1]443",
        "[::1%eth0]:443",
        "[::1:443",
        "allowed.example:443:443",
        "allowed.example..:443",
        "\u00e5llowed.example:443",
        "a" * 400 + ":443",
    ],
)
def test_bad_hosts_in_authorities_are_refused(authority: str) -> None:
    with pytest.raises(EgressDenied) as info:
        parse_authority(authority, 443)
    assert info.value.reason == "bad_host"


@pytest.mark.parametrize("default", [None, 0, 65536])
def test_a_missing_port_needs_a_valid_default(default: int | None) -> None:
    with pytest.raises(EgressDenied) as info:
        parse_authority("allowed.example", default)
    assert info.value.reason == "bad_port"


# --- rules ----------------------------------------------------------------------------------


def test_rules_parse_names_wildcards_and_ports() -> None:
    rules = parse_rules(" Pypi.Org , *.Files.Example.:443,allowed.example:8080,, ")
    assert rules == [
        Rule("pypi.org"),
        Rule("files.example", wildcard=True, port=443),
        Rule(ALLOWED, port=8080),
    ]
    assert [str(r) for r in rules] == ["pypi.org", "*.files.example:443", f"{ALLOWED}:8080"]
    assert rules[0].ports == DEFAULT_PORTS == frozenset({80, 443})
    assert rules[1].ports == frozenset({443})


def test_rules_are_deduplicated_in_order_and_round_trip() -> None:
    text = "b.example,a.example,B.example.,*.c.example:1,*.c.example:1"
    rules = parse_rules(text)
    assert [str(r) for r in rules] == ["b.example", "a.example", "*.c.example:1"]
    assert parse_rules(",".join(map(str, rules))) == rules


@pytest.mark.parametrize("text", ["", " ", ",", " , ,"])
def test_empty_rule_lists(text: str) -> None:
    assert parse_rules(text) == []


@pytest.mark.parametrize(
    "entry",
    [
        "*",
        "*.",
        "*.*.example",
        "**.example",
        "a*.example",
        "*example",
        "allowed.*.example",
        "allowed.example.*",
        "127.0.0.1",  # IP literals are CIDRs, not names
        "127.1",
        "2130706433",
        "0x7f000001:80",
        "[::1]",
        "[::1]:443",
        "::1",
        "*.127.0.0.1",
        "*.1",
        "10.0.0.0/8",
        "allowed.example:0",
        "allowed.example:65536",
        "allowed.example:+80",
        "allowed.example:",
        ":443",
        "allowed.example:http",
        "allowed@evil.example",
        "allowed.example/path",
        "http://allowed.example",
        "allowed example",
        "allowed.example..",
        "\u0430llowed.example",
        "a" * 64 + ".example",
    ],
)
def test_bad_rules_raise_value_error_naming_the_entry(entry: str) -> None:
    with pytest.raises(ValueError, match="egress rule") as info:
        parse_rules(f"good.example,{entry}")
    assert repr(entry.strip()) in str(info.value)


@pytest.mark.parametrize(
    ("rule", "host", "expected"),
    [
        ("allowed.example", "allowed.example", True),
        ("allowed.example", "sub.allowed.example", False),  # exact names are exact
        ("allowed.example", "allowed.example.evil", False),
        ("allowed.example", "evil-allowed.example", False),
        ("allowed.example", "evilallowed.example", False),
        ("*.allowed.example", "sub.allowed.example", True),
        ("*.allowed.example", "a.b.c.allowed.example", True),
        ("*.allowed.example", "allowed.example", False),  # strict subdomains only
        ("*.allowed.example", "evil-allowed.example", False),
        ("*.allowed.example", "evilallowed.example", False),
        ("*.allowed.example", "allowed.example.evil", False),
        ("*.allowed.example", "sub.allowed.example.evil", False),
        ("*.allowed.example", "allowed.example.sub.allowed.evil", False),
        ("*.example", "allowed.example", True),
        ("*.example", "example", False),
    ],
)
def test_name_matching(rule: str, host: str, expected: bool) -> None:
    (parsed,) = parse_rules(rule)
    assert parsed.matches_name(host) is expected
    assert EgressPolicy(rule).check_name(host, 443).allowed is expected


# --- CIDRs ----------------------------------------------------------------------------------


def test_cidrs_parse_with_bare_addresses_as_single_hosts() -> None:
    nets = parse_cidrs(" 10.1.2.0/24, fd00::/8 ,192.0.2.7, ::1,10.1.2.0/24,")
    assert [str(n) for n in nets] == ["10.1.2.0/24", "fd00::/8", "192.0.2.7/32", "::1/128"]
    assert parse_cidrs("") == []


@pytest.mark.parametrize(
    "entry",
    [
        "10.1.2.3/24",  # host bits set
        "10.1.2.0/33",
        "127.1",
        "127.1/32",
        "2130706433",
        "0x7f000001",
        "010.1.2.0/24",
        "fe80::/10%eth0",
        "fe80::1%eth0",
        "allowed.example",
        "10.1.2.0/",
        "/24",
        "10.1.2.0 /24",
        "[::1]",
    ],
)
def test_bad_cidrs_raise_value_error_naming_the_entry(entry: str) -> None:
    with pytest.raises(ValueError, match="egress CIDR") as info:
        parse_cidrs(f"10.0.0.0/8,{entry}")
    assert repr(entry) in str(info.value)


# --- check_name -----------------------------------------------------------------------------


@pytest.fixture
def policy() -> EgressPolicy:
    return EgressPolicy(
        allow="allowed.example, *.files.example, api.example:8443, *.internal.example",
        deny="secret.internal.example, *.admin.internal.example, files.example, "
        "dl.files.example:80",
        allow_cidrs="10.1.2.0/24, fd00:1::/64",
    )


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        # the default ports of a portless rule
        ("allowed.example", 443, Decision(True, ALLOWED, 443)),
        ("allowed.example", 80, Decision(True, ALLOWED, 80)),
        ("allowed.example", 8080, Decision(False, ALLOWED, 8080, "port_not_allowed")),
        ("allowed.example", 22, Decision(False, ALLOWED, 22, "port_not_allowed")),
        # spellings of an allowed name are the allowed name
        ("ALLOWED.EXAMPLE", 443, Decision(True, ALLOWED, 443)),
        ("allowed.example.", 443, Decision(True, ALLOWED, 443)),
        ("Allowed.Example.", 80, Decision(True, ALLOWED, 80)),
        # look-alikes are not
        ("allowed.example.evil", 443, Decision(False, "allowed.example.evil", 443, "not_allowed")),
        ("evil-allowed.example", 443, Decision(False, "evil-allowed.example", 443, "not_allowed")),
        ("sub.allowed.example", 443, Decision(False, "sub.allowed.example", 443, "not_allowed")),
        ("allowed@evil", 443, Decision(False, "allowed@evil", 443, "bad_host")),
        ("allowed.example..", 443, Decision(False, "allowed.example..", 443, "bad_host")),
        ("allowed.example%00", 443, Decision(False, "allowed.example%00", 443, "bad_host")),
        ("allowed.example\r\n", 443, Decision(False, "allowed.example\r\n", 443, "bad_host")),
        ("\u0430llowed.example", 443, Decision(False, "\u0430llowed.example", 443, "bad_host")),
        # an explicit port is the only port
        ("api.example", 8443, Decision(True, "api.example", 8443)),
        ("api.example", 443, Decision(False, "api.example", 443, "port_not_allowed")),
        ("api.example", 80, Decision(False, "api.example", 80, "port_not_allowed")),
        # wildcards: strict subdomains; deny rules win
        ("dl.files.example", 443, Decision(True, "dl.files.example", 443)),
        ("dl.files.example", 80, Decision(False, "dl.files.example", 80, "denied")),
        ("files.example", 443, Decision(False, "files.example", 443, "denied")),
        ("a.b.internal.example", 443, Decision(True, "a.b.internal.example", 443)),
        ("secret.internal.example", 443, Decision(False, "secret.internal.example", 443, "denied")),
        ("SECRET.internal.example.", 80, Decision(False, "secret.internal.example", 80, "denied")),
        # a portless deny rule denies every port, checked before the port
        ("secret.internal.example", 22, Decision(False, "secret.internal.example", 22, "denied")),
        (
            "x.admin.internal.example",
            443,
            Decision(False, "x.admin.internal.example", 443, "denied"),
        ),
        ("admin.internal.example", 443, Decision(True, "admin.internal.example", 443)),
        # bad ports
        ("allowed.example", 0, Decision(False, ALLOWED, 0, "bad_port")),
        ("allowed.example", 65536, Decision(False, ALLOWED, 65536, "bad_port")),
        ("allowed.example", -443, Decision(False, ALLOWED, -443, "bad_port")),
    ],
)
def test_check_name(policy: EgressPolicy, host: str, port: int, expected: Decision) -> None:
    assert policy.check_name(host, port) == expected


def test_a_bool_is_not_a_port(policy: EgressPolicy) -> None:
    assert policy.check_name(ALLOWED, True).reason == "bad_port"


@pytest.mark.parametrize("host", [*LOOPBACK_SPELLINGS, "[::1]", "[::ffff:127.0.0.1]", "[::]"])
def test_ip_literals_outside_the_cidrs_are_not_allowed(policy: EgressPolicy, host: str) -> None:
    decision = policy.check_name(host, 443)
    assert not decision.allowed
    assert decision.reason == "not_allowed"
    assert decision.host in {"127.0.0.1", "::1", "::ffff:7f00:1", "::"}


@pytest.mark.parametrize(
    ("host", "expected_host"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("10.66051", "10.1.2.3"),
        ("0xa010203", "10.1.2.3"),
        ("012.1.2.3", "10.1.2.3"),
        ("[fd00:1::5]", "fd00:1::5"),
        ("[FD00:1:0:0::5]", "fd00:1::5"),
    ],
)
def test_ip_literals_inside_the_cidrs_are_allowed_on_any_port(
    policy: EgressPolicy, host: str, expected_host: str
) -> None:
    for port in (80, 443, 3141):
        assert policy.check_name(host, port) == Decision(True, expected_host, port)


def test_an_ipv4_mapped_literal_needs_an_ipv6_cidr(policy: EgressPolicy) -> None:
    decision = policy.check_name("[::ffff:10.1.2.3]", 443)
    assert decision == Decision(False, "::ffff:a01:203", 443, "not_allowed")


def test_an_ip_literal_in_a_cidr_is_still_vetted_for_metadata() -> None:
    policy = EgressPolicy("", allow_cidrs="169.254.0.0/16, fd00:ec2::/32")
    for host in ("169.254.169.254", "2852039166", "0xa9fea9fe", "[fd00:ec2::254]"):
        decision = policy.check_name(host, 80)
        assert (decision.allowed, decision.reason) == (False, "metadata_address"), host
    assert policy.check_name("169.254.1.1", 80).allowed


def test_names_are_decided_without_cidrs() -> None:
    policy = EgressPolicy("", allow_cidrs="10.0.0.0/8")
    assert policy.enabled
    assert policy.check_name(ALLOWED, 443).reason == "not_allowed"
    assert policy.check_name("10.0.0.1", 443).allowed


@pytest.mark.parametrize("host", [ALLOWED, "127.0.0.1", "bad host"])
def test_an_empty_policy_is_no_network(host: str) -> None:
    policy = EgressPolicy("", deny="allowed.example")
    assert not policy.enabled
    decision = policy.check_name(host, 443)
    assert not decision.allowed
    assert decision.reason in {"egress_disabled", "bad_host"}


def test_bad_settings_raise_value_error() -> None:
    with pytest.raises(ValueError, match="egress rule"):
        EgressPolicy("127.0.0.1")
    with pytest.raises(ValueError, match="egress rule"):
        EgressPolicy(ALLOWED, deny="*")
    with pytest.raises(ValueError, match="egress CIDR"):
        EgressPolicy(ALLOWED, allow_cidrs="10.1.2.3/24")


# --- vet_address ----------------------------------------------------------------------------

REFUSED_V4 = [
    "127.0.0.1",
    "127.255.255.254",
    "0.0.0.0",
    "0.1.2.3",
    "10.0.0.1",
    "10.255.255.255",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.1.1",
    "169.254.0.1",
    "169.254.169.253",
    "100.64.0.1",
    "100.127.255.255",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "192.0.0.8",
    "192.0.0.170",
    "192.0.2.1",
    "198.51.100.1",
    "203.0.113.1",
    "198.18.0.1",
    "198.19.255.255",
    "192.88.99.1",
]
PUBLIC_V4 = (
    "8.8.8.8 1.1.1.1 172.15.255.255 172.32.0.0 100.63.255.255 100.128.0.0 192.169.0.1 "
    "11.0.0.1 126.255.255.255 128.0.0.1 223.255.255.255 169.253.255.255 169.255.0.0"
).split()


@pytest.mark.parametrize("address", REFUSED_V4)
def test_internal_ipv4_addresses_are_refused(address: str) -> None:
    assert vet_address(address) == "private_address"
    assert vet_address(ipaddress.IPv4Address(address)) == "private_address"


@pytest.mark.parametrize("address", PUBLIC_V4)
def test_public_ipv4_addresses_pass(address: str) -> None:
    assert vet_address(address) is None


@pytest.mark.parametrize(
    "address",
    [
        "::1",
        "::",
        "fe80::1",
        "febf:ffff::1",
        "fc00::1",
        "fd12:3456::1",
        "ff02::1",
        "ff0e::1",
        "fec0::1",  # site-local (deprecated)
        "100::1",  # discard-only
        "2001:db8::1",  # documentation
        "3fff::1",
        "2001::1",  # Teredo: refused outright, whatever it embeds
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        "2001:2::1",  # benchmarking
        "2001:20::1",  # ORCHIDv2
        "64:ff9b:1::808:808",  # local-use NAT64: refused outright
        "4000::1",  # reserved, outside 2000::/3
        "fe80::1%eth0",  # scoped
        "2606:4700::1%1",
    ],
)
def test_internal_ipv6_addresses_are_refused(address: str) -> None:
    assert vet_address(address) == "private_address"


@pytest.mark.parametrize("address", ["2606:4700::1111", "2a00:1450::1", "2400::1"])
def test_public_ipv6_addresses_pass(address: str) -> None:
    assert vet_address(address) is None
    assert vet_address(ipaddress.IPv6Address(address)) is None


def _embeddings(v4: str) -> list[str]:
    """Every IPv6 form that carries `v4`: mapped, compatible, NAT64, 6to4 (two hosts)."""
    n = int(ipaddress.IPv4Address(v4))
    return [
        str(ipaddress.IPv6Address((0xFFFF << 32) | n)),
        f"::ffff:{v4}",
        f"::{v4}",
        f"64:ff9b::{v4}",
        str(ipaddress.IPv6Address((0x2002 << 112) | (n << 80))),
        str(ipaddress.IPv6Address((0x2002 << 112) | (n << 80) | 0x1234)),
    ]


@pytest.mark.parametrize("v4", ["127.0.0.1", "10.0.0.1", "192.168.0.1", "100.64.0.1", "0.0.0.0"])
@pytest.mark.parametrize("form", range(6))
def test_ipv6_forms_embedding_internal_ipv4_are_refused(v4: str, form: int) -> None:
    assert vet_address(_embeddings(v4)[form]) == "private_address"


@pytest.mark.parametrize("form", range(6))
def test_ipv6_forms_embedding_the_metadata_address_are_metadata(form: int) -> None:
    assert vet_address(_embeddings("169.254.169.254")[form]) == "metadata_address"


@pytest.mark.parametrize(
    ("form", "expected"),
    [(0, None), (1, None), (2, "private_address"), (3, None), (4, None), (5, None)],
)
def test_ipv6_forms_embedding_public_ipv4_follow_it(form: int, expected: str | None) -> None:
    # The deprecated IPv4-compatible form (::a.b.c.d) is never dialled.
    assert vet_address(_embeddings("8.8.8.8")[form]) == expected


def test_teredo_embedding_the_metadata_address_is_metadata() -> None:
    # Teredo: server 169.254.169.254, client obfuscated (bits inverted) in the last 32 bits.
    server = int(ipaddress.IPv4Address("169.254.169.254"))
    client = int(ipaddress.IPv4Address("8.8.8.8")) ^ 0xFFFFFFFF
    teredo = ipaddress.IPv6Address((0x20010000 << 96) | (server << 64) | client)
    assert teredo.teredo is not None
    assert vet_address(teredo) == "metadata_address"


def test_the_metadata_addresses_include_aws_gcp_and_azure() -> None:
    assert {"169.254.169.254", "fd00:ec2::254"} <= {str(a) for a in METADATA_ADDRESSES}


@pytest.mark.parametrize("address", sorted(map(str, METADATA_ADDRESSES)))
def test_metadata_addresses_are_refused_even_inside_a_wide_cidr(address: str) -> None:
    wide = EgressPolicy("", allow_cidrs="0.0.0.0/0, ::/0")
    assert vet_address(address) == "metadata_address"
    assert wide.vet_address(address) == "metadata_address"
    exact = EgressPolicy("", allow_cidrs=f"0.0.0.0/0, {address}")
    assert exact.vet_address(address) is None


@pytest.mark.parametrize(
    "cidrs", ["169.254.169.254/31", "169.254.169.0/24", "fd00:ec2::254/127", "fd00:ec2::/64"]
)
def test_only_a_single_address_cidr_names_a_metadata_address(cidrs: str) -> None:
    policy = EgressPolicy("", allow_cidrs=cidrs)
    (network,) = policy.allow_cidrs
    metadata = next(a for a in METADATA_ADDRESSES if a in network)
    assert policy.vet_address(metadata) == "metadata_address"
    assert policy.check_name(f"[{metadata}]" if metadata.version == 6 else str(metadata), 80) == (
        Decision(False, str(metadata), 80, "metadata_address")
    )
    neighbour = metadata + 1
    assert neighbour in network
    assert policy.vet_address(neighbour) is None


def test_metadata_inside_an_ipv6_cidr_is_still_refused_through_its_embeddings() -> None:
    wide = EgressPolicy("", allow_cidrs="::/0, 0.0.0.0/0")
    for address in _embeddings("169.254.169.254"):
        assert wide.vet_address(address) == "metadata_address", address
    exact = EgressPolicy("", allow_cidrs="169.254.169.254")
    assert exact.vet_address("::ffff:169.254.169.254") is None  # mapped: the same destination


def test_allowed_cidrs_permit_otherwise_refused_addresses() -> None:
    policy = EgressPolicy("mirror.internal.example", allow_cidrs="10.1.2.0/24, fd00:1::/64")
    assert policy.vet_address("10.1.2.3") is None
    assert policy.vet_address(ipaddress.IPv4Address("10.1.2.255")) is None
    assert policy.vet_address("10.1.3.1") == "private_address"
    assert policy.vet_address("127.0.0.1") == "private_address"
    assert policy.vet_address("fd00:1::1") is None
    assert policy.vet_address("fd00:2::1") == "private_address"
    # IPv6 forms of a permitted IPv4 address go where it goes, except the compatible form
    assert policy.vet_address("::ffff:10.1.2.3") is None
    assert policy.vet_address("64:ff9b::10.1.2.3") is None
    assert policy.vet_address("::10.1.2.3") == "private_address"
    assert vet_address("10.1.2.3", policy) is None
    assert vet_address("10.1.2.3") == "private_address"


def test_a_loopback_cidr_permits_loopback() -> None:
    policy = EgressPolicy("", allow_cidrs="127.0.0.0/8, ::1")
    assert policy.vet_address("127.0.0.1") is None
    assert policy.vet_address("::1") is None
    assert policy.vet_address("::ffff:127.0.0.1") is None


@pytest.mark.parametrize("address", ["", "127.1", "2130706433", "localhost", "::1::", "[::1]", 5])
def test_unparseable_addresses_are_refused(address: object) -> None:
    assert vet_address(address) == "bad_address"  # type: ignore[arg-type]


# --- narrowing ------------------------------------------------------------------------------


@pytest.fixture
def wide() -> EgressPolicy:
    return EgressPolicy(
        allow="pypi.org, *.pythonhosted.example, allowed.example:8080, "
        "allowed.example:443, *.internal.example",
        deny="secret.internal.example, *.admin.internal.example:443",
        allow_cidrs="10.1.0.0/16, fd00:1::/48",
    )


@pytest.mark.parametrize("request_", [False, None, [], "", " , "])
def test_narrowing_to_nothing_is_no_network(wide: EgressPolicy, request_: object) -> None:
    narrowed = wide.narrow(request_)  # type: ignore[arg-type]
    assert not narrowed.enabled
    assert narrowed.check_name("pypi.org", 443).reason == "egress_disabled"
    assert narrowed.check_name("10.1.2.3", 443).reason == "egress_disabled"
    assert narrowed.deny_rules == wide.deny_rules


def test_narrowing_with_true_keeps_the_policy(wide: EgressPolicy) -> None:
    assert wide.narrow(True) is wide


@pytest.mark.parametrize(
    "request_",
    [
        ["pypi.org"],
        "pypi.org",
        ["PyPI.org."],
        ["pypi.org:443"],
        ["pypi.org:80", "pypi.org:443"],
        "files.pythonhosted.example, *.pythonhosted.example",
        ["*.cdn.pythonhosted.example"],
        ["allowed.example:8080"],
        ["allowed.example:443"],
        ["a.internal.example"],
        ["*.internal.example"],  # overlaps deny rules, which carry over
        ["admin.internal.example"],
        ["x.admin.internal.example:80"],  # the deny rule names port 443 only
        ["10.1.2.0/24"],
        ["10.1.0.0/16"],
        ["10.1.2.3"],
        ["fd00:1:0:2::/64", "[fd00:1::1]"],
    ],
)
def test_subsets_narrow(wide: EgressPolicy, request_: str | list[str]) -> None:
    before = wide.describe()
    narrowed = wide.narrow(request_)
    assert wide.describe() == before  # narrowing leaves the original alone
    assert narrowed.enabled
    assert narrowed.deny_rules == wide.deny_rules
    for rule in narrowed.allow_rules:  # every allowed name and port was allowed before
        for port in rule.ports:
            assert any(a.covers(rule) and port in a.ports for a in wide.allow_rules)
            host = "x." + rule.name if rule.wildcard else rule.name
            assert narrowed.check_name(host, port).allowed == wide.check_name(host, port).allowed
    for network in narrowed.allow_cidrs:
        assert any(
            network.version == a.version and network.subnet_of(a)  # type: ignore[arg-type]
            for a in wide.allow_cidrs
        )


def test_a_narrowed_policy_allows_only_what_was_asked(wide: EgressPolicy) -> None:
    narrowed = wide.narrow(["pypi.org:443"])
    assert narrowed.check_name("pypi.org", 443).allowed
    assert narrowed.check_name("pypi.org", 80).reason == "port_not_allowed"
    assert narrowed.check_name("files.pythonhosted.example", 443).reason == "not_allowed"
    assert narrowed.check_name("allowed.example", 8080).reason == "not_allowed"
    # without CIDRs asked for, the allowed ranges carry over (an allowed name may resolve there)
    assert narrowed.allow_cidrs == wide.allow_cidrs
    assert narrowed.vet_address("10.1.2.3") is None
    # a wildcard narrowing keeps deny rules in force
    internal = wide.narrow(["*.internal.example"])
    assert internal.check_name("a.internal.example", 443).allowed
    assert internal.check_name("secret.internal.example", 443).reason == "denied"
    assert internal.check_name("x.admin.internal.example", 443).reason == "denied"


def test_narrowing_cidrs_replaces_them(wide: EgressPolicy) -> None:
    narrowed = wide.narrow(["pypi.org", "10.1.2.0/24"])
    assert [str(n) for n in narrowed.allow_cidrs] == ["10.1.2.0/24"]
    assert narrowed.check_name("10.1.2.3", 443).allowed
    assert narrowed.check_name("10.1.3.3", 443).reason == "not_allowed"
    assert narrowed.vet_address("10.1.3.3") == "private_address"
    assert narrowed.vet_address("fd00:1::1") == "private_address"
    only_ip = wide.narrow("10.1.2.3")
    assert only_ip.enabled and only_ip.allow_rules == ()
    assert only_ip.check_name("pypi.org", 443).reason == "not_allowed"


@pytest.mark.parametrize(
    "entry",
    [
        "evil.example",
        "pypi.org.evil",
        "sub.pypi.org",  # an exact rule does not cover subdomains
        "*.pypi.org",
        "pythonhosted.example",  # a wildcard does not cover its own suffix
        "*.example",  # nor a wider wildcard
        "evil-pythonhosted.example",
        "pypi.org:8080",  # nor other ports
        "pypi.org:22",
        "allowed.example",  # 80 and 443, but only 443 (and 8080) are allowed
        "allowed.example:80",
        "secret.internal.example",  # denied
        "secret.internal.example:8443",
        "x.admin.internal.example",  # denied on 443
        "*.admin.internal.example:443",
        "10.2.0.0/16",  # outside the CIDRs
        "10.0.0.0/8",
        "10.0.0.0/15",
        "127.0.0.1",
        "169.254.169.254",
        "0.0.0.0/0",
        "fd00::/8",
        "::1",
        "[::ffff:10.1.2.3]",
    ],
)
def test_widening_is_a_policy_violation_naming_the_entry(wide: EgressPolicy, entry: str) -> None:
    for request_ in ([entry], ["pypi.org", entry], f"pypi.org,{entry}"):
        with pytest.raises(PolicyViolationError, match="cannot widen the egress policy") as info:
            wide.narrow(request_)
        assert repr(entry) in str(info.value)
        assert not isinstance(info.value, InvalidRequestError)


def test_a_narrowed_policy_cannot_be_widened_back(wide: EgressPolicy) -> None:
    narrowed = wide.narrow(["pypi.org:443", "10.1.2.0/24"])
    assert narrowed.narrow(["pypi.org:443"]).check_name("pypi.org", 443).allowed
    for entry in ("pypi.org", "pypi.org:80", "files.pythonhosted.example", "10.1.3.0/24"):
        with pytest.raises(PolicyViolationError, match="cannot widen"):
            narrowed.narrow([entry])


def test_a_disabled_policy_cannot_be_widened() -> None:
    disabled = EgressPolicy("")
    assert not disabled.narrow(None).enabled
    with pytest.raises(PolicyViolationError, match="cannot widen"):
        disabled.narrow(["allowed.example"])
    with pytest.raises(PolicyViolationError, match="cannot widen"):
        disabled.narrow(["10.0.0.1"])


@pytest.mark.parametrize(
    "request_",
    [
        ["*"],
        ["pypi.org:0"],
        ["127.1"],  # non-standard IP spellings are neither names nor CIDRs
        ["2130706433"],
        ["allowed@evil.example"],
        ["10.1.2.3/24"],
        [5],
        [None],
        {"pypi.org": True},
        5,
        b"pypi.org",
    ],
)
def test_malformed_narrowing_requests_are_invalid(wide: EgressPolicy, request_: object) -> None:
    with pytest.raises(InvalidRequestError):
        wide.narrow(request_)  # type: ignore[arg-type]


# --- describe -------------------------------------------------------------------------------


def test_describe_is_json_ready_and_reproduces_the_policy(wide: EgressPolicy) -> None:
    described = wide.describe()
    assert json.loads(json.dumps(described)) == described
    assert described["enabled"] is True
    assert described["allow"] == [
        "pypi.org",
        "*.pythonhosted.example",
        "allowed.example:8080",
        "allowed.example:443",
        "*.internal.example",
    ]
    assert described["deny"] == ["secret.internal.example", "*.admin.internal.example:443"]
    assert described["allow_cidrs"] == ["10.1.0.0/16", "fd00:1::/48"]
    assert described["default_ports"] == [80, 443]
    assert "169.254.169.254" in described["metadata_addresses"]
    rebuilt = EgressPolicy(
        ",".join(described["allow"]),
        ",".join(described["deny"]),
        ",".join(described["allow_cidrs"]),
    )
    assert rebuilt.describe() == described
    assert "pypi.org" in repr(wide)
    assert EgressPolicy("").describe()["enabled"] is False
