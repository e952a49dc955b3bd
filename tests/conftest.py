"""Shared test fixtures."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp_harness import ServerProcess, Servers, runtime_dir, traversable_by_others
from redis_harness import RedisServer

from sandbox_runtime.sandbox import (
    BackendConfig,
    BubblewrapBackend,
    SandboxLimits,
    SandboxProcess,
    SandboxSpec,
)

# ---------------------------------------------------------------------------------------------
# Where the suite's temporary directories live
# ---------------------------------------------------------------------------------------------

SUITE_TMP_PREFIX = "srt-tests-"
_suite_tmp: Path | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Put tmp_path and tmp_path_factory under a directory of this run's own (0711, under
    $SRT_TEST_TMP or /tmp; removed at the end), unless --basetemp names one.

    The sandbox uid must traverse to the workspaces and state dirs the tests make there.
    pytest's own root (/tmp/pytest-of-<user>) will not do: every pytest run on the machine
    closes it to 0700 again, which broke the sandboxes of any other run going on.
    """
    global _suite_tmp
    if config.option.basetemp is not None or hasattr(config, "workerinput"):
        return  # (an xdist worker gets its --basetemp from the controller)
    _suite_tmp = Path(tempfile.mkdtemp(prefix=SUITE_TMP_PREFIX, dir=suite_tmp_parent()))
    os.chmod(_suite_tmp, 0o711)
    config.option.basetemp = str(_suite_tmp / "pytest")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _suite_tmp is not None and not os.environ.get("SRT_KEEP_TEST_TMP"):
        shutil.rmtree(_suite_tmp, ignore_errors=True)


def suite_tmp_parent() -> str:
    return os.environ.get("SRT_TEST_TMP") or "/tmp"


# ---------------------------------------------------------------------------------------------
# Sandbox fixtures (real bubblewrap; see tests/test_sandbox.py)
# ---------------------------------------------------------------------------------------------

# The server's policy in sandbox tests: small enough that limit tests finish fast.
SANDBOX_TEST_LIMITS = SandboxLimits(
    memory_mb=256, pids=64, cpu_cores=1.0, cpu_time_seconds=30, file_size_mb=64
)


class StartedAheadBackend(BubblewrapBackend):
    """A backend whose every sandbox that can be started ahead of need is: started first
    (`prestart`, as the pool does), then handed its command (`launch`). The isolation tests
    run against it too: a pooled sandbox must be all a sandbox started for its call is."""

    launched = 0

    async def spawn(self, spec: SandboxSpec) -> SandboxProcess:
        if not self.can_prestart(spec):
            return await super().spawn(spec)
        started = await self.prestart(spec.workspace, spec.limits, spec.image, spec.egress)
        try:
            proc = self.launch(started, spec)
        except BaseException:
            await self.discard(started)
            raise
        self.launched += 1
        return proc


def new_sandbox_backend(tmp_path: Path, started_ahead: bool = False) -> BubblewrapBackend:
    """A backend (not started) with its workspaces under tmp_path and a cgroup group of its
    own, under the test policy; with `started_ahead`, one whose sandboxes are started ahead."""
    traversable_by_others(tmp_path)
    kind = StartedAheadBackend if started_ahead else BubblewrapBackend
    return kind(
        BackendConfig(
            workspace_root=tmp_path / "workspaces",
            limits=SANDBOX_TEST_LIMITS,
            group_name=f"srt-test-{uuid.uuid4().hex[:12]}",
        )
    )


@contextlib.asynccontextmanager
async def started_backend(
    tmp_path: Path, started_ahead: bool = False
) -> AsyncIterator[BubblewrapBackend]:
    """`new_sandbox_backend`, started (the test fails if it cannot be), closed after."""
    backend = new_sandbox_backend(tmp_path, started_ahead)
    backend.start()
    if backend.unavailable_reason is not None:
        pytest.fail(f"sandbox unavailable: {backend.unavailable_reason}")
    try:
        yield backend
    finally:
        await backend.aclose()  # removes its cgroups too


