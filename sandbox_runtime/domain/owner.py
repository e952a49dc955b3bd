"""Who an execution belongs to, and the names derived from it."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

# A session as the MCP edge accepts it (used with fullmatch: `$` would also accept a trailing
# newline, "evil\n"): not "." or "..", which are path-like.
SESSION_RE = re.compile(r"(?!\.+\Z)[A-Za-z0-9._:@-]{1,128}")
DEFAULT_SESSION = "default"
MAX_PRINCIPAL_CHARS = 256


def session_name(session_id: str) -> str:
    """A session as callers name it: `s:NAME` is NAME; `default` is itself."""
    return session_id[2:] if session_id.startswith("s:") else session_id


@dataclass(frozen=True, slots=True)
class Owner:
    """Who an execution belongs to: the token's principal and the session."""

    principal: str
    session_id: str


def valid_owner(owner: Owner) -> bool:
    """Whether `owner` is one the MCP edge could have named: a principal as a token's (printable,
    no `:` or `,`, which SANDBOX_AUTH_TOKENS cannot carry) and `default` or `s:` + a session
    name. For owners that arrive from elsewhere (the placement queue, another replica)."""
    principal, session = owner.principal, owner.session_id
    principal_ok = (
        0 < len(principal) <= MAX_PRINCIPAL_CHARS
        and principal.isprintable()
        and principal == principal.strip()
        and not any(c in principal for c in ":,")
    )
    named = session.startswith("s:") and SESSION_RE.fullmatch(session[2:]) is not None
    return principal_ok and (session == DEFAULT_SESSION or named)


def workspace_name(owner: Owner) -> str:
    """The directory name of an owner's workspace: a hash, so ids never reach the filesystem."""
    digest = hashlib.sha256(f"{owner.principal}\0{owner.session_id}".encode()).hexdigest()
    return f"ws-{digest[:32]}"
