"""The cluster secret's proofs: HMAC signatures on replica-to-replica calls and their answers,
and on placement requests (sessions/queue.py).

A call's proof binds it to its target replica and that replica's incarnation (its process: a
restart is a new one), its method, path, body length, a time and a nonce, and, apart, its body.
A verifier checks the head's proof before it reads any of the body, and refuses a proof that is
not for it (nor for this process of it), older (or newer) than MAX_SKEW_SECONDS, or already
seen: a copy of a call taken from the network does nothing the second time, nor anywhere else,
nor after the target restarted (its nonces are in memory; the incarnation is new).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
import uuid
from dataclasses import dataclass

MAX_SKEW_SECONDS = 30.0  # clocks of replicas agree to well within this (NTP)
MAX_REMEMBERED_NONCES = 200_000  # a verifier refuses rather than forget one still in its window
MAX_HEADER_CHARS = 512  # a signature header is ~250 characters


class SignatureError(Exception):
    """A message without a valid, fresh, first-seen proof."""


class StaleIncarnationError(SignatureError):
    """A genuine proof made for another process of this replica (it restarted since the
    caller looked it up): the caller looks the replica up again."""


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

    def __init__(self, secret: str, replica_id: str, incarnation: str | None = None) -> None:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 characters")
        self._key = secret.encode("utf-8", "surrogatepass")
        self.replica_id = replica_id
        # This process among those that run as `replica_id` (the composition root gives it the
        # one in the heartbeat): proofs name it, so none made for an earlier process (whose
        # nonces died with it) is taken by this one.
        self.incarnation = incarnation or uuid.uuid4().hex
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

    def sign_call(
        self, target: str, incarnation: str, method: str, path: str, body: bytes | None
    ) -> str:
        """The signature header value for `method` `path` on replica `target`'s process
        `incarnation` (from its heartbeat) with `body` (None: a stream, its bytes unsigned).

        Two proofs: the head's (method, path, time, nonce, the body's length and the target's
        incarnation), checked before any byte of the body is read, and the body's (its digest,
        bound to the head's proof), checked once it has been read."""
        issued = f"{time.time():.6f}"
        nonce = secrets.token_hex(16)
        length = "-" if body is None else str(len(body))
        head = self._mac("call-v2", target, incarnation, method, path, issued, nonce, length)
        body_mac = (
            "-" if body is None else self._mac("body-v2", head, hashlib.sha256(body).digest())
        )
        return f"v2,{issued},{nonce},{incarnation},{length},{head},{body_mac}"

    def check_call_head(
        self, header: str | None, method: str, path: str, length: int | None
    ) -> CallProof:
        """The proof of a call to this process, from its header alone (`length`: the body's
        Content-Length; None: a stream): made with the cluster secret for this replica's
        current incarnation, fresh, not seen before. Checked before the body is read; the
        nonce is spent. Raises SignatureError (StaleIncarnationError, ClockSkewError)."""
        if not header or len(header) > MAX_HEADER_CHARS:
            raise SignatureError("unsigned call" if not header else "malformed signature")
        try:
            version, issued, nonce, incarnation, sent_length, head, body_mac = header.split(",")
            issued_at = float(issued)
        except ValueError:
            raise SignatureError("malformed signature") from None
        if version != "v2":
            raise SignatureError("unknown signature version")
        if sent_length != ("-" if length is None else str(length)):
            raise SignatureError("the signed length is not the body's")
        expected = self._mac(
            "call-v2", self.replica_id, incarnation, method, path, issued, nonce, sent_length
        )
        if not _same(expected, head):
            raise SignatureError("bad signature")
        # Genuine from here on: what is wrong with it can be told to the caller.
        if incarnation != self.incarnation:
            raise StaleIncarnationError(
                "a proof made for another process of this replica (an earlier one: it restarted)"
            )
        self._check_fresh(issued_at, nonce)
        self._remember(nonce, issued_at)
        return CallProof(nonce, head, body_mac)

    def check_call_body(self, proof: CallProof, body: bytes) -> None:
        """Raises SignatureError unless `body` is the one the head's proof was made with."""
        expected = self._mac("body-v2", proof.head, hashlib.sha256(body).digest())
        if proof.body_mac == "-" or not _same(expected, proof.body_mac):
            raise SignatureError("the body is not the one signed")

    # -- placement requests ---------------------------------------------------------------------

    def sign_placement(self, parts: tuple[str, ...]) -> str:
        """A proof that a replica with the secret put a placement request of these parts."""
        return self._mac("placement-v1", *parts)

    def verify_placement(self, parts: tuple[str, ...], mac: str) -> None:
        """Raises SignatureError unless `mac` is sign_placement's proof of `parts`."""
        if not _same(self._mac("placement-v1", *parts), mac):
            raise SignatureError("a placement request without a valid proof")

    def sign_answer(self, nonce: str, answer: bytes) -> str:
        """A proof that this replica sent `answer` to the call with `nonce`."""
        return self._mac("answer-v1", self.replica_id, nonce, answer)

    def verify_answer(self, home: str, nonce: str, answer: bytes, mac: str) -> None:
        """Raises SignatureError unless replica `home` sent `answer` to our call `nonce`."""
        if not _same(self._mac("answer-v1", home, nonce, answer), mac):
            raise SignatureError("an answer without a valid proof")


def _same(expected: str, given: str) -> bool:
    """Whether a MAC sent (any text: a header decoded latin-1, a field from Redis) is the one
    expected, in constant time. As bytes: compare_digest raises TypeError for a str that is
    not ASCII, which a forger chooses."""
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def nonce_of(header: str) -> str:
    """The nonce of a call's signature header (made by sign_call)."""
    return header.split(",")[2]


@dataclass(frozen=True)
class CallProof:
    """A call's proof whose head was found good: its nonce, head MAC and body MAC."""

    nonce: str
    head: str
    body_mac: str
