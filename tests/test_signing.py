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


INCARNATION = "0123456789abcdef0123456789abcdef"  # replica "a"'s process


def signer(
    replica_id: str = "a", secret: str = SECRET, incarnation: str = INCARNATION
) -> ClusterSigner:
    return ClusterSigner(secret, replica_id, incarnation)


def sign(by: ClusterSigner, target: str = "a", path: str = PATH, body: bytes | None = BODY) -> str:
    """A POST of `body` to `path` signed by `by` for replica `target`'s INCARNATION."""
    return by.sign_call(target, INCARNATION, "POST", path, body)


def verify(
    verifier: ClusterSigner, header: str | None, path: str = PATH, body: bytes = BODY
) -> str:
    """The head checked as the listener does (before the body), then the body: the nonce."""
    proof = verifier.check_call_head(header, "POST", path, len(body))
    verifier.check_call_body(proof, body)
    return proof.nonce


def signed_at(monkeypatch: pytest.MonkeyPatch, when: float) -> str:
    """A call header signed for replica "a" by a clock reading `when`."""
    with monkeypatch.context() as m:
        m.setattr(signing.time, "time", lambda: when)
        return sign(signer("b"))


def parts(header: str) -> list[str]:
    return header.split(",")


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
    verify(signer("a"), sign(signer("b")))


def test_call_signed_by_the_same_replica_instance_verifies_on_another_instance() -> None:
    verify(signer("a"), sign(signer("a")))


def test_call_with_another_secret_is_refused() -> None:
    with pytest.raises(SignatureError, match="bad signature"):
        verify(signer("a"), sign(signer("b", OTHER_SECRET)))


def test_call_for_another_replica_is_refused() -> None:
    header = sign(signer("b"), target="c")
    with pytest.raises(SignatureError, match="bad signature"):
        verify(signer("a"), header)
    verify(signer("c"), header)


def test_call_for_an_earlier_process_of_the_replica_is_refused() -> None:
    """A restart is a new incarnation: a proof made for the one before (its nonces died with
    it) is refused, told apart from a forgery."""
    header = sign(signer("b"))
    restarted = signer("a", incarnation="fedcba9876543210fedcba9876543210")
    with pytest.raises(signing.StaleIncarnationError, match="earlier"):
        verify(restarted, header)
    forged = parts(header)
    forged[3] = restarted.incarnation  # (renamed without the secret: the proof breaks)
    with pytest.raises(SignatureError, match="bad signature"):
        verify(restarted, ",".join(forged))


def test_a_signers_incarnation_is_its_own_unless_given() -> None:
    assert ClusterSigner(SECRET, "a").incarnation != ClusterSigner(SECRET, "a").incarnation


def test_call_with_a_changed_body_of_the_same_length_is_refused_after_reading_it() -> None:
    header = sign(signer("b"))
    verifier = signer("a")
    proof = verifier.check_call_head(header, "POST", PATH, len(BODY))  # (the head is genuine)
    for body in (BODY.replace(b"echo", b"true"), bytes(len(BODY))):
        with pytest.raises(SignatureError, match="not the one signed"):
            verifier.check_call_body(proof, body)


def test_call_with_another_length_is_refused_before_its_body_is_read() -> None:
    header = sign(signer("b"))
    for length in (len(BODY) + 1, len(BODY) - 1, 0, 16 * 2**20):
        with pytest.raises(SignatureError, match="length"):
            signer("a").check_call_head(header, "POST", PATH, length)
    relabelled = parts(header)
    relabelled[4] = str(16 * 2**20)  # (a forger's length: the head's proof breaks)
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").check_call_head(",".join(relabelled), "POST", PATH, 16 * 2**20)


def test_call_with_another_method_is_refused() -> None:
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").check_call_head(sign(signer("b")), "PUT", PATH, len(BODY))


def test_call_to_another_path_is_refused() -> None:
    with pytest.raises(SignatureError, match="bad signature"):
        verify(signer("a"), sign(signer("b")), "/cluster/v1/cancel")


def test_replayed_call_is_refused() -> None:
    header = sign(signer("b"))
    verifier = signer("a")
    verify(verifier, header)
    with pytest.raises(SignatureError, match="replayed"):
        verify(verifier, header)


def test_refused_forgery_does_not_spend_the_genuine_calls_nonce() -> None:
    header = sign(signer("b"))
    forged = parts(header)
    forged[5] = "0" * 64
    verifier = signer("a")
    with pytest.raises(SignatureError):
        verify(verifier, ",".join(forged))
    verify(verifier, header)


def test_stale_call_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    header = signed_at(monkeypatch, time.time() - MAX_SKEW_SECONDS - 5)
    with pytest.raises(ClockSkewError, match=r"clocks differ by 3\d s .* behind this") as err:
        verify(signer("a"), header)
    assert -MAX_SKEW_SECONDS - 6 < err.value.skew < -MAX_SKEW_SECONDS - 4


def test_future_dated_call_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    header = signed_at(monkeypatch, time.time() + MAX_SKEW_SECONDS + 5)
    with pytest.raises(ClockSkewError, match=r"clocks differ by 3\d s .* ahead of this"):
        verify(signer("a"), header)


