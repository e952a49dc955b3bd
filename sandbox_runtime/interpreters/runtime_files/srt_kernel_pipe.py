"""The kernel's side of the host's pipes: ZeroMQ to the kernel, framed records to the host.

Runs inside the kernel's sandbox as its first process (the host copies this file into the
kernel's directory; it needs only the runtime's Python and pyzmq). It starts the kernel, is
its only client, and copies each whole message between the kernel's sockets and its own
stdin/stdout as records, so the host never runs ZeroMQ against code it does not trust:
whatever ZeroMQ buffers, it buffers here, inside the sandbox's memory limit.

A record: one byte (the channel's index in CHANNELS, or DROPPED), a u32 count of parts, then
each part as a u32 length and its bytes (big-endian). A message over MAX_BYTES is not
copied: a DROPPED record says how big it was and whose answer it was. The host trusts
nothing of this (code in the sandbox can write to the same pipe); it bounds what it reads.

    python srt_kernel_pipe.py CONNECTION_FILE MAX_BYTES ipc|tcp -- KERNEL_ARGV...

`{connection_file}` in KERNEL_ARGV becomes the file the kernel is to use: the host's (ipc)
or, for a kernel that speaks only TCP, one on the sandbox's own loopback written here.
The kernel's end ends this process; this process's end (or EOF on stdin) ends the kernel.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys

import zmq

CHANNELS = ("iopub", "shell", "stdin", "control")
DROPPED = 255
KINDS = {"iopub": zmq.SUB, "shell": zmq.DEALER, "stdin": zmq.DEALER, "control": zmq.DEALER}
DELIM = b"<IDS|MSG>"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kernel_file(host_file: str, transport: str) -> tuple[str, dict]:
    """The connection file the kernel uses and the info to connect to it."""
    with open(host_file) as src:
        info = json.load(src)
    if transport != "tcp":
        return host_file, info
    ports = {f"{name}_port": _free_port() for name in (*CHANNELS, "hb")}
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
        while kernel.poll() is None:
            for item, _ in poller.poll(100):
                if item == 0:
                    chunk = os.read(0, 1 << 20)
                    if not chunk:
                        return 0  # the host is gone
                    pending += chunk
                    _forward(pending, sockets)
                    continue
                parts = item.recv_multipart()
                size = sum(map(len, parts))
                if size > max_bytes:
                    note = json.dumps({"bytes": size, "parent": _parent_id(parts)}).encode()
                    _write(out, struct.pack(">BII", DROPPED, 1, len(note)) + note)
                    continue
                head = struct.pack(">BI", index[item], len(parts))
                _write(out, head + b"".join(struct.pack(">I", len(p)) + p for p in parts))
        return kernel.returncode or 0
    finally:
        if kernel.poll() is None:
            kernel.send_signal(signal.SIGKILL)


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
        sockets[CHANNELS[channel]].send_multipart(parts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
