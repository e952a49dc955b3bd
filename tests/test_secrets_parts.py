"""The parts of secrets at the proxy, each on its own: rules, the encrypted store, masking,
what a hosted server's `secret:NAME` becomes, the deployment CA's files."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import ssl
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
from cryptography import x509

from sandbox_runtime.config import Settings
from sandbox_runtime.domain.secrets import SecretsGrant, masks, narrow, parse_rules_document
from sandbox_runtime.egress import ca, http1
from sandbox_runtime.egress.request import Refused
from sandbox_runtime.egress.secrets import SecretsBroker, settings_problem
from sandbox_runtime.egress.secrets_store import SecretsKeyError, SecretsStore, load_key, make_key
from sandbox_runtime.errors import InvalidRequestError, PolicyViolationError
from sandbox_runtime.servers.catalog import parse_entry
from sandbox_runtime.servers.launch import environment

RULES = {
    "rule": [
        {"name": "openai", "hosts": ["api.example.com"],
         "headers": {"Authorization": "Bearer {{secret:openai}}"}},
        {"name": "index", "secret": "pypi", "hosts": ["*.pkg.example.com:443"],
         "basic": "__token__", "methods": ["GET"], "paths": ["/simple/"],
         "principals": ["alice"]},
    ]
}  # fmt: skip


def test_rules_bind_hosts_ports_methods_and_paths() -> None:
    openai, index = parse_rules_document(RULES)
    assert openai.binds("api.example.com", 443) and openai.binds("api.example.com", 80)
    assert not openai.binds("evil.example.com", 443) and not openai.binds("api.example.com", 8443)
    assert index.binds("a.pkg.example.com", 443) and not index.binds("pkg.example.com", 443)
    assert not index.binds("a.pkg.example.com", 80)
    # In clear only to a port the rule names; never to 443.
    assert not openai.binds("api.example.com", 80, tls=False)
    assert not openai.binds("api.example.com", 443, tls=False)
    (plain,) = parse_rules_document(
        {"rule": [{"name": "p", "hosts": ["in.example:80", "in.example:443"], "basic": "u"}]}
    )
    assert plain.binds("in.example", 80, tls=False) and plain.binds("in.example", 443)
    assert not plain.binds("in.example", 443, tls=False)
    assert index.applies("GET", "/simple/x/") and not index.applies("POST", "/simple/x/")
    assert not index.applies("GET", "/upload")
    assert not index.applies("GET", "/simple/../upload")
    assert not index.applies("GET", "/simple/%2e%2e/upload")
    # Dot segments an origin still finds: with a path parameter (Tomcat and Spring read
    # `..;x` as `..`), or encoded twice (an origin or a proxy behind it that decodes again).
    for path in ("/simple/..;/upload", "/simple/..;x=1/upload", "/simple/%2e%2e%3b/upload",
                 "/simple/%252e%252e/upload", "/simple/%252E%252E%252Fupload"):  # fmt: skip
        assert not index.applies("GET", path), path
    assert index.applies("GET", "/simple/a;b/") and index.applies("GET", "/simple/a%20b/")
    assert openai.render("sk-1234") == [("Authorization", "Bearer sk-1234")]
    assert index.render("tok-1234") == [("Authorization", "Basic X190b2tlbl9fOnRvay0xMjM0")]


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ({"name": "a", "hosts": []}, "hosts is empty"),
        ({"name": "a", "hosts": ["x.com"], "headers": {"Host": "{{secret:a}}"}}, "cannot be set"),
        ({"name": "a", "hosts": ["x.com"], "headers": {"X": "{{secret:b}}"}}, "must use"),
        ({"name": "a", "hosts": ["10.0.0.1"], "basic": "u"}, "IP literals"),
        ({"name": "a", "hosts": ["x.com"]}, "give headers or basic"),
        ({"name": "a", "hosts": ["x.com"], "basic": "u", "colour": 1}, "unknown keys"),
    ],
)
def test_bad_rules_say_what_is_wrong(rule: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_rules_document({"rule": [rule]})


def test_a_caller_narrows_never_widens() -> None:
    rules = parse_rules_document(RULES)
    assert [r.name for r in narrow(rules, ["pypi"])] == ["index"]
    assert narrow(rules, []) == []
    with pytest.raises(PolicyViolationError, match="may only narrow"):
        narrow(rules, ["github"])


def test_the_store_keeps_ciphertext_only_and_knows_its_key(tmp_path: Path) -> None:
    key = load_key(make_key(), None)
    store = SecretsStore(tmp_path / "store.json", key)
    store.set("openai", "sk-default-value")
    store.set("openai", "sk-bob-value", principal="bob")
    text = (tmp_path / "store.json").read_text()
    assert "sk-default-value" not in text and "sk-bob-value" not in text
    assert (tmp_path / "store.json").stat().st_mode & 0o777 == 0o600
    assert store.value("openai", "bob") == "sk-bob-value"
    assert store.value("openai", "alice") == "sk-default-value"  # (no value of her own)
    assert store.value("github", "alice") is None
    # A ciphertext moved to another principal does not open.
    document = json.loads(text)
    document["secrets"][0]["principal"] = "carol"
    (tmp_path / "store.json").write_text(json.dumps(document))
    with pytest.raises(SecretsKeyError):
        SecretsStore(tmp_path / "store.json", key).value("openai", "carol")
    other = SecretsStore(tmp_path / "store.json", load_key(make_key(), None))
    with pytest.raises(SecretsKeyError, match="another key"):
        other.value("openai", "bob")


def test_rekey_moves_every_secret_to_the_new_key(tmp_path: Path) -> None:
    old, new = load_key(make_key(), None), load_key(make_key(), None)
    assert new is not None
    SecretsStore(tmp_path / "s.json", old).set("openai", "sk-value-1")
    assert SecretsStore(tmp_path / "s.json", old).rekey(new) == 1
    assert SecretsStore(tmp_path / "s.json", new).value("openai", "") == "sk-value-1"
    with pytest.raises(SecretsKeyError):
        SecretsStore(tmp_path / "s.json", old).value("openai", "")


def test_values_that_cannot_be_headers_are_refused(tmp_path: Path) -> None:
    store = SecretsStore(tmp_path / "s.json", load_key(make_key(), None))
    for bad in ("", "abc", "line\nbreak", "x" * 9000):
        with pytest.raises(InvalidRequestError) as caught:
            store.set("openai", bad)
        assert bad not in str(caught.value) or not bad
    with pytest.raises(SecretsKeyError, match="at least 32"):
        load_key("short", None)


def test_masking_catches_a_secret_split_across_every_boundary() -> None:
    secret = b"sk-0123456789abcdef"
    body = b"before " + secret + b" middle " + secret + b" after"
    for size in range(1, len(body) + 1):
        masker = http1.Masker([secret])
        parts = [body[i : i + size] for i in range(0, len(body), size)]
        out = b"".join(masker.feed(p) for p in parts) + masker.flush()
        assert out == body.replace(secret, b"*" * len(secret)), size
        assert len(masker.tail) == 0


def test_echoes_in_json_and_url_forms_are_masked() -> None:
    value = 'wJalr/XUtnF+EMI"K7MDE\\NG/bPxRfiCY'  # (an AWS-like key, a quote, a backslash)
    rule = parse_rules_document(
        {"rule": [{"name": "aws", "hosts": ["x.com"], "headers": {"X-Key": "{{secret:aws}}"}}]}
    )[0]
    masker = http1.Masker(masks(value, rule.render(value)))
    as_json = json.dumps({"got": value})
    echoes = [as_json, as_json.replace("/", "\\/"), "/cb?key=" + urllib.parse.quote(value, safe="")]
    for echo in echoes:
        shown = (masker.feed(echo.encode()) + masker.flush()).decode()
        assert shown.count("*") >= len(value), shown
        assert "wJalr" not in shown and "bPxRfiCY" not in shown, shown


async def test_a_chunked_response_is_masked_across_chunks() -> None:
    secret = b"sk-0123456789abcdef"
    payload = b"x" * 5 + secret + b"y" * 5
    raw = b"".join(b"%x\r\n%s\r\n" % (1, payload[i : i + 1]) for i in range(len(payload)))
    reader = asyncio.StreamReader()
    reader.feed_data(raw + b"0\r\n\r\n")
    reader.feed_eof()
    sink: list[bytes] = []

    class Writer:
        def write(self, data: bytes) -> None:
            sink.append(data)

        async def drain(self) -> None:
            return None

    await http1.copy_body(
        reader,
        Writer(),
        ("chunked", 0),
        lambda n: True,
        5,
        http1.Masker([secret]),  # type: ignore[arg-type]
    )
    decoded, rest = b"", b"".join(sink)
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        decoded, rest = decoded + rest[:size], rest[size + 2 :]
    assert decoded == payload.replace(secret, b"*" * len(secret))


async def test_a_chunk_size_line_over_the_readers_limit_is_a_refusal() -> None:
    # Not an exception the proxy does not expect (which cost a traceback in the server's log
    # per connection, and a plain-text 502 written into the TLS stream).
    for raw in (b"0" * 100 + b"1\r\nx\r\n0\r\n\r\n", b"1\r\nx\r\n0\r\n" + b"t" * 100):
        reader = asyncio.StreamReader(limit=64)
        reader.feed_data(raw)
        reader.feed_eof()

        class Sink:
            def write(self, data: bytes) -> None:
                pass

            async def drain(self) -> None:
                return None

        with pytest.raises(Refused) as refused:
            await http1.copy_body(reader, Sink(), ("chunked", 0), lambda n: True, 5)  # type: ignore[arg-type]
        assert refused.value.reason == "bad_chunk"


def test_a_content_length_of_thousands_of_digits_is_a_refusal() -> None:
    huge = b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n"
    with pytest.raises(Refused) as refused:
        http1.request_framing(http1.parse(b"POST / HTTP/1.1\r\n" + huge))
    assert refused.value.reason == "bad_request"
    with pytest.raises(Refused) as refused:
        http1.response_framing("GET", 200, http1.parse(b"HTTP/1.1 200 OK\r\n" + huge))
    assert refused.value.reason == "bad_response"
    assert http1.request_framing(http1.parse(b"POST / HTTP/1.1\r\nContent-Length: 12\r\n\r\n")) == (
        "length",
        12,
    )


def _broker(tmp_path: Path) -> SecretsBroker:
    key = load_key(make_key(), None)
    store = SecretsStore(tmp_path / "store.json", key)
    store.set("openai", "sk-the-value")
    store.set("pypi", "pypi-the-value")
    return SecretsBroker(
        parse_rules_document(RULES), store, tmp_path / "ca", tmp_path / "trust", b""
    )


def test_a_hosted_server_gets_a_placeholder_where_the_proxy_injects(tmp_path: Path) -> None:
    broker = _broker(tmp_path)
    entry = parse_entry("s", {"command": ["x"], "egress": ["api.example.com"],
                              "secrets": {"OPENAI_API_KEY": "secret:openai",
                                          "PYPI": "secret:pypi"}})  # fmt: skip
    env = environment(entry, lambda name: broker.for_instance(name, "bob", list(entry.egress)))
    assert env["OPENAI_API_KEY"] == "{{secret:openai}}"  # (a rule binds its host: the proxy)
    assert env["PYPI"] == "pypi-the-value"  # (no rule for bob binds it: resolved for the env)


def test_the_ca_key_is_private_and_the_bundle_trusts_the_ca(tmp_path: Path) -> None:
    broker = _broker(tmp_path)
    assert (tmp_path / "ca").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    bundle = broker.bundle.read_bytes()
    assert broker.ca_cert in bundle and b"PRIVATE KEY" not in bundle
    leaves = ca.Leaves(broker.ca_cert, broker.ca_key)
    client = ssl.create_default_context(cafile=str(broker.bundle))
    server = leaves.context("api.example.com")
    # A handshake in memory: the sandbox's side trusts the leaf for that name.
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname="api.example.com")
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side, out, other_in in ((c, c_out, s_in), (s, s_out, c_in)):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            other_in.write(out.read())
    assert c.version() is not None
    grant = SecretsGrant("alice", names=("openai",))
    assert [b["rule"] for b in broker.bindings(grant)] == ["openai"]
    assert [b["rule"] for b in broker.bindings(SecretsGrant("bob"))] == ["openai"]


def _served_leaf(server: ssl.SSLContext, host: str) -> x509.Certificate:
    """The certificate `server` presents for `host` (a handshake in memory, not verified)."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=host)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side, out, other_in in ((c, c_out, s_in), (s, s_out, c_in)):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
            other_in.write(out.read())
    der = c.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_a_long_running_proxy_never_serves_an_expired_leaf(tmp_path: Path) -> None:
    # The leaves' contexts are cached: one kept in use for longer than a leaf lives must be
    # made again, or every handshake to that host fails once it expires.
    broker = _broker(tmp_path)
    now = [datetime.datetime.now(datetime.UTC)]
    leaves = ca.Leaves(broker.ca_cert, broker.ca_key, now=lambda: now[0])
    for _ in range(4 * ca.LEAF_DAYS):
        leaf = _served_leaf(leaves.context("api.example.com"), "api.example.com")
        assert leaf.not_valid_before_utc <= now[0] < leaf.not_valid_after_utc
        now[0] += datetime.timedelta(hours=12)


