"""End-to-end fixtures: a real `srt-mcp-server` subprocess and real MCP clients talking to it."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import pwd
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.types import CallToolResult, TextContent

Mode = Literal["legacy", "auto"]
MODERN_PROTOCOL = "2026-07-28"


def sandbox_uid() -> int:
    """The host uid of the default sandbox user (`srt-sandbox`, made here if missing)."""
    from sandbox_runtime.sandbox.host import DEFAULT_SANDBOX_USER, ensure_system_user

    return pwd.getpwnam(ensure_system_user(DEFAULT_SANDBOX_USER)).pw_uid


CLUSTER_SECRET = "test-cluster-secret-0123456789"


def free_port() -> int:
    """A TCP port nothing listens on right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def traversable_by_others(path: Path) -> None:
    """Let the unprivileged sandbox uid reach `path`: pytest makes its tmp dirs 0700."""
    for p in (path, *path.parents):
        if p == Path(p.anchor):
            break
        mode = p.stat().st_mode
        if not mode & 0o001:
            os.chmod(p, (mode & 0o7777) | 0o001)


ROOT = Path(__file__).resolve().parent.parent


def runtime_dir() -> Path:
    """The sandbox runtime the tests' servers use (scripts/test builds it; see conftest)."""
    return Path(os.environ.get("SRT_TEST_RUNTIME_DIR") or ROOT / ".runtime")


