"""What an audit line says about a call: who (the Identity, never its credential), and the
sizes of its arguments (never their contents), within bounds whatever the caller sent."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sandbox_runtime.domain.identity import Identity

# A caller chooses the names of its arguments and of unknown tools: a line holds a few.
MAX_ARGUMENTS = 32
NAME_CHARS = 64


def clip(name: object) -> str:
    """A caller-chosen name (a tool's, an argument's) as a line keeps it: at most 64 chars."""
    text = name if isinstance(name, str) else str(name)
    return text if len(text) <= NAME_CHARS else text[: NAME_CHARS - 1] + "…"


def size_of(value: Any) -> int:
    """An argument's size in bytes: a string's UTF-8, anything else its JSON."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    try:
        return len(json.dumps(value, ensure_ascii=False, default=str).encode("utf-8", "replace"))
    except (TypeError, ValueError):  # (a structure too deep to encode: its size is unknown)
        return -1


def argument_sizes(arguments: Mapping[str, Any] | None) -> dict[str, int]:
    """{argument: bytes} for the first MAX_ARGUMENTS arguments (more: counted under `…`)."""
    sizes: dict[str, int] = {}
    for n, (name, value) in enumerate((arguments or {}).items()):
        if n == MAX_ARGUMENTS:
            sizes["…"] = len(arguments or {}) - MAX_ARGUMENTS
            break
        sizes[clip(name)] = size_of(value)
    return sizes


def who(identity: Identity) -> dict[str, Any]:
    """An audit line's caller fields."""
    return {
        "principal": identity.principal,
        "token_id": identity.token_id,
        "client_id": identity.client_id,
    }
