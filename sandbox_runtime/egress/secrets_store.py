"""The secrets store: values written once, kept encrypted, read only to hand to the proxy.

One JSON file (SANDBOX_SECRETS_STORE, default `<state_dir>/secrets.store.json`, mode 0600)
holds, per (principal, name), the value encrypted with AES-256-GCM under the operator's key
(SANDBOX_SECRETS_KEY or SANDBOX_SECRETS_KEY_FILE: any string of 32+ characters; `secrets
keygen` makes one), the principal and name bound in as associated data so a ciphertext cannot
be moved to another principal or name. The file holds no value in clear: replicas share it on
a shared filesystem (or a Kubernetes volume) with the key only in their environment.

Writers (`srt-mcp-server secrets set/rm`, the server's last-use marks) take an exclusive lock
on `<store>.lock` and replace the file atomically. Nothing here logs, returns or quotes a
value, except `value()`, which the egress supervisor calls to hand one to the proxy.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_runtime.domain.secrets import check_name, check_value
from sandbox_runtime.errors import InvalidRequestError

MIN_KEY = 32
MAX_SECRETS = 10_000
USE_MARK_SECONDS = 30.0  # a secret's last use is written at most this often


class SecretsKeyError(InvalidRequestError):
    """No key, a short key, or a key that does not open what is stored."""


def make_key() -> str:
    """A fresh random key (for `secrets keygen`)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode("ascii").rstrip("=")


def load_key(env_value: str | None, key_file: Path | None) -> bytes | None:
    """The operator's key (SANDBOX_SECRETS_KEY, else the file; None: none given). Raises
    SecretsKeyError for a short one or an unreadable file."""
    text = env_value
    if not text and key_file is not None:
        try:
            text = key_file.read_text().strip()
        except OSError as exc:
            raise SecretsKeyError(f"SANDBOX_SECRETS_KEY_FILE {key_file}: {exc.strerror}") from None
    if not text:
        return None
    if len(text) < MIN_KEY:
        raise SecretsKeyError(
            f"the secrets key must be at least {MIN_KEY} characters (make one with "
            "`srt-mcp-server secrets keygen`)"
        )
    return hashlib.sha256(b"srt-secrets-key-v1\0" + text.encode()).digest()


def _key_id(key: bytes) -> str:
    return hashlib.sha256(b"srt-secrets-key-id\0" + key).hexdigest()[:12]


def _aad(principal: str, name: str) -> bytes:
    return f"srt-secret\0{principal}\0{name}".encode()


@dataclass(frozen=True)
class SecretInfo:
    """What `list` shows of one secret: never its value."""

    principal: str  # "" for every principal's default
    name: str
    created_at: float
    last_used_at: float | None


