"""ClusterSigner: proofs on replica-to-replica calls (forwarded calls, control, file
transfers) and their answers; the errors replicas answer with, by name."""

from __future__ import annotations

import json
import time

import pytest

from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.sessions import signing
from sandbox_runtime.sessions.answers import ERRORS, error_reply, raise_error_reply
from sandbox_runtime.sessions.channel import CALL_PATH, CONTROL_PATH, FILES_PREFIX
from sandbox_runtime.sessions.signing import (
    MAX_SKEW_SECONDS,
    ClockSkewError,
    ClusterSigner,
    SignatureError,
    nonce_of,
)

pytestmark = pytest.mark.unit

SECRET = "a-cluster-secret-of-some-length"
OTHER_SECRET = "another-cluster-secret-entirely"
PATH = "/cluster/v1/execute"
BODY = b'{"command": "echo hi", "session": "s:one"}'


def signer(replica_id: str = "a", secret: str = SECRET) -> ClusterSigner:
    return ClusterSigner(secret, replica_id)


def signed_at(monkeypatch: pytest.MonkeyPatch, when: float) -> str:
    """A call header signed for replica "a" by a clock reading `when`."""
    with monkeypatch.context() as m:
        m.setattr(signing.time, "time", lambda: when)
        return signer("b").sign_call("a", PATH, BODY)


# -- the secret --------------------------------------------------------------------------------


def test_secret_under_sixteen_characters_is_refused() -> None:
    with pytest.raises(ValueError, match="16 characters"):
        ClusterSigner("x" * 15, "a")
    with pytest.raises(ValueError):
        ClusterSigner("", "a")
    assert ClusterSigner("x" * 16, "a").replica_id == "a"


def test_key_id_is_equal_for_equal_secrets_only() -> None:
    assert signer("a").key_id == signer("b").key_id == signer("c", SECRET).key_id
    assert signer("a").key_id != signer("a", OTHER_SECRET).key_id
    assert signer("a", SECRET + "x").key_id != signer("a").key_id
    key_id = signer().key_id
    assert len(key_id) == 16 and int(key_id, 16) >= 0
    assert key_id not in SECRET


# -- calls between replicas --------------------------------------------------------------------


def test_call_signed_for_a_replica_verifies_there() -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    signer("a").verify_call(header, PATH, BODY)


def test_call_signed_by_the_same_replica_instance_verifies_on_another_instance() -> None:
    header = signer("a").sign_call("a", PATH, BODY)
    signer("a").verify_call(header, PATH, BODY)


def test_call_with_another_secret_is_refused() -> None:
    header = signer("b", OTHER_SECRET).sign_call("a", PATH, BODY)
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").verify_call(header, PATH, BODY)


def test_call_for_another_replica_is_refused() -> None:
    header = signer("b").sign_call("c", PATH, BODY)
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").verify_call(header, PATH, BODY)
    signer("c").verify_call(header, PATH, BODY)


def test_call_with_a_changed_body_is_refused() -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    verifier = signer("a")
    for body in (BODY + b" ", BODY.replace(b"echo", b"rm -rf"), b""):
        with pytest.raises(SignatureError, match="bad signature"):
            verifier.verify_call(header, PATH, body)


def test_call_to_another_path_is_refused() -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").verify_call(header, "/cluster/v1/cancel", BODY)


def test_replayed_call_is_refused() -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    verifier = signer("a")
    verifier.verify_call(header, PATH, BODY)
    with pytest.raises(SignatureError, match="replayed"):
        verifier.verify_call(header, PATH, BODY)


def test_refused_forgery_does_not_spend_the_genuine_calls_nonce() -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    verifier = signer("a")
    with pytest.raises(SignatureError):
        verifier.verify_call(header, PATH, b"tampered")
    verifier.verify_call(header, PATH, BODY)


def test_stale_call_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    header = signed_at(monkeypatch, time.time() - MAX_SKEW_SECONDS - 5)
    with pytest.raises(ClockSkewError, match=r"clocks differ by 3\d s .* behind this") as err:
        signer("a").verify_call(header, PATH, BODY)
    assert -MAX_SKEW_SECONDS - 6 < err.value.skew < -MAX_SKEW_SECONDS - 4


def test_future_dated_call_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    header = signed_at(monkeypatch, time.time() + MAX_SKEW_SECONDS + 5)
    with pytest.raises(ClockSkewError, match=r"clocks differ by 3\d s .* ahead of this"):
        signer("a").verify_call(header, PATH, BODY)


def test_call_within_the_clock_skew_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    signer("a").verify_call(signed_at(monkeypatch, time.time() - 10), PATH, BODY)
    signer("a").verify_call(signed_at(monkeypatch, time.time() + 10), PATH, BODY)