def test_call_within_the_clock_skew_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    verify(signer("a"), signed_at(monkeypatch, time.time() - 10))
    verify(signer("a"), signed_at(monkeypatch, time.time() + 10))


def test_call_with_a_restamped_time_is_refused() -> None:
    restamped = parts(sign(signer("b")))
    restamped[1] = f"{float(restamped[1]) + 1:.6f}"
    with pytest.raises(SignatureError, match="bad signature"):
        verify(signer("a"), ",".join(restamped))


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        f"v2,not-a-time,0123456789abcdef0123456789abcdef,{INCARNATION},43,mac,mac",
        "v2,1.0,nonce",
        f"v2,1.0,nonce,{INCARNATION},43,mac,mac,extra",
        ",,,,,,,",
        "v2," + "x" * 600,
    ],
)
def test_malformed_call_header_is_refused(header: str) -> None:
    with pytest.raises(SignatureError, match="malformed"):
        verify(signer("a"), header)


def test_call_header_of_an_unknown_version_is_refused() -> None:
    with pytest.raises(SignatureError, match="version"):
        verify(signer("a"), "v1" + sign(signer("b"))[2:])


@pytest.mark.parametrize("issued", ["nan", "inf", "-inf"])
def test_call_with_a_non_finite_time_is_refused(issued: str) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(signing.time, "time", lambda: float(issued))
        header = sign(signer("b"))
    assert parts(header)[1] == issued
    with pytest.raises(SignatureError, match="non-finite"):
        verify(signer("a"), header)


@pytest.mark.parametrize("nonce", ["short", "x" * 65])
def test_call_with_a_bad_nonce_is_refused(nonce: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signing.secrets, "token_hex", lambda _: nonce)
    with pytest.raises(SignatureError, match="nonce"):
        verify(signer("a"), sign(signer("b")))


@pytest.mark.parametrize("header", [None, ""])
def test_unsigned_call_is_refused(header: str | None) -> None:
    with pytest.raises(SignatureError, match="unsigned"):
        verify(signer("a"), header)


# -- answers and paths of the one cluster transport -------------------------------------------


def test_answer_proof_binds_the_answering_replica_and_the_calls_nonce() -> None:
    header = sign(signer("b"), path=CALL_PATH)
    nonce = verify(signer("a"), header, CALL_PATH)
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
        header = sign(signer("b"), path=signed_for, body=body)
        with pytest.raises(SignatureError, match="bad signature"):
            verify(signer("a"), header, sent_to, body)


def test_file_transfer_proof_covers_the_method_and_signs_no_body() -> None:
    path = FILES_PREFIX + "token/name.txt"
    header = signer("b").sign_call("a", INCARNATION, "GET", path, None)
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").check_call_head(header, "PUT", path, None)
    with pytest.raises(SignatureError, match="length"):  # (a stream's proof is no POST's)
        signer("a").check_call_head(header, "GET", path, 0)
    proof = signer("a").check_call_head(header, "GET", path, None)
    with pytest.raises(SignatureError, match="not the one signed"):
        signer("a").check_call_body(proof, b"")


# -- placement requests ------------------------------------------------------------------------


def test_placement_proof_covers_every_part() -> None:
    fields = ("bob", "s:one", "srt:placement-reply:x", "1.5", "10", "api1")
    mac = signer("b").sign_placement(fields)
    signer("a").verify_placement(fields, mac)
    for i in range(len(fields)):
        changed = (*fields[:i], fields[i] + "x", *fields[i + 1 :])
        with pytest.raises(SignatureError, match="placement"):
            signer("a").verify_placement(changed, mac)
    with pytest.raises(SignatureError, match="placement"):
        signer("a", OTHER_SECRET).verify_placement(fields, mac)


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


# -- MACs that are not hex: a forger's choice --------------------------------------------------


NOT_ASCII = ["é" * 64, "\u00ff" * 64, "mac\u0100"]


@pytest.mark.parametrize("mac", NOT_ASCII)
def test_a_call_whose_head_mac_is_not_ascii_is_refused(mac: str) -> None:
    """(The header is decoded latin-1: any byte reaches the check.)"""
    fields = parts(sign(signer("b")))
    fields[5] = mac
    with pytest.raises(SignatureError, match="bad signature"):
        verify(signer("a"), ",".join(fields))


@pytest.mark.parametrize("mac", NOT_ASCII)
def test_a_call_whose_body_mac_is_not_ascii_is_refused(mac: str) -> None:
    fields = parts(sign(signer("b")))
    fields[6] = mac
    verifier = signer("a")
    proof = verifier.check_call_head(",".join(fields), "POST", PATH, len(BODY))
    with pytest.raises(SignatureError, match="not the one signed"):
        verifier.check_call_body(proof, BODY)


@pytest.mark.parametrize("mac", NOT_ASCII)
def test_a_placement_or_answer_whose_mac_is_not_ascii_is_refused(mac: str) -> None:
    with pytest.raises(SignatureError, match="placement"):
        signer("a").verify_placement(("bob", "s:one", "r", "1.5", "10", "api1"), mac)
    with pytest.raises(SignatureError, match="answer"):
        signer("b").verify_answer("a", "f" * 32, b"{}", mac)
