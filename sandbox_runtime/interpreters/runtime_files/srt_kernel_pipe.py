"""The kernel's side of the host's pipes: ZeroMQ to the kernel, framed records to the host.

Runs inside the kernel's sandbox as its first process (the host copies this file into the
kernel's directory; it needs only the runtime's Python and pyzmq). It starts the kernel, is
its only client, and copies each whole message between the kernel's sockets and its own
stdin/stdout as records, so the host never runs ZeroMQ against code it does not trust:
whatever ZeroMQ buffers, it buffers here, inside the sandbox's memory limit.

A record: one byte (the channel's index in CHANNELS, or DROPPED), a u32 count of parts, then
each part as a u32 length and its bytes (big-endian). A message over MAX_BYTES is not
copied: a DROPPED record says how big it was and whose answer it was; but a stream message
(a large print) is split into messages of at most MAX_BYTES / 8 characters each, signed anew
with the kernel's key, so a program's output is cut by the host's output limit, not lost
whole. The host trusts nothing of this (code in the sandbox can write to the same pipe); it
bounds what it reads.

    python srt_kernel_pipe.py CONNECTION_FILE MAX_BYTES ipc|tcp -- KERNEL_ARGV...

`{connection_file}` in KERNEL_ARGV becomes the file the kernel is to use: the host's (ipc)
or, for a kernel that speaks only TCP, one on the sandbox's own loopback written here.
The kernel's end ends this process; this process's end (or EOF on stdin) ends the kernel.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid

import zmq

CHANNELS = ("iopub", "shell", "stdin", "control")
DROPPED = 255
KINDS = {"iopub": zmq.SUB, "shell": zmq.DEALER, "stdin": zmq.DEALER, "control": zmq.DEALER}
DELIM = b"<IDS|MSG>"


LISTEN_FIRST = 10000  # the kernel's ports: below the ephemeral range (32768 and up by default)


def _listen_ports(count: int) -> list[int]:
    """`count` distinct loopback ports the kernel can listen on, outside the ephemeral range.

    The relay connects while the kernel is still starting, and every connect retry takes an
    ephemeral source port: a listen port drawn from that same range (bind to port 0) can be
    taken by one of those retries before the kernel binds it (AddrInUse). The sandbox's
    network namespace is its own, so the ports below the range are free unless the code took
    one; each is checked, and all are held until all are found.
    """
    held: list[socket.socket] = []
    try:
        for port in range(LISTEN_FIRST, LISTEN_FIRST + 1000):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            held.append(sock)
            if len(held) == count:
                return [int(s.getsockname()[1]) for s in held]
        raise OSError("no free loopback ports for the kernel")
    finally:
        for sock in held:
            sock.close()


def _kernel_file(host_file: str, transport: str) -> tuple[str, dict]:
    """The connection file the kernel uses and the info to connect to it."""
    with open(host_file) as src:
        info = json.load(src)
    if transport != "tcp":
        return host_file, info
    names = (*CHANNELS, "hb")
    found = _listen_ports(len(names))
    ports = {f"{name}_port": found[i] for i, name in enumerate(names)}
    info = dict(info, transport="tcp", ip="127.0.0.1", **ports)
    tcp_file = "/tmp/.srt-kernel-tcp.json"
    with open(tcp_file, "w") as out:
        json.dump(info, out)
    return tcp_file, info


def _url(info: dict, channel: str) -> str:
    port = info[f"{channel}_port"]
    if info["transport"] == "tcp":
        return f"tcp://{info['ip']}:{port}"
    return f"ipc://{info['ip']}-{port}"


def _parent_id(parts: list[bytes]) -> str:
    try:
        parent = json.loads(parts[parts.index(DELIM) + 3])
        return str(parent.get("msg_id", ""))
    except (ValueError, IndexError, AttributeError):
        return ""


def _split_stream(parts: list[bytes], key: bytes, max_chars: int) -> list[list[bytes]] | None:
    """A stream message as several, each with at most `max_chars` characters of its text and
    a signature of its own; None for any other message (or one it cannot read)."""
    try:
        at = parts.index(DELIM)
        header, parent, metadata, content = (json.loads(p) for p in parts[at + 2 : at + 6])
        if header.get("msg_type") != "stream" or not isinstance(content.get("text"), str):
            return None
    except (ValueError, AttributeError):
        return None
    text = content["text"]
    out = []
    for start in range(0, len(text), max_chars):
        frames = [
            json.dumps(dict(header, msg_id=uuid.uuid4().hex)).encode(),
            json.dumps(parent).encode(),
            json.dumps(metadata).encode(),
            json.dumps(dict(content, text=text[start : start + max_chars])).encode(),
        ]
        signer = hmac.new(key, digestmod=hashlib.sha256)
        for frame in frames:
            signer.update(frame)
        out.append([*parts[:at], DELIM, signer.hexdigest().encode(), *frames])
    return out


def _record(channel: int, parts: list[bytes]) -> bytes:
    head = struct.pack(">BI", channel, len(parts))
    return head + b"".join(struct.pack(">I", len(p)) + p for p in parts)


def _write(out: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(out, view) :]


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    host_file, max_bytes, transport, kernel_argv = argv[0], int(argv[1]), argv[2], argv[4:]
    kernel_file, info = _kernel_file(host_file, transport)
    key = str(info["key"]).encode()
    out = os.dup(1)  # the records; the kernel's own stdout goes to stderr with ours
    os.dup2(2, 1)
    kernel = subprocess.Popen(
        [a.replace("{connection_file}", kernel_file) for a in kernel_argv],
        stdin=subprocess.DEVNULL,
        pass_fds=(),
    )
    context = zmq.Context()
    sockets = {}
    # One identity for every request socket: the kernel sends input requests (stdin) to the
    # identity that sent the execute request (shell).
    identity = os.urandom(16).hex().encode()
    for channel in CHANNELS:
        sock = context.socket(KINDS[channel])
        sock.linger = 0
        if KINDS[channel] == zmq.DEALER:
            sock.identity = identity
        if channel == "iopub":
            sock.rcvhwm = 0  # (what the host has not taken yet waits here, in the sandbox)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(_url(info, channel))
        sockets[channel] = sock
    poller = zmq.Poller()
    for sock in sockets.values():
        poller.register(sock, zmq.POLLIN)
    poller.register(0, zmq.POLLIN)
    index = {sock: i for i, sock in enumerate(sockets.values())}
    pending = bytearray()  # what the host wrote that is not yet a whole record
    try:
        ended_at = None  # the kernel's end: what it sent before is still passed on (0.1 s)
        while ended_at is None or time.monotonic() - ended_at < 0.1:
            if ended_at is None and kernel.poll() is not None:
                ended_at = time.monotonic()
            for item, _ in poller.poll(100 if ended_at is None else 10):
                if item == 0:
                    chunk = os.read(0, 1 << 20)
                    if not chunk:
                        return 0  # the host is gone
                    pending += chunk
                    _forward(pending, sockets)
                    continue
                _pass_on(out, index[item], item.recv_multipart(), max_bytes, key)
        return kernel.returncode or 0
    finally:
        if kernel.poll() is None:
            kernel.send_signal(signal.SIGKILL)


def _pass_on(out: int, channel: int, parts: list[bytes], max_bytes: int, key: bytes) -> None:
    """One message of the kernel's to the host: whole, in pieces (a large stream message)
    or as a note that it was dropped."""
    size = sum(map(len, parts))
    if size <= max_bytes:
        _write(out, _record(channel, parts))
        return
    # (JSON may spell a character in 6 bytes: max_bytes / 8 characters fit)
    pieces = _split_stream(parts, key, max_bytes // 8)
    if pieces is not None:
        for piece in pieces:
            _write(out, _record(channel, piece))
        return
    note = json.dumps({"bytes": size, "parent": _parent_id(parts)}).encode()
    _write(out, _record(DROPPED, [note]))


def _forward(pending: bytearray, sockets: dict) -> None:
    """Send every whole record in `pending` to its socket (and remove it)."""
    while len(pending) >= 5:
        channel, count = struct.unpack_from(">BI", pending)
        at, parts = 5, []
        for _ in range(count):
            if len(pending) < at + 4:
                return
            (length,) = struct.unpack_from(">I", pending, at)
            if len(pending) < at + 4 + length:
                return
            parts.append(bytes(pending[at + 4 : at + 4 + length]))
            at += 4 + length
        del pending[:at]
        try:  # (a kernel that reads no requests does not stop this relay: they are dropped)
            sockets[CHANNELS[channel]].send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.Again:
            print("srt_kernel_pipe: the kernel takes no requests; one dropped", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