def server_env(state_dir: Path, port: int, **settings: str) -> dict[str, str]:
    """The environment for one server: the host's, minus any SANDBOX_*, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SANDBOX_", "FASTMCP_"))}
    env.pop("REDIS_URL", None)
    env.update(
        {
            "SANDBOX_HOST": "127.0.0.1",
            "SANDBOX_PORT": str(port),
            "SANDBOX_STATE_DIR": str(state_dir),
            "SANDBOX_REPLICA_ID": f"e2e-{uuid.uuid4().hex[:10]}",
            "SANDBOX_LOG_LEVEL": "INFO",
            "SANDBOX_CLUSTER_PORT": "0",  # with Redis: a free port of its own for peers' calls
            "SANDBOX_RUNTIME_DIR": str(runtime_dir()),
            # Small workspaces (with SANDBOX_WORKSPACE_RESERVE=allocate the default GiB each
            # would take tens of GiB across a test's sessions). Tests that need more ask.
            "SANDBOX_WORKSPACE_MB": "64",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(settings)
    return env


def run_server_once(workdir: Path, **settings: str) -> tuple[int, str]:
    """Run the server with `settings` expecting it to exit on its own (within 20 s): (exit code,
    stderr)."""
    env = server_env(workdir, free_port(), **settings)
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox_runtime.cli"],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=20.0,
        check=False,
    )
    return proc.returncode, proc.stderr


@dataclass
class ServerProcess:
    """The real server as a subprocess with its own state dir, port and settings."""

    workdir: Path
    settings: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    max_fds: int | None = None  # RLIMIT_NOFILE of the server process (None: the test's own)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/mcp"

    @property
    def stderr_path(self) -> Path:
        return self.workdir / "server.stderr"

    @property
    def state_dir(self) -> Path:
        return self.workdir / "state"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Start the server and wait until /health answers 200 (or fail with its stderr)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(exist_ok=True)
        traversable_by_others(self.state_dir)
        env = server_env(self.state_dir, self.port, **self.settings)
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandbox_runtime.cli"],
                env=env,
                cwd=self.workdir,  # no stray .env from the repository
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                preexec_fn=None if self.max_fds is None else self._limit_fds,
            )
        try:
            self._wait_answering(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def _limit_fds(self) -> None:
        assert self.max_fds is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.max_fds, self.max_fds))

    def open_fds(self) -> int:
        """How many file descriptors the server process holds open right now."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def _wait_answering(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with httpx2.Client(timeout=2.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"server exited with {self.proc.returncode} while starting:\n"
                        + self.stderr_text()
                    )
                with contextlib.suppress(httpx2.HTTPError):
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        return  # answering; "degraded" is for the caller to judge
                if time.monotonic() >= deadline:
                    raise AssertionError(
                        f"server did not answer /health within {timeout:g}s:\n" + self.stderr_text()
                    )
                time.sleep(0.05)

    def health(self, timeout: float = 5.0) -> dict[str, Any]:
        """GET /health (no token); asserts 200."""
        resp = httpx2.get(f"{self.base_url}/health", timeout=timeout)
        assert resp.status_code == 200, resp.text
        body: dict[str, Any] = resp.json()
        return body

    def metric(self, token: str, prefix: str, *labels: str) -> float:
        """The first /metrics sample starting with `prefix` and holding every label text (0
        when there is none)."""
        auth = {"Authorization": f"Bearer {token}"}
        text = httpx2.get(f"{self.base_url}/metrics", headers=auth, timeout=5).text
        for line in text.splitlines():
            if line.startswith(prefix) and all(label in line for label in labels):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def descendants(self) -> list[tuple[int, str]]:
        """Every live process below the server: (pid, start time) pairs, for later checks."""
        return [(pid, proc_start_time(pid) or "") for pid in process_tree(self.pid)]

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM the server and wait for it to exit; returns its exit code (asserts it exits)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"server did not exit within {timeout:g}s of SIGTERM:\n" + self.stderr_text()
                ) from None
        code = self.proc.returncode
        # uvicorn re-raises the signal after a graceful stop; 0 is fine too.
        assert code in (0, -signal.SIGTERM), f"exit code {code}:\n{self.stderr_text()}"
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self, timeout: float = 20.0) -> None:
        """Stop the server if it still runs (`stop`: SIGTERM, exit asserted), then kill every
        process it had started that outlived it: nothing of a test's server is left running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        below = self.descendants()
        try:
            self.stop(timeout)
        finally:
            for pid, start_time in below:
                if alive(pid, start_time):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    def log_size(self) -> int:
        """How many bytes of log (stdout and stderr) the server has written so far."""
        return self.stderr_path.stat().st_size if self.stderr_path.exists() else 0

    def log_since(self, offset: int, max_lines: int = 200) -> str:
        """The server's log written after byte `offset`: its last `max_lines` lines."""
        if not self.stderr_path.exists():
            return ""
        with open(self.stderr_path, "rb") as log:
            log.seek(offset)
            lines = log.read().decode(errors="replace").splitlines()
        cut = len(lines) - max_lines
        head = [f"[... {cut} earlier lines ...]"] if cut > 0 else []
        return "\n".join(head + lines[max(cut, 0) :])


def replica_process(
    workdir: Path, redis_url: str, name: str, token: str, **settings: str
) -> ServerProcess:
    """A replica (not started) of a cluster on `redis_url`: its own state dir under
    `workdir/name`, replica id `name`, a 3 s heartbeat and the tests' cluster secret."""
    return ServerProcess(
        workdir / name,
        {
            "SANDBOX_AUTH_TOKEN": token,
            "REDIS_URL": redis_url,
            "SANDBOX_REPLICA_ID": name,
            "SANDBOX_HEARTBEAT_TTL": "3",
            "SANDBOX_CLUSTER_SECRET": CLUSTER_SECRET,
            **settings,
        },
    )