@pytest.fixture(params=["direct", "started-ahead"])
async def sandbox_backend(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[BubblewrapBackend]:
    """A started backend with its workspaces under tmp_path and a cgroup group of its own:
    one that starts each sandbox for its call, and one that starts them ahead of need."""
    async with started_backend(tmp_path, request.param == "started-ahead") as backend:
        yield backend
    if isinstance(backend, StartedAheadBackend):
        assert backend.launched or request.node.get_closest_marker("no_launch"), (
            "no sandbox of this test was started ahead"
        )


@pytest.fixture
def sandbox_workspace(sandbox_backend: BubblewrapBackend) -> Path:
    """A fresh workspace of `sandbox_backend`."""
    return sandbox_backend.create_workspace("ws")


# --- end of sandbox fixtures -----------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def workspace_mounts_detached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end, detach the workspace images that servers killed by tests left mounted
    (as the next server on their state directory would): no loop device outlives the run."""
    yield
    from sandbox_runtime.workspaces.images import mounts_under, umount

    for point in mounts_under(tmp_path_factory.getbasetemp()):
        with contextlib.suppress(OSError):
            umount(point)


@pytest.fixture(autouse=True)
def _runtime_unless_unit(request: pytest.FixtureRequest) -> None:
    """Every test but the pure ones (`-m unit`) may start a server, which binds the runtime:
    the unit tests run without it, in seconds, on a machine that has none."""
    if request.node.get_closest_marker("unit") is None:
        request.getfixturevalue("sandbox_runtime_installed")


@pytest.fixture(scope="session")
def sandbox_runtime_installed() -> Path:
    """The runtime (Python data stack, Deno, kernels) every test server binds: built here when
    scripts/test has not (the first time takes ~25 s and needs the package index)."""
    from sandbox_runtime.interpreters.runtime import install_runtime, load_runtime

    path = runtime_dir()
    if load_runtime(path) is None:
        install_runtime(path)
    traversable_by_others(path)
    return path


# ---------------------------------------------------------------------------------------------
# A real redis-server, one per test module that asks for it
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# Test servers: one factory per test module, their logs shown when a test fails
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve(
    tmp_path_factory: pytest.TempPathFactory, sandbox_runtime_installed: Path
) -> Iterator[Servers]:
    """The module's server factory: `serve(name, **settings)` is a started, healthy
    `srt-mcp-server` with those SANDBOX_* settings, its work dir (state dir, log) a fresh
    temporary directory named after `name`; `serve.add(server)` starts one made elsewhere.
    Every server it started is stopped at the end of the module (exit asserted, whatever it
    left running killed); a failed test shows the logs of the servers it used.

    A fixture whose servers use another module fixture (`redis_server`, a netlab) asks for that
    one before `serve`: pytest tears fixtures down in the reverse order of their setup, so the
    servers stop before what they use goes."""
    with Servers(tmp_path_factory.mktemp, release=True) as servers:
        yield servers


LOG_OFFSETS = pytest.StashKey[dict[int, int]]()


def servers_of(item: pytest.Item) -> list[ServerProcess]:
    """The servers a test's fixtures hold: as values, in tuples, lists and dicts, in a
    `Servers` or a topology's `replicas`."""
    found: dict[int, ServerProcess] = {}

    def visit(value: Any, depth: int = 0) -> None:
        if isinstance(value, ServerProcess):
            found.setdefault(id(value), value)
        elif depth < 2 and isinstance(value, (tuple, list)):
            for member in value:
                visit(member, depth + 1)
        elif depth < 2 and isinstance(value, dict):
            for member in value.values():
                visit(member, depth + 1)
        elif depth < 2 and isinstance(value, Servers):
            visit(value.started, depth + 1)
        elif depth < 2 and isinstance(getattr(value, "replicas", None), dict):
            visit(value.replicas, depth + 1)

    for value in getattr(item, "funcargs", {}).values():
        visit(value)
    return list(found.values())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[LOG_OFFSETS] = {id(s): s.log_size() for s in servers_of(item)}
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries what its servers logged while it ran."""
    report = yield
    if report.when == "call" and report.failed:
        offsets = item.stash.get(LOG_OFFSETS, {})
        for server in servers_of(item):
            if log := server.log_since(offsets.get(id(server), 0)):
                report.sections.append((f"server log ({server.workdir})", log))
    return report


# ---------------------------------------------------------------------------------------------
# Environments (issue 46): built once per machine, cached (tests/environments_harness.py)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def built_environments(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """test-base, test-r, test-go and test-pip in a store shared by the machine's test runs
    (`.base`: its directory, for a server's SANDBOX_ENVIRONMENTS_DIR)."""
    from environments_harness import build_all, environments_dir

    return build_all(environments_dir(), tmp_path_factory.mktemp("env-builds"))


# ---------------------------------------------------------------------------------------------
# Where a run's time goes, by module (scripts/test sets SRT_MODULE_DURATIONS=30): a module's
# own set-up (its servers, its builds) is in its first test's setup time.
# ---------------------------------------------------------------------------------------------

_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    top = int(os.environ.get("SRT_MODULE_DURATIONS") or 0)
    if top <= 0 or not _MODULE_SECONDS:
        return
    terminalreporter.write_sep("=", f"slowest {top} modules (setup + call + teardown)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:top]:
        terminalreporter.write_line(f"{seconds:9.1f}s {module}")
