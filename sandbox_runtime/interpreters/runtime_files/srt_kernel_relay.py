"""Runs a TCP-only Jupyter kernel (Deno's) behind the unix sockets the host connects to.

Installed into the sandbox runtime; runs inside the kernel's sandbox. The host wrote an `ipc`
connection file; this writes a `tcp` one on 127.0.0.1 (the sandbox's own loopback: nothing
outside the sandbox can reach it), starts the kernel with it, and copies bytes between each
unix socket and its TCP port (ZeroMQ speaks the same wire protocol on both). The kernel's
exit ends the relay, and the relay's end kills the kernel.

    python -m srt_kernel_relay CONNECTION_FILE -- KERNEL_ARGV... ({tcp_connection_file} in it)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

CHANNELS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def _prepare(host_file: str) -> tuple[dict, dict[str, int], str]:
    """The host's connection info, a free TCP port per channel, and the kernel's file."""
    with open(host_file) as src:
        info = json.load(src)
    ports = {name: _free_port() for name in CHANNELS}
    tcp_file = "/tmp/.srt-kernel-tcp.json"
    with open(tcp_file, "w") as out:
        json.dump(dict(info, transport="tcp", ip="127.0.0.1", **ports), out)
    for name in CHANNELS:
        path = f"{info['ip']}-{info[name]}"
        if os.path.exists(path):
            os.unlink(path)
    return info, ports, tcp_file


async def main(argv: list[str]) -> int:
    host_file, separator, kernel_argv = argv[0], argv[1], argv[2:]
    if separator != "--" or not kernel_argv:
        print(__doc__, file=sys.stderr)
        return 2
    info, ports, tcp_file = _prepare(host_file)
    servers = []
    for name in CHANNELS:
        path = f"{info['ip']}-{info[name]}"
        port = ports[name]

        async def relay(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int = port
        ) -> None:
            for _ in range(100):  # the kernel may still be binding its ports
                try:
                    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            else:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

        servers.append(await asyncio.start_unix_server(relay, path=path))
    argv_out = [a.replace("{tcp_connection_file}", tcp_file) for a in kernel_argv]
    kernel = await asyncio.create_subprocess_exec(*argv_out)
    try:
        return await kernel.wait()
    finally:
        if kernel.returncode is None:
            kernel.kill()
        for server in servers:
            server.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