class Servers:
    """Test servers owned together: `servers(name, **settings)` starts one (its work dir
    `workdirs(name)`, or `workdir`) and checks /health says "ok"; `close()` stops them all, each
    even when another fails (`ServerProcess.close`: exit asserted, leftovers killed).

    The `serve` fixture (conftest) is one per test module; `running_server` and
    `running_topology` hold one for their servers.
    """

    def __init__(self, workdirs: Callable[[str], Path], release: bool = False) -> None:
        self.workdirs = workdirs
        self.started: list[ServerProcess] = []
        self.release = release  # give back their workspace images' disk when closed

    def __call__(
        self, name: str = "server", *, workdir: Path | None = None, **settings: str
    ) -> ServerProcess:
        return self.add(ServerProcess(workdir or self.workdirs(name), settings))

    def add(self, server: ServerProcess, healthy: bool = True) -> ServerProcess:
        """Start `server` (made elsewhere, e.g. by `replica_process`) and own it; with `healthy`,
        assert /health says "ok"."""
        self.started.append(server)
        server.start()
        if healthy:
            body = server.health()
            assert body["status"] == "ok", f"server is not healthy: {body}"
        return server

    def close(self) -> None:
        stop_all(*(server.close for server in self.started))
        for server in self.started if self.release else ():
            release_disk(server.state_dir)

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def release_disk(state_dir: Path) -> None:
    """Give back the disk a stopped server's workspace images hold (each allocated in full:
    a whole run's would fill a CI machine's disk); its logs stay for a failed test's report.
    A killed server's images may still be mounted: those are detached first."""
    from sandbox_runtime.workspaces.images import mounts_under, umount

    root = state_dir / "workspaces"
    if not root.is_dir():
        return
    for point in mounts_under(root):
        with contextlib.suppress(OSError):
            umount(point)
    for image in root.glob("*.img"):
        with contextlib.suppress(OSError):
            image.unlink()


@contextlib.contextmanager
def running_server(workdir: Path, **settings: str) -> Iterator[ServerProcess]:
    """A started, healthy server, stopped (exit asserted, leftovers killed) at the end."""
    with Servers(lambda _: workdir) as servers:
        yield servers.add(ServerProcess(workdir, settings))


# -- host processes ---------------------------------------------------------------------------


def _proc_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def proc_cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace")


def proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a pid's owner apart from a later reuse of the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def proc_uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def alive(pid: int, start_time: str | None = None) -> bool:
    """Whether `pid` still runs (zombies count as gone), and is the same process if given."""
    state = proc_state(pid)
    if state is None or state in ("Z", "X"):
        return False
    return start_time is None or proc_start_time(pid) == start_time


def processes_with(marker: str) -> list[tuple[int, str]]:
    """Live (non-zombie) host processes whose command line contains `marker`."""
    me = os.getpid()
    found = []
    for pid in _proc_pids():
        if pid == me:
            continue
        cmdline = proc_cmdline(pid)
        if cmdline and marker in cmdline and alive(pid):
            found.append((pid, cmdline))
    return found


def process_tree(root: int) -> list[int]:
    """Every live descendant of `root` (by parent pid)."""
    children: dict[int, list[int]] = {}
    for pid in _proc_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


# -- MCP clients ------------------------------------------------------------------------------


@dataclass
class Conn:
    """An open MCP client plus what the harness saw on the wire."""

    client: Client
    mode: Mode
    seen: dict[str, str]

    @property
    def session_id(self) -> str | None:
        """The Mcp-Session-Id header the server gave (legacy only)."""
        return self.seen.get("sid")

    async def call(self, tool: str, progress: Any = None, **arguments: Any) -> CallToolResult:
        return await self.client.call_tool(tool, arguments, progress_callback=progress)

    async def ok(self, tool: str, **arguments: Any) -> dict[str, Any]:
        """Call `tool`; assert it succeeded and return its structured content."""
        result = await self.call(tool, **arguments)
        assert not result.is_error, f"{tool} failed: {error_text(result)}"
        assert result.structured_content is not None
        return dict(result.structured_content)

    async def error(self, tool: str, **arguments: Any) -> str:
        """Call `tool`; assert it returned a tool error and return the error's text."""
        result = await self.call(tool, **arguments)
        assert result.is_error, f"{tool} unexpectedly succeeded: {result.structured_content}"
        return error_text(result)


