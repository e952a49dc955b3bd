"""Drives the E2B Python SDK, unmodified, against our server (tests/test_e2b_sdk.py).

Run in the E2B clients' venv; the SDK finds the server through E2B_API_URL, E2B_SANDBOX_URL
and E2B_API_KEY only. `python e2b_driver.py SCENARIO [ARGS]` prints one JSON line: what the
SDK returned (or {"crash": ...}). Scenarios follow E2B's documented examples.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from e2b import AsyncSandbox, CommandExitException, Sandbox


def examples() -> dict[str, Any]:
    out: dict[str, Any] = {}
    sandbox = Sandbox.create(metadata={"suite": "e2b"}, envs={"GREETING": "hello"})
    out["sandbox_id"] = sandbox.sandbox_id
    info = sandbox.get_info()
    out["info"] = {"template": info.template_id, "state": str(info.state.value)}
    # commands: foreground, exit codes, env vars
    result = sandbox.commands.run("echo hi; echo oops >&2; echo $GREETING")
    out["run"] = {"stdout": result.stdout, "stderr": result.stderr, "exit": result.exit_code}
    out["home"] = sandbox.commands.run("echo $HOME $USER; cd && pwd").stdout
    try:
        sandbox.commands.run("exit 3")
        out["exit3"] = None
    except CommandExitException as exc:
        out["exit3"] = exc.exit_code
    # background with on_stdout (the async SDK takes the callback at the start)
    out["background"] = asyncio.run(_background(sandbox.sandbox_id))
    # stdin
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "typed\n")
    sandbox.commands.close_stdin(handle.pid)
    out["stdin"] = handle.wait().stdout
    # kill
    handle = sandbox.commands.run("sleep 60", background=True)
    out["listed"] = handle.pid in [p.pid for p in sandbox.commands.list()]
    out["killed"] = sandbox.commands.kill(handle.pid)
    try:
        handle.wait()
        out["after_kill"] = "finished normally"
    except CommandExitException as exc:
        out["after_kill"] = {"exit": exc.exit_code, "error": exc.error}
    # files
    sandbox.files.write("/home/user/notes.txt", "first")
    sandbox.files.write("data/raw.bin", b"\x00\x01bytes")
    out["read"] = sandbox.files.read("/home/user/notes.txt")
    out["read_bytes"] = bytes(sandbox.files.read("data/raw.bin", format="bytes")).hex()
    out["cat"] = sandbox.commands.run("cat /home/user/notes.txt").stdout
    out["list"] = sorted(e.name for e in sandbox.files.list("/home/user"))
    out["make_dir"] = [sandbox.files.make_dir("/home/user/d"), sandbox.files.make_dir("d")]
    moved = sandbox.files.rename("/home/user/notes.txt", "/home/user/d/renamed.txt")
    out["rename"] = moved.path
    out["exists"] = [sandbox.files.exists("notes.txt"), sandbox.files.exists("d/renamed.txt")]
    sandbox.files.remove("/home/user/d")
    out["removed"] = not sandbox.files.exists("d")
    try:
        sandbox.files.read("/home/user/missing.txt")
        out["missing"] = None
    except Exception as exc:
        out["missing"] = type(exc).__name__
    # list, with a metadata filter
    listed = Sandbox.list().next_items()
    out["in_list"] = sandbox.sandbox_id in [s.sandbox_id for s in listed]
    # connect from a second process
    sandbox.files.write("kept.txt", "survives")
    code = (
        "from e2b import Sandbox; import sys; "
        f"s = Sandbox.connect({sandbox.sandbox_id!r}); print(s.files.read('kept.txt'))"
    )
    second = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    out["second_process"] = second.stdout.strip() or second.stderr[-500:]
    # pause / resume: files kept
    sandbox.pause()
    out["paused_state"] = str(Sandbox.get_info(sandbox.sandbox_id).state.value)
    resumed = Sandbox.connect(sandbox.sandbox_id)
    out["resumed_read"] = resumed.files.read("kept.txt")
    out["resumed_state"] = str(resumed.get_info().state.value)
    # set_timeout, then expiry
    resumed.set_timeout(2)
    time.sleep(4)
    out["running_after_timeout"] = resumed.is_running()
    out["listed_after_timeout"] = sandbox.sandbox_id in [
        s.sandbox_id for s in Sandbox.list().next_items()
    ]
    # kill
    other = Sandbox.create()
    out["kill"] = other.kill()
    out["kill_again"] = Sandbox.kill(other.sandbox_id)
    return out


async def _background(sandbox_id: str) -> dict[str, Any]:
    sandbox = await AsyncSandbox.connect(sandbox_id)
    seen: list[str] = []
    handle = await sandbox.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.1; done",
        background=True,
        on_stdout=lambda data: seen.append(data),
    )
    result = await handle.wait()
    return {"seen": "".join(seen), "exit": result.exit_code}


def transfer(megabytes: str) -> dict[str, Any]:
    size = int(megabytes) * 1024 * 1024
    data = os.urandom(size)
    sandbox = Sandbox.create()
    started = time.perf_counter()
    sandbox.files.write("big.bin", data)
    up = time.perf_counter() - started
    digest = sandbox.commands.run("sha256sum /home/user/big.bin").stdout.split()[0]
    started = time.perf_counter()
    back = bytes(sandbox.files.read("big.bin", format="bytes"))
    down = time.perf_counter() - started
    sandbox.kill()
    return {
        "sha_in_sandbox_matches": digest == hashlib.sha256(data).hexdigest(),
        "download_matches": back == data,
        "upload_seconds": round(up, 3),
        "download_seconds": round(down, 3),
    }


def create() -> dict[str, Any]:
    sandbox = Sandbox.create()
    return {"sandbox_id": sandbox.sandbox_id, "token": sandbox._envd_access_token}


def run(sandbox_id: str, command: str) -> dict[str, Any]:
    sandbox = Sandbox.connect(sandbox_id)
    result = sandbox.commands.run(command)
    return {"stdout": result.stdout, "exit": result.exit_code}


def kill(sandbox_id: str) -> dict[str, Any]:
    return {"killed": Sandbox.kill(sandbox_id)}


SCENARIOS = {"examples": examples, "transfer": transfer, "create": create, "run": run, "kill": kill}

if __name__ == "__main__":
    try:
        report = SCENARIOS[sys.argv[1]](*sys.argv[2:])
    except BaseException as exc:
        report = {"crash": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    print(json.dumps(report, default=str))
