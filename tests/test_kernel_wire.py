"""A kernel's relay records and what the host holds of them, in-process: no kernel, no sandbox.

kernel_wire frames and parses the relay's records; kernel_inbox keeps what a caller waits for
within its bounds and counts (and reports a flood of) the rest.
"""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
from jupyter_client.session import Session

from sandbox_runtime.interpreters import kernel_inbox
from sandbox_runtime.interpreters.kernel_inbox import QUEUED_MAX_BYTES, Inbox
from sandbox_runtime.interpreters.kernel_wire import (
    DELIM,
    DROPPED,
    MESSAGE_MAX_BYTES,
    NOTE_MAX_BYTES,
    RECORD_COST,
    DropNote,
    Message,
    encode_request,
    parent_msg_id,
    parse_note,
    read_record,
)

pytestmark = pytest.mark.unit

FRAMES = [b"sig", b"{}", b'{"msg_id": "p"}', b"{}", b"{}"]


def reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    stream = asyncio.StreamReader()
    stream.feed_data(data)
    if eof:
        stream.feed_eof()
    return stream


def record(channel: int, parts: list[bytes]) -> bytes:
    head = struct.pack(">BI", channel, len(parts))
    return head + b"".join(struct.pack(">I", len(p)) + p for p in parts)


# -- kernel_wire ---------------------------------------------------------------------------------


async def test_a_request_record_reads_back_as_the_message_it_frames() -> None:
    parts = [b"kernel-id", DELIM, *FRAMES]
    data = encode_request("shell", parts)
    assert data == record(1, parts)
    message = await read_record(reader(data))
    assert message == Message("shell", FRAMES, RECORD_COST + sum(map(len, parts)))


async def test_records_follow_one_another_and_the_relays_end_is_an_incomplete_read() -> None:
    one = [DELIM, *FRAMES]
    stream = reader(encode_request("iopub", one) + encode_request("stdin", one))
    assert isinstance(await read_record(stream), Message)
    second = await read_record(stream)
    assert isinstance(second, Message) and second.channel == "stdin"
    with pytest.raises(asyncio.IncompleteReadError):
        await read_record(stream)


