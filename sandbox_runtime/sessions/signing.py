"""The cluster secret's proofs: HMAC signatures on replica-to-replica calls and their answers.

A proof binds the call to its target replica, its path, a time and a nonce. A verifier refuses
a proof that is not for it, older (or newer) than MAX_SKEW_SECONDS, or already seen: a copy of
a call taken from the network does nothing the second time, nor anywhere else.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time

MAX_SKEW_SECONDS = 30.0  # clocks of replicas agree to well within this (NTP)
MAX_REMEMBERED_NONCES = 200_000  # a verifier refuses rather than forget one still in its window


class SignatureError(Exception):
    """A message without a valid, fresh, first-seen proof."""


class ClockSkewError(SignatureError):
    """A proof dated too far from this replica's clock: the signer's clock differs from ours
    by `skew` seconds (positive: the signer's is ahead). Not a wrong secret."""

    def __init__(self, skew: float) -> None:
        self.skew = skew
        super().__init__(describe_skew(skew, "the signer's"))


def describe_skew(skew: float, whose: str, than: str = "this replica's") -> str:
    """'clocks differ by N s (...)': `whose` clock is `skew` seconds ahead of `than`."""
    direction = "ahead of" if skew > 0 else "behind"
    return (
        f"clocks differ by {abs(skew):.0f} s ({whose} clock is {abs(skew):.1f} s {direction} "
        f"{than}; signed calls allow {MAX_SKEW_SECONDS:g} s): synchronise the replicas' "
        "clocks (NTP)"
    )


def key_id(secret: bytes) -> str:
    """A short public fingerprint of the secret: replicas compare it to spot a mismatch."""
    return hmac.new(secret, b"sandbox-runtime cluster key id", hashlib.sha256).hexdigest()[:16]


class ClusterSigner:
    """Signs and verifies with the cluster secret; remembers the nonces it has accepted."""

    def __init__(self, secret: str, replica_id: str) -> None:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 characters")
        self._key = secret.encode("utf-8", "surrogatepass")
        self.replica_id = replica_id
        self.key_id = key_id(self._key)
        self._seen: dict[str, float] = {}

    # -- generic ------------------------------------------------------------------------------

    def _mac(self, *parts: str | bytes) -> str:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
            mac.update(len(data).to_bytes(8, "big"))  # length-prefixed: no ambiguous joins
            mac.update(data)
        return mac.hexdigest()

    def _check_fresh(self, issued_at: float, nonce: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not math.isfinite(issued_at):
            raise SignatureError("a proof with a non-finite time")
        if not abs(now - issued_at) <= MAX_SKEW_SECONDS:
            raise ClockSkewError(issued_at - now)
        if not 16 <= len(nonce) <= 64:
            raise SignatureError("bad nonce")
        if nonce in self._seen:
            raise SignatureError("replayed proof")

    def _remember(self, nonce: str, issued_at: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if len(self._seen) >= MAX_REMEMBERED_NONCES:
            for old, expires in list(self._seen.items()):
                if expires < now:
                    del self._seen[old]
            if len(self._seen) >= MAX_REMEMBERED_NONCES:
                raise SignatureError("too many proofs in flight; refusing rather than forgetting")
        self._seen[nonce] = issued_at + 2 * MAX_SKEW_SECONDS

    # -- HTTP calls between replicas ------------------------------------------------------------

    def sign_call(self, target: str, path: str, body: bytes) -> str:
        """The signature header value for a POST of `body` to `path` on replica `target`."""
        issued_at = time.time()
        nonce = secrets.token_hex(16)
        digest = hashlib.sha256(body).hexdigest()
        mac = self._mac("call-v1", target, path, f"{issued_at:.6f}", nonce, digest)
        return f"v1,{issued_at:.6f},{nonce},{mac}"

    def check_call_header(self, header: str | None) -> tuple[str, float, str, str]:
        """The parts of a call's signature header (issued, issued_at, nonce, mac), if it is
        well formed, fresh and not seen before: checked before the body is read. Raises
        SignatureError."""
        if not header:
            raise SignatureError("unsigned call")
        try:
            version, issued, nonce, mac = header.split(",")
            issued_at = float(issued)
        except ValueError:
            raise SignatureError("malformed signature") from None
        if version != "v1":
            raise SignatureError("unknown signature version")
        self._check_fresh(issued_at, nonce)
        return issued, issued_at, nonce, mac

    def verify_call(self, header: str | None, path: str, body: bytes) -> str:
        """The call's nonce, if `header` proves the call was signed for this replica.

        Raises SignatureError.
        """
        issued, issued_at, nonce, mac = self.check_call_header(header)
        digest = hashlib.sha256(body).hexdigest()
        expected = self._mac("call-v1", self.replica_id, path, issued, nonce, digest)
        if not hmac.compare_digest(expected, mac):
            raise SignatureError("bad signature")
        self._remember(nonce, issued_at)
        return nonce

    def sign_answer(self, nonce: str, answer: bytes) -> str:
        """A proof that this replica sent `answer` to the call with `nonce`."""
        return self._mac("answer-v1", self.replica_id, nonce, answer)

    def verify_answer(self, home: str, nonce: str, answer: bytes, mac: str) -> None:
        """Raises SignatureError unless replica `home` sent `answer` to our call `nonce`."""
        if not hmac.compare_digest(self._mac("answer-v1", home, nonce, answer), mac):
            raise SignatureError("an answer without a valid proof")


def nonce_of(header: str) -> str:
    """The nonce of a call's signature header (made by sign_call)."""
    return header.split(",")[2]
