"""Who an execution belongs to, and the names derived from it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def session_name(session_id: str) -> str:
    """A session as callers name it: `s:NAME` is NAME; `default` is itself."""
    return session_id[2:] if session_id.startswith("s:") else session_id


@dataclass(frozen=True, slots=True)
class Owner:
    """Who an execution belongs to: the token's principal and the session."""

    principal: str
    session_id: str


def workspace_name(owner: Owner) -> str:
    """The directory name of an owner's workspace: a hash, so ids never reach the filesystem."""
    digest = hashlib.sha256(f"{owner.principal}\0{owner.session_id}".encode()).hexdigest()
    return f"ws-{digest[:32]}"