class SecretsStore:
    """The encrypted file. `key` None: only `names` works (listing needs no key)."""

    def __init__(self, path: Path, key: bytes | None) -> None:
        self.path = path
        self._key = key
        self._cache: tuple[float, int, dict[str, Any]] | None = None
        self._marked: dict[tuple[str, str], float] = {}

    # -- file --------------------------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return {"version": 1, "secrets": []}
        if self._cache is not None and self._cache[:2] == (stat.st_mtime, stat.st_size):
            return self._cache[2]
        document = json.loads(self.path.read_text())
        if not isinstance(document, dict) or not isinstance(document.get("secrets"), list):
            raise InvalidRequestError(f"{self.path} is not a secrets store")
        self._cache = (stat.st_mtime, stat.st_size, document)
        return document

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The document, to change: written back (atomically, 0600) when the block ends."""
        # (the state dir, by default: made as the server would make it; the file is 0600)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        lock = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._cache = None
            document = self._read()
            yield document
            temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(document, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, self.path)
        finally:
            os.close(lock)

    def _need_key(self) -> bytes:
        if self._key is None:
            raise SecretsKeyError(
                "no secrets key: set SANDBOX_SECRETS_KEY or SANDBOX_SECRETS_KEY_FILE (make one "
                "with `srt-mcp-server secrets keygen`)"
            )
        return self._key

    # -- operations --------------------------------------------------------------------------

    def set(self, name: str, value: str, principal: str = "") -> None:
        """Store `value` as `name` (for `principal`; "" for every principal without one of
        its own). Raises InvalidRequestError, SecretsKeyError."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        check_name(name)
        if principal:
            check_name(principal, "principal")
        check_value(value)
        key = self._need_key()
        nonce = secrets.token_bytes(12)
        sealed = AESGCM(key).encrypt(nonce, value.encode(), _aad(principal, name))
        with self._locked() as document:
            entries = [e for e in document["secrets"]
                       if (e["principal"], e["name"]) != (principal, name)]  # fmt: skip
            if len(entries) >= MAX_SECRETS:
                raise InvalidRequestError(f"the store holds {MAX_SECRETS} secrets already")
            entries.append(
                {
                    "principal": principal,
                    "name": name,
                    "key_id": _key_id(key),
                    "nonce": base64.b64encode(nonce).decode(),
                    "ciphertext": base64.b64encode(sealed).decode(),
                    "created_at": time.time(),
                    "last_used_at": None,
                }
            )
            document["secrets"] = entries

    def remove(self, name: str, principal: str = "") -> None:
        """Raises InvalidRequestError (no such secret)."""
        with self._locked() as document:
            before = len(document["secrets"])
            document["secrets"] = [e for e in document["secrets"]
                                   if (e["principal"], e["name"]) != (principal, name)]  # fmt: skip
            if len(document["secrets"]) == before:
                who = f" of principal {principal!r}" if principal else ""
                raise InvalidRequestError(f"no secret {name!r}{who}")

    def names(self) -> list[SecretInfo]:
        """Every secret, without values (needs no key)."""
        return [
            SecretInfo(e["principal"], e["name"], e["created_at"], e.get("last_used_at"))
            for e in self._read()["secrets"]
        ]

    def value(self, name: str, principal: str) -> str | None:
        """`principal`'s own value of `name`, else the default one; None: neither. Raises
        SecretsKeyError (no key, or stored under another key)."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        entries = {(e["principal"], e["name"]): e for e in self._read()["secrets"]}
        entry = entries.get((principal, name)) or entries.get(("", name))
        if entry is None:
            return None
        key = self._need_key()
        try:
            plain = AESGCM(key).decrypt(
                base64.b64decode(entry["nonce"]),
                base64.b64decode(entry["ciphertext"]),
                _aad(entry["principal"], name),
            )
        except InvalidTag:
            raise SecretsKeyError(
                f"secret {name!r} was stored under another key (key id {entry.get('key_id')}; "
                f"this one is {_key_id(key)}): set it again, or run `secrets rekey` with the old "
                "key"
            ) from None
        return plain.decode()

    def rekey(self, new_key: bytes) -> int:
        """Encrypt every secret under `new_key` (the current key opens them). Returns how
        many. Raises SecretsKeyError."""
        values = [(i.principal, i.name, self.value(i.name, i.principal)) for i in self.names()]
        self._key = new_key
        for principal, name, value in values:
            if value is not None:
                self.set(name, value, principal)
        return len(values)

    def mark_used(self, name: str, principal: str) -> None:
        """Record a use (at most every USE_MARK_SECONDS per secret). Never raises."""
        now = time.time()
        if now - self._marked.get((principal, name), 0.0) < USE_MARK_SECONDS:
            return
        self._marked[(principal, name)] = now
        with contextlib.suppress(OSError, ValueError, InvalidRequestError), self._locked() as doc:
            entries = {(e["principal"], e["name"]): e for e in doc["secrets"]}
            entry = entries.get((principal, name)) or entries.get(("", name))
            if entry is not None:
                entry["last_used_at"] = now