def test_call_with_a_restamped_time_is_refused() -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    version, issued, nonce, mac = header.split(",")
    restamped = ",".join([version, f"{float(issued) + 1:.6f}", nonce, mac])
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").verify_call(restamped, PATH, BODY)


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        "v1,not-a-time,0123456789abcdef0123456789abcdef,mac",
        "v1,1.0,nonce",
        "v1,1.0,nonce,mac,extra",
        ",,,",
    ],
)
def test_malformed_call_header_is_refused(header: str) -> None:
    with pytest.raises(SignatureError, match="malformed"):
        signer("a").verify_call(header, PATH, BODY)


def test_call_header_of_an_unknown_version_is_refused() -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    with pytest.raises(SignatureError, match="version"):
        signer("a").verify_call("v2" + header[2:], PATH, BODY)


@pytest.mark.parametrize("issued", ["nan", "inf", "-inf"])
def test_call_with_a_non_finite_time_is_refused(issued: str) -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    version, _, nonce, mac = header.split(",")
    with pytest.raises(SignatureError, match="non-finite"):
        signer("a").verify_call(",".join([version, issued, nonce, mac]), PATH, BODY)


@pytest.mark.parametrize("nonce", ["short", "x" * 65])
def test_call_with_a_bad_nonce_is_refused(nonce: str) -> None:
    header = signer("b").sign_call("a", PATH, BODY)
    version, issued, _, mac = header.split(",")
    with pytest.raises(SignatureError, match="nonce"):
        signer("a").verify_call(",".join([version, issued, nonce, mac]), PATH, BODY)


@pytest.mark.parametrize("header", [None, ""])
def test_unsigned_call_is_refused(header: str | None) -> None:
    with pytest.raises(SignatureError, match="unsigned"):
        signer("a").verify_call(header, PATH, BODY)


# -- answers and paths of the one cluster transport -------------------------------------------


def test_answer_proof_binds_the_answering_replica_and_the_calls_nonce() -> None:
    header = signer("b").sign_call("a", CALL_PATH, BODY)
    nonce = signer("a").verify_call(header, CALL_PATH, BODY)
    assert nonce == nonce_of(header)
    mac = signer("a").sign_answer(nonce, b'{"result": {}}')
    caller = signer("b")
    caller.verify_answer("a", nonce, b'{"result": {}}', mac)
    for home, answer_nonce, answer in (
        ("c", nonce, b'{"result": {}}'),  # another replica's answer
        ("a", "f" * 32, b'{"result": {}}'),  # the answer to another call
        ("a", nonce, b'{"result": {"x": 1}}'),  # a changed answer
    ):
        with pytest.raises(SignatureError, match="answer"):
            caller.verify_answer(home, answer_nonce, answer, mac)
    with pytest.raises(SignatureError):
        caller.verify_answer(
            "a",
            nonce,
            b'{"result": {}}',
            signer("a", OTHER_SECRET).sign_answer(nonce, b'{"result": {}}'),
        )


def test_a_forwarded_call_is_no_control_request_nor_a_file_transfer() -> None:
    """One transport, several paths: a proof made for one path is refused on the others."""
    body = json.dumps({"op": "cancel", "execution_id": "e1", "force": True}).encode()
    for signed_for, sent_to in (
        (CALL_PATH, CONTROL_PATH),
        (CONTROL_PATH, CALL_PATH),
        (FILES_PREFIX + "t/x", CONTROL_PATH),
    ):
        header = signer("b").sign_call("a", signed_for, body)
        with pytest.raises(SignatureError, match="bad signature"):
            signer("a").verify_call(header, sent_to, body)


def test_file_transfer_proof_covers_the_method() -> None:
    path = FILES_PREFIX + "token/name.txt"
    header = signer("b").sign_call("a", path, b"GET")
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").verify_call(header, path, b"PUT")
    signer("a").verify_call(header, path, b"GET")


# -- errors answered by name -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_an_error_answered_by_a_replica_is_raised_again_as_itself(name: str) -> None:
    reply = json.loads(json.dumps(error_reply(ERRORS[name]("the reason"))))
    with pytest.raises(ERRORS[name], match="the reason") as raised:
        raise_error_reply(reply)
    assert type(raised.value) is ERRORS[name]


def test_an_unknown_error_name_is_the_root_error() -> None:
    with pytest.raises(SandboxRuntimeError, match="odd") as raised:
        raise_error_reply({"error": "KeyboardInterrupt", "message": "odd"})
    assert type(raised.value) is SandboxRuntimeError
    with pytest.raises(SandboxRuntimeError, match="refused"):
        raise_error_reply({})
