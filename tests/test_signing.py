"""ClusterSigner: proofs on replica-to-replica calls and control messages."""

from __future__ import annotations

import json
import time

import pytest

from sandbox_runtime.sessions import signing
from sandbox_runtime.sessions.signing import (
    MAX_SKEW_SECONDS,
    SIGNATURE_FIELD,
    ClockSkewError,
    ClusterSigner,
    SignatureError,
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


def message_signed_at(monkeypatch: pytest.MonkeyPatch, when: float) -> dict[str, object]:
    with monkeypatch.context() as m:
        m.setattr(signing.time, "time", lambda: when)
        return signer("b").sign_message("a", {"op": "cancel", "execution_id": "e1"})


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


# -- control messages --------------------------------------------------------------------------


def test_message_signed_for_a_replica_verifies_there() -> None:
    message = {"op": "stdin", "execution_id": "e1", "data": "héllo\n", "n": [1, 2.5, None]}
    signed = signer("b").sign_message("a", message)
    assert signed[SIGNATURE_FIELD] and signed["nonce"] and signed["issued_at"]
    assert {k: signed[k] for k in message} == message
    assert SIGNATURE_FIELD not in message, "the caller's dict is left alone"
    signer("a").verify_message(signed)


def test_message_survives_a_json_round_trip() -> None:
    signed = signer("b").sign_message("a", {"op": "stdin", "data": "é\u2028\"'\\", "x": 0.1})
    signer("a").verify_message(json.loads(json.dumps(signed)))


def test_message_with_a_tampered_field_is_refused() -> None:
    signed = signer("b").sign_message("a", {"op": "cancel", "execution_id": "e1"})
    verifier = signer("a")
    for tampered in (
        {**signed, "execution_id": "e2"},
        {**signed, "extra": True},
        {k: v for k, v in signed.items() if k != "op"},
        {**signed, "issued_at": signed["issued_at"] + 1},
        {**signed, "nonce": "f" * 32},
    ):
        with pytest.raises(SignatureError, match="bad signature"):
            verifier.verify_message(tampered)
    verifier.verify_message(signed)  # the refusals spent nothing


def test_message_with_another_secret_is_refused() -> None:
    signed = signer("b", OTHER_SECRET).sign_message("a", {"op": "cancel"})
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").verify_message(signed)


def test_replayed_message_is_refused() -> None:
    signed = signer("b").sign_message("a", {"op": "cancel"})
    verifier = signer("a")
    verifier.verify_message(signed)
    with pytest.raises(SignatureError, match="replayed"):
        verifier.verify_message(json.loads(json.dumps(signed)))


def test_message_for_another_replica_is_refused() -> None:
    signed = signer("b").sign_message("c", {"op": "cancel"})
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").verify_message(signed)
    signer("a").verify_message(signed, target="c")


def test_message_verified_for_an_explicit_target_refuses_others() -> None:
    signed = signer("b").sign_message("a", {"op": "cancel"})
    with pytest.raises(SignatureError, match="bad signature"):
        signer("a").verify_message(signed, target="c")


@pytest.mark.parametrize("missing", [SIGNATURE_FIELD, "nonce", "issued_at"])
def test_message_without_its_proof_is_refused(missing: str) -> None:
    signed = signer("b").sign_message("a", {"op": "cancel"})
    del signed[missing]
    with pytest.raises(SignatureError, match="unsigned"):
        signer("a").verify_message(signed)


@pytest.mark.parametrize(
    "field, value",
    [(SIGNATURE_FIELD, None), ("nonce", 12345), ("issued_at", "now"), ("issued_at", True)],
)
def test_message_with_a_mistyped_proof_is_refused(field: str, value: object) -> None:
    signed = signer("b").sign_message("a", {"op": "cancel"})
    signed[field] = value
    with pytest.raises(SignatureError, match="unsigned"):
        signer("a").verify_message(signed)


def test_plain_message_without_a_proof_is_refused() -> None:
    with pytest.raises(SignatureError, match="unsigned"):
        signer("a").verify_message({"op": "cancel", "execution_id": "e1"})


@pytest.mark.parametrize("not_a_message", [None, [], "text", 42])
def test_non_dict_message_is_refused(not_a_message: object) -> None:
    with pytest.raises(SignatureError, match="not a message"):
        signer("a").verify_message(not_a_message)  # type: ignore[arg-type]


def test_stale_message_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    signed = message_signed_at(monkeypatch, time.time() - MAX_SKEW_SECONDS - 5)
    with pytest.raises(ClockSkewError, match="clocks differ by 3"):
        signer("a").verify_message(signed)


def test_future_dated_message_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    signed = message_signed_at(monkeypatch, time.time() + MAX_SKEW_SECONDS + 5)
    with pytest.raises(ClockSkewError, match="clocks differ by 3"):
        signer("a").verify_message(signed)


def test_message_within_the_clock_skew_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    signer("a").verify_message(message_signed_at(monkeypatch, time.time() - 10))


def test_message_signing_replaces_a_forged_proof() -> None:
    signed = signer("b").sign_message(
        "a", {"op": "cancel", SIGNATURE_FIELD: "forged", "nonce": "n", "issued_at": 0}
    )
    assert signed[SIGNATURE_FIELD] != "forged" and signed["nonce"] != "n"
    assert signed["issued_at"] > 0
    signer("a").verify_message(signed)
