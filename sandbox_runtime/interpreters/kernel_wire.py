"""The records between the host and a kernel's relay (runtime_files/srt_kernel_pipe.py).

Both directions use one framing on the relay's stdin and stdout: a 5-byte head (the channel's
number, then how many parts follow, ">BI"), then each part as a 4-byte length and its bytes.
A request the host sends is one Jupyter message's serialized parts; what the relay sends back
is either a whole message (its ZeroMQ identities, the delimiter, then six or more frames) or,
on channel DROPPED, a short JSON note of a message it dropped for being too large. The relay is
as untrusted as the kernel: a record that is not what it sends raises ValueError here, and
nothing is read past the bounds below. Pure: no kernel, no sandbox.
"""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass

from jupyter_client.session import Session

CHANNELS = ("iopub", "shell", "stdin", "control")  # (the relay's record channel numbers)
DROPPED = 255  # a record saying the relay dropped a message over MESSAGE_MAX_BYTES
MAX_PARTS = 64  # parts of one message (a Jupyter message has 6 and its buffers)
MESSAGE_MAX_BYTES = 8 * 1024 * 1024  # one message; a larger one is dropped (the relay says so)
NOTE_MAX_BYTES = 1024  # the relay's note of a dropped message
RECORD_COST = 256  # bytes each record is charged at least (empty records are no free lunch)
DELIM = b"<IDS|MSG>"


@dataclass(frozen=True)
class DropNote:
    """The relay dropped a message: its parent's msg_id (None: unknown), its size (at least
    MESSAGE_MAX_BYTES), and what the note itself is charged."""

    parent: str | None
    size: int
    cost: int


@dataclass(frozen=True)
class Message:
    """A whole message from the kernel: its channel, its frames after the delimiter (signature,
    header, parent header, metadata, content, buffers), and what it is charged."""

    channel: str
    frames: list[bytes]
    size: int


def encode_request(channel: str, parts: list[bytes]) -> bytes:
    """One record for the relay: `parts` (a serialized message) to send on `channel`."""
    record = [struct.pack(">BI", CHANNELS.index(channel), len(parts))]
    for part in parts:
        record += (struct.pack(">I", len(part)), part)
    return b"".join(record)


async def read_record(stream: asyncio.StreamReader) -> DropNote | Message:
    """The relay's next record. Raises asyncio.IncompleteReadError (the relay ended) and
    ValueError (a record the relay does not send: the protocol is broken)."""
    channel, count = struct.unpack(">BI", await stream.readexactly(5))
    if channel == DROPPED:  # (the relay's note of a message too big to copy)
        if count != 1:
            raise ValueError(f"a drop note of {count} parts")
        part = (await read_parts(stream, 1, NOTE_MAX_BYTES))[0]
        parent, size = parse_note(part)
        return DropNote(parent, size, RECORD_COST + len(part))
    if channel >= len(CHANNELS) or not 5 <= count <= MAX_PARTS:
        raise ValueError(f"a record of channel {channel} with {count} parts")
    parts = await read_parts(stream, count, MESSAGE_MAX_BYTES)
    size = RECORD_COST + sum(map(len, parts))
    if DELIM not in parts or len(parts) - parts.index(DELIM) < 6:
        raise ValueError("a record that is no message")
    return Message(CHANNELS[channel], parts[parts.index(DELIM) + 1 :], size)


async def read_parts(stream: asyncio.StreamReader, count: int, most: int) -> list[bytes]:
    """The `count` parts of one record, at most `most` bytes in all (ValueError)."""
    parts: list[bytes] = []
    total = 0
    for _ in range(count):
        (length,) = struct.unpack(">I", await stream.readexactly(4))
        total += length
        if total > most:
            raise ValueError(f"a message over {most} bytes")
        parts.append(await stream.readexactly(length))
    return parts


def parse_note(part: bytes) -> tuple[str | None, int]:
    """The relay's note of a dropped message: (its parent's msg_id, its size); the size is
    taken for at least MESSAGE_MAX_BYTES (what the relay drops) and at most 2**40."""
    try:
        note = json.loads(part)
    except ValueError:
        return None, MESSAGE_MAX_BYTES
    if not isinstance(note, dict):
        return None, MESSAGE_MAX_BYTES
    parent, size = note.get("parent"), note.get("bytes")
    size = size if isinstance(size, int) else 0
    return (parent if isinstance(parent, str) else None), min(max(size, MESSAGE_MAX_BYTES), 2**40)


def parent_msg_id(session: Session, frame: bytes) -> str | None:
    """The msg_id in a message's serialized parent header (None: none, or not a string)."""
    try:
        parent = session.unpack(frame)
    except Exception:  # not JSON: not a message of the kernel's
        return None
    msg_id = parent.get("msg_id") if isinstance(parent, dict) else None
    return msg_id if isinstance(msg_id, str) else None
