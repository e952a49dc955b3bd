"""Signed, expiring file URLs: one method on one path of one session's workspace.

A token is `base64url(payload).base64url(mac)`: the payload names the method, the session's
owner (principal and session), the path and the expiry; the MAC is HMAC-SHA256 over the
payload's exact bytes with a key derived from the deployment's secret, checked in constant
time before the payload is even parsed. No bearer token ever appears in a URL: the token
grants this one transfer and nothing else, until it expires.

The key: derived from SANDBOX_CLUSTER_SECRET when set (every replica can check every URL),
else SANDBOX_FILE_URL_SECRET, else a random key kept in `<state_dir>/file-url-key` (URLs then
outlive a restart of this one replica).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox_runtime.config import Settings
from sandbox_runtime.errors import SandboxRuntimeError

KEY_FILE = "file-url-key"
MAX_TOKEN_CHARS = 8192


class UrlRefusedError(SandboxRuntimeError):
    """A file URL that is not valid (tampered, expired, another method)."""


@dataclass(frozen=True)
class FileGrant:
    method: str
    principal: str
    session_id: str
    path: str
    expires_at: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class FileUrlSigner:
    """Makes and checks file URL tokens."""

    def __init__(self, key: bytes) -> None:
        self._key = hmac.new(key, b"sandbox-runtime file urls v1", hashlib.sha256).digest()

    def sign(self, method: str, principal: str, session_id: str, path: str, expires_at: int) -> str:
        payload = json.dumps(
            {"m": method, "p": principal, "s": session_id, "f": path, "e": int(expires_at)},
            separators=(",", ":"),
            ensure_ascii=True,
        ).encode()
        mac = hmac.new(self._key, payload, hashlib.sha256).digest()
        return f"{_b64(payload)}.{_b64(mac)}"

    def verify(self, token: str, method: str, now: float | None = None) -> FileGrant:
        """The grant `token` carries for `method`. Raises UrlRefusedError."""
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
            raise UrlRefusedError("malformed file URL")
        encoded, mac_text = token.split(".")
        try:
            payload, mac = _unb64(encoded), _unb64(mac_text)
        except (ValueError, TypeError):
            raise UrlRefusedError("malformed file URL") from None
        expected = hmac.new(self._key, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac):
            raise UrlRefusedError("this file URL's signature is not valid")
        try:
            fields = json.loads(payload)
            grant = FileGrant(
                method=str(fields["m"]),
                principal=str(fields["p"]),
                session_id=str(fields["s"]),
                path=str(fields["f"]),
                expires_at=int(fields["e"]),
            )
        except (ValueError, KeyError, TypeError):
            raise UrlRefusedError("malformed file URL") from None
        allowed = {grant.method, "HEAD"} if grant.method == "GET" else {grant.method}
        if method not in allowed:
            raise UrlRefusedError(f"this file URL is for {grant.method}, not {method}")
        if (time.time() if now is None else now) >= grant.expires_at:
            raise UrlRefusedError("this file URL has expired")
        return grant


def url_key(settings: Settings) -> bytes:
    """The key file URLs are signed with (see the module's docstring)."""
    if settings.cluster_secret is not None and settings.cluster_secret.get_secret_value():
        return settings.cluster_secret.get_secret_value().encode("utf-8", "surrogatepass")
    if settings.file_url_secret is not None and settings.file_url_secret.get_secret_value():
        return settings.file_url_secret.get_secret_value().encode("utf-8", "surrogatepass")
    return _stored_key(settings.state_dir / KEY_FILE)


def _stored_key(path: Path) -> bytes:
    with contextlib.suppress(FileNotFoundError):
        key = path.read_bytes()
        if len(key) >= 32:
            return key
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{KEY_FILE}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32))
    finally:
        os.close(fd)
    with contextlib.suppress(FileExistsError):
        os.link(temp, path)  # the first of several starting servers wins
    temp.unlink()
    return path.read_bytes()