def error_text(result: CallToolResult) -> str:
    """The `error` of a refused call: its structured content is the JSON body {"error": ...,
    "error_type": ...}, and its one text block says that line ("Error (kind): ..."; or, with
    response_format="json" or SANDBOX_RESULT_TEXT=json, is the body's JSON). For a call that
    succeeded (a failed assertion's message): its text, as it is."""
    texts = [block.text for block in result.content if isinstance(block, TextContent)]
    if not result.is_error:
        return "\n".join(texts)
    assert len(texts) == 1, f"an error result has one text block: {result.content}"
    if texts[0].startswith("{"):
        body = json.loads(texts[0])
        if result.structured_content is not None:
            assert result.structured_content == body, (result.structured_content, body)
    else:
        body = result.structured_content
        assert isinstance(body, dict), f"an error result's structured content: {body!r}"
        assert texts[0] == f"Error ({body.get('error_type')}): {body.get('error')}", texts[0]
    assert isinstance(body, dict) and isinstance(body.get("error"), str), body
    assert "error_type" in body, body
    assert "\n" not in body["error"], body
    return str(body["error"])


@contextlib.asynccontextmanager
async def open_client(
    url: str,
    token: str | None,
    mode: Mode = "legacy",
    headers: dict[str, str] | None = None,
    **client_options: Any,
) -> AsyncIterator[Conn]:
    """An official `mcp.Client` over Streamable HTTP with a bearer token.

    mode "legacy" speaks 2025-11-25 (initialize, Mcp-Session-Id); "auto" negotiates 2026-07-28.
    """
    seen: dict[str, str] = {}

    async def on_response(resp: httpx2.Response) -> None:
        if sid := resp.headers.get("mcp-session-id"):
            seen["sid"] = sid

    headers = dict(headers or {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    http = create_mcp_http_client(headers=headers)
    http.event_hooks["response"].append(on_response)
    async with http:
        transport = streamable_http_client(url, http_client=http)
        async with Client(transport, mode=mode, **client_options) as client:
            if mode == "auto":
                assert client.protocol_version == MODERN_PROTOCOL, client.protocol_version
            else:
                assert client.protocol_version != MODERN_PROTOCOL
            await client.list_tools()  # 2026-07-28 wants listed tools before calls
            yield Conn(client, mode, seen)


@contextlib.asynccontextmanager
async def client_in_task(url: str, token: str | None, mode: Mode = "legacy") -> AsyncIterator[Conn]:
    """`open_client` held open by a task of its own.

    For async fixtures: pytest-asyncio runs a fixture's setup and teardown in different tasks,
    and anyio's task groups inside the client must be entered and left by the same task.
    """
    loop = asyncio.get_running_loop()
    opened: asyncio.Future[Conn] = loop.create_future()
    closing = asyncio.Event()

    async def hold() -> None:
        try:
            async with open_client(url, token, mode) as conn:
                opened.set_result(conn)
                await closing.wait()
        except BaseException as exc:
            if not opened.done():
                opened.set_exception(exc)
            raise

    task = loop.create_task(hold())
    try:
        yield await opened
    finally:
        closing.set()
        await task


def stop_all(*stops: Callable[[], object]) -> None:
    """Run every stop function even when one fails (nothing left running), then raise the
    first failure."""
    errors: list[BaseException] = []
    for stop in stops:
        try:
            stop()
        except BaseException as exc:  # keep stopping the rest; re-raised below
            errors.append(exc)
    if errors:
        raise errors[0]


def stop_if_running(server: ServerProcess) -> Callable[[], object]:
    def stop() -> object:
        if server.proc is not None and server.proc.poll() is None:
            return server.stop()
        return None

    return stop


async def eventually(
    predicate: Callable[[], Any], within: float, what: str, interval: float = 0.1
) -> Any:
    """Poll `predicate` (sync or async) until it returns something truthy; fail at the
    deadline. Returns that value."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(interval)


def memory_of(pid: int) -> dict[str, int]:
    """A process's resident set now (VmRSS) and at its peak (VmHWM), in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    if "VmRSS" not in out:
        raise AssertionError(f"no VmRSS for pid {pid}")
    return out
