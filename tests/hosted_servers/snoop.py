"""A hosted MCP server that looks for what a sandboxed instance should not see or reach.

Tools:
  snoop {paths?: [str], dirs?: [str], host?: str, port?: int, unix_sockets?: [str],
         write_paths?: [str], mark?: str}
      -> one text content: a JSON object {"uid", "gid", "euid", "groups", "pid", "cwd",
         "hostname", "state_dir", "attempts": [{"what", "ok", "detail"}, ...]}
  write_state {key: str, value: str}  writes <state dir>/<key> (key sanitized)
  read_state {key: str}               its content (isError when it cannot be read)
  ok {}                               "fine"

The state dir is /workspace ($HOSTED_STATE_DIR overrides it, for tests outside the sandbox).
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import sys
from collections.abc import Callable

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mini import Context, ok_tool, serve, text, tool  # noqa: E402

STATE_DIR = os.environ.get("HOSTED_STATE_DIR") or "/workspace"


def _failed(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _safe(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except Exception as e:
        return _failed(e)


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def _environ_summary(pairs: list[tuple[str, str]]) -> dict:
    return {
        "names": sorted({k for k, _ in pairs}),
        "token_in_values": any("token" in v.lower() for _, v in pairs),
    }


def _read_environ_file(path: str) -> dict:
    with open(path, "rb") as f:
        raw = f.read()
    pairs = []
    for item in raw.split(b"\0"):
        if item:
            k, _, v = item.decode("utf-8", "replace").partition("=")
            pairs.append((k, v))
    return _environ_summary(pairs)


def _head(path: str, n: int = 100) -> str:
    with open(path, "rb") as f:
        return f.read(n).decode("utf-8", "replace")


def _tcp(host: str, port: int) -> str:
    with socket.create_connection((host, port), timeout=2) as sock:
        return f"connected from {sock.getsockname()!r}"


def _unix(path: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        sock.connect(path)
        return "connected"


def _write(path: str, data: str) -> str:
    with open(path, "w") as f:
        f.write(data)
    return f"wrote {len(data.encode())} bytes"


def snoop(args: dict, ctx: Context) -> dict:
    attempts: list[dict] = []

    def attempt(what: str, fn: Callable[..., object], *a: object) -> None:
        try:
            attempts.append({"what": what, "ok": True, "detail": fn(*a)})
        except BaseException as e:
            attempts.append({"what": what, "ok": False, "detail": _failed(e)})

    attempt("read /proc/1/environ", _read_environ_file, "/proc/1/environ")
    attempt("environ self", lambda: _environ_summary(list(os.environ.items())))
    attempt("list /", lambda: sorted(os.listdir("/")))
    attempt(f"list {STATE_DIR}", lambda: sorted(os.listdir(STATE_DIR)))
    for path in _strings(args.get("paths")):
        attempt(f"read {path}", _head, path)
    for d in _strings(args.get("dirs")):
        attempt(f"list {d}", lambda d=d: sorted(os.listdir(d)))
    host = args.get("host")
    host = host if isinstance(host, str) else "1.1.1.1"
    port = args.get("port")
    port = port if isinstance(port, int) else 80
    attempt(f"tcp {host}:{port}", _tcp, host, port)
    for path in _strings(args.get("unix_sockets")):
        attempt(f"unix {path}", _unix, path)
    for path in _strings(args.get("write_paths")):
        attempt(f"write {path}", _write, path, "written by snoop\n")
    mark = args.get("mark")
    mark = mark if isinstance(mark, str) else "snoop"
    mine = os.path.join(STATE_DIR, "mine.txt")
    attempt(f"write {mine}", _write, mine, mark)
    for path in sorted(glob.glob(os.path.join(STATE_DIR, "*.txt"))):
        attempt(f"readback {path}", _head, path, 1000)
    report = {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "euid": os.geteuid(),
        "groups": _safe(os.getgroups),
        "pid": os.getpid(),
        "cwd": _safe(os.getcwd),
        "hostname": _safe(socket.gethostname),
        "state_dir": STATE_DIR,
        "attempts": attempts,
    }
    return text(json.dumps(report))


def _state_path(key: object) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", key if isinstance(key, str) else "")
    name = name.lstrip(".")[:100] or "_"
    return os.path.join(STATE_DIR, name)


def write_state(args: dict, ctx: Context) -> str:
    path = _state_path(args.get("key"))
    value = args.get("value")
    value = value if isinstance(value, str) else json.dumps(value)
    with open(path, "w") as f:
        f.write(value)
    return f"wrote {path}"


def read_state(args: dict, ctx: Context) -> str:
    with open(_state_path(args.get("key"))) as f:
        return f.read()


STR_LIST = {"type": "array", "items": {"type": "string"}}

TOOLS = {
    "snoop": tool(
        snoop,
        "Report what this process can read, list, reach and write (see the module docstring).",
        {
            "paths": {**STR_LIST, "description": "files to read (first 100 bytes)"},
            "dirs": {**STR_LIST, "description": "directories to list"},
            "host": {"type": "string", "description": "TCP host (default 1.1.1.1)"},
            "port": {"type": "integer", "description": "TCP port (default 80)"},
            "unix_sockets": {**STR_LIST, "description": "unix sockets to connect to"},
            "write_paths": {**STR_LIST, "description": "files to try to create"},
            "mark": {"type": "string", "description": "written to <state dir>/mine.txt"},
        },
    ),
    "write_state": tool(
        write_state,
        "Write value to <state dir>/<key>.",
        {"key": {"type": "string"}, "value": {"type": "string"}},
        ["key", "value"],
    ),
    "read_state": tool(read_state, "Read <state dir>/<key>.", {"key": {"type": "string"}}, ["key"]),
    "ok": ok_tool(),
}

if __name__ == "__main__":
    serve(TOOLS, "snoop")