def test_rules_without_a_key_stop_the_start_with_one_line(tmp_path: Path) -> None:
    from sandbox_runtime.config import Settings
    from sandbox_runtime.egress.secrets import settings_problem

    rules = tmp_path / "secrets.toml"
    rules.write_text('[[rule]]\nname = "a"\nhosts = ["x.com"]\nbasic = "u"\n')
    settings = Settings(state_dir=tmp_path, secrets_rules=rules)  # type: ignore[call-arg]
    assert "no secrets key" in (settings_problem(settings) or "")
    keyed = Settings(state_dir=tmp_path, secrets_rules=rules, secrets_key=make_key())  # type: ignore[call-arg]
    assert settings_problem(keyed) is None
    rules.write_text('[[rule]]\nname = "a"\nhosts = []\n')
    assert "hosts is empty" in (settings_problem(keyed) or "")


def test_a_ca_that_cannot_be_made_stops_the_start_with_one_line(tmp_path: Path) -> None:
    rules = tmp_path / "secrets.toml"
    rules.write_text('[[rule]]\nname = "a"\nhosts = ["x.test"]\nbasic = "u"\n')
    (tmp_path / "file").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")} | {
        "SANDBOX_STATE_DIR": str(tmp_path / "state"),
        "SANDBOX_SECRETS_RULES": str(rules),
        "SANDBOX_SECRETS_KEY": make_key(),
        "SANDBOX_EGRESS_ALLOW": "x.test",
    }
    cases = {
        "cannot be made (Not a directory)": {"SANDBOX_EGRESS_CA_DIR": str(tmp_path / "file/ca")},
        "is not a PEM bundle": {"SANDBOX_EGRESS_UPSTREAM_CA_FILE": str(tmp_path / "file")},
        "No such file": {"SANDBOX_EGRESS_UPSTREAM_CA_FILE": str(tmp_path / "none.pem")},
    }
    for expected, extra in cases.items():
        done = subprocess.run(
            [sys.executable, "-m", "sandbox_runtime.cli", "--port", "0"],
            env=env | extra,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and expected in done.stderr, done.stderr
    # The hint, followed exactly: the CA made where it can be written, and the start goes on.
    made = tmp_path / "made-ca"
    settings = Settings(state_dir=tmp_path, secrets_rules=rules, secrets_key=make_key(),  # type: ignore[call-arg]
                        egress_allow="x.test", egress_ca_dir=made)  # fmt: skip
    assert settings_problem(settings) is None
    (made / "ca.pem").write_text("not a certificate")
    (made / "ca.key").write_text("")
    assert "is not a PEM certificate and key" in (settings_problem(settings) or "")
    (made / "ca.pem").unlink()  # (a start that stopped between the two files)
    assert "only one of ca.pem and ca.key" in (settings_problem(settings) or "")