async def test_a_drop_note_names_its_parent_and_is_charged_for_itself() -> None:
    note = json.dumps({"parent": "abc", "bytes": 3 * MESSAGE_MAX_BYTES}).encode()
    got = await read_record(reader(record(DROPPED, [note])))
    assert got == DropNote("abc", 3 * MESSAGE_MAX_BYTES, RECORD_COST + len(note))


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (record(4, [DELIM, *FRAMES]), "channel 4"),  # no such channel
        (record(1, [DELIM, *FRAMES[:3]]), "4 parts"),  # fewer than a message has
        (record(1, [b"x"] * 65), "65 parts"),  # more than MAX_PARTS
        (record(1, [b"a", b"b", *FRAMES]), "no message"),  # no delimiter
        (record(1, [b"a", b"b", DELIM, *FRAMES[:4]]), "no message"),  # too few after it
        (record(DROPPED, [b"{}", b"{}"]), "drop note of 2 parts"),
        (record(DROPPED, [b"x" * (NOTE_MAX_BYTES + 1)]), "over 1024 bytes"),
    ],
)
async def test_a_record_the_relay_does_not_send_breaks_the_protocol(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        await read_record(reader(data))


async def test_a_message_over_the_bound_is_refused_before_its_bytes_are_read() -> None:
    head = struct.pack(">BI", 0, 6) + struct.pack(">I", MESSAGE_MAX_BYTES + 1)
    with pytest.raises(ValueError, match="over"):
        await read_record(reader(head, eof=False))  # (no EOF: nothing more is awaited)


@pytest.mark.parametrize(
    ("note", "parsed"),
    [
        (b'{"parent": "p", "bytes": 10}', ("p", MESSAGE_MAX_BYTES)),  # at least the bound
        (b'{"parent": "p", "bytes": 1e99}', ("p", MESSAGE_MAX_BYTES)),  # not an int
        (b'{"parent": "p", "bytes": 1099511627777}', ("p", 2**40)),  # at most 2**40
        (b'{"parent": 5, "bytes": 9000000}', (None, 9000000)),
        (b"[1, 2]", (None, MESSAGE_MAX_BYTES)),
        (b"\xff not json", (None, MESSAGE_MAX_BYTES)),
    ],
)
def test_a_drop_note_is_read_within_bounds(note: bytes, parsed: tuple[str | None, int]) -> None:
    assert parse_note(note) == parsed


def test_the_parent_msg_id_is_read_from_the_serialized_parent_header() -> None:
    session = Session(key=b"k", signature_scheme="hmac-sha256", username="srt")
    assert parent_msg_id(session, session.pack({"msg_id": "abc"})) == "abc"
    assert parent_msg_id(session, session.pack({"msg_id": ["abc"]})) is None
    assert parent_msg_id(session, session.pack([1])) is None
    assert parent_msg_id(session, b"\x00 not json") is None


# -- kernel_inbox --------------------------------------------------------------------------------


class Heard:
    def __init__(self) -> None:
        self.dropped: list[tuple[str, int]] = []
        self.floods: list[int] = []

    def inbox(self) -> Inbox:
        return Inbox(lambda why, size: self.dropped.append((why, size)), self.flood)

    def flood(self, size: int, seconds: float) -> None:
        self.floods.append(size)


def message(channel: str, size: int = 1000) -> Message:
    return Message(channel, list(FRAMES), size)


async def take(inbox: Inbox, channel: str, wait: float | None = 0.01) -> object:
    return await inbox.take(channel, wait, lambda: True, asyncio.Event())


async def test_only_answers_to_awaited_requests_are_queued_the_rest_is_counted() -> None:
    heard = Heard()
    inbox = heard.inbox()
    inbox.want("p")
    inbox.offer(message("iopub"), "p")
    inbox.offer(message("iopub", 10), "other")  # answers nothing awaited
    inbox.offer(message("iopub", 20), None)  # no parent
    inbox.offer(message("control", 30), "p")  # control's answers are never awaited
    assert inbox.queued_bytes == 1000
    assert heard.dropped == [("unsolicited", 10), ("unsolicited", 20), ("unsolicited", 30)]
    assert await take(inbox, "iopub") == (FRAMES, 1000, "p")
    assert inbox.queued_bytes == 0
    with pytest.raises(TimeoutError):
        await take(inbox, "iopub")


async def test_answers_past_the_queued_bound_are_dropped_and_said_to_their_call() -> None:
    heard = Heard()
    inbox = heard.inbox()
    inbox.want("p")
    inbox.offer(message("shell", QUEUED_MAX_BYTES - 100), "p")
    inbox.offer(message("iopub", 101), "p")
    inbox.offer(message("iopub", 100), "p")  # (exactly at the bound: kept)
    assert heard.dropped == [("over_bound", 101)]
    assert inbox.dropped_bytes == 101 and inbox.queued_bytes == QUEUED_MAX_BYTES


async def test_a_released_request_frees_what_its_answers_held() -> None:
    inbox = Heard().inbox()
    for msg_id in ("a", "b"):
        inbox.want(msg_id)
        inbox.offer(message("iopub", 100), msg_id)
        inbox.offer(message("shell", 10), msg_id)
    inbox.release("a", None)
    assert inbox.wanted == {"b"} and inbox.queued_bytes == 110
    assert await take(inbox, "iopub") == (FRAMES, 100, "b")
    inbox.clear()
    assert inbox.queued_bytes == 0 and inbox.queues["shell"].empty()


async def test_a_drop_note_counts_against_its_call_only_when_that_is_awaited() -> None:
    heard = Heard()
    inbox = heard.inbox()
    inbox.want("p")
    inbox.noted(DropNote("p", MESSAGE_MAX_BYTES, 300))
    inbox.noted(DropNote("gone", MESSAGE_MAX_BYTES, 300))
    assert heard.dropped == [
        ("unsolicited", 300),
        ("over_bound", MESSAGE_MAX_BYTES),
        ("unsolicited", 300),
        ("unsolicited", MESSAGE_MAX_BYTES),
    ]
    assert inbox.dropped_bytes == MESSAGE_MAX_BYTES


def test_messages_outside_calls_past_the_bound_within_the_window_are_a_flood() -> None:
    heard = Heard()
    inbox = heard.inbox()
    step = kernel_inbox.UNSOLICITED_MAX_BYTES // 4
    for _ in range(4):
        inbox.unsolicited(step)
    assert heard.floods == []  # (at the bound: not past it)
    inbox.unsolicited(1)
    assert heard.floods == [4 * step + 1]


async def test_a_dead_kernel_is_said_at_once_and_a_wait_ends_when_it_dies() -> None:
    inbox = Heard().inbox()
    assert await inbox.take("shell", None, lambda: False, asyncio.Event()) is None
    died = asyncio.Event()
    waiting = asyncio.ensure_future(inbox.take("shell", None, lambda: True, died))
    await asyncio.sleep(0)
    died.set()
    assert await asyncio.wait_for(waiting, 1) is None


async def test_a_waiting_take_gets_what_arrives_and_a_cancelled_one_loses_no_count() -> None:
    inbox = Heard().inbox()
    inbox.want("p")
    waiting = asyncio.ensure_future(take(inbox, "stdin", None))
    await asyncio.sleep(0)
    inbox.offer(message("stdin", 500), "p")
    assert await asyncio.wait_for(waiting, 1) == (FRAMES, 500, "p")
    assert inbox.queued_bytes == 0
    cancelled = asyncio.ensure_future(take(inbox, "stdin", None))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    inbox.offer(message("stdin", 70), "p")  # (still there for the next taker)
    assert inbox.queued_bytes == 70
    assert await take(inbox, "stdin") == (FRAMES, 70, "p")
