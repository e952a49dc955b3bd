"""Sandboxes with egress started ahead of need (sandbox/pool.py, sandbox/relayed.py), with real
bwrap, the real egress proxy and the Perl relay (egress/relay.pl) as their init: each has a
socket of its own under the policy it was started for, serves only a call with exactly that
policy (rules, principal, secrets) and reports to that call; a proxy that died since, or a
sandbox that ended, is never used; nothing of them outlives the pool.

No network lab: what goes through the proxy here is a CONNECT to a name outside the policy,
which the proxy refuses (403) and reports as a denial, to whoever the socket reports to."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import started_backend
from test_sandbox import collect, sandbox_uid_processes, wait_until

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.domain.secrets import SecretsGrant
from sandbox_runtime.egress.supervisor import EgressProxy, EgressSettings
from sandbox_runtime.errors import SandboxSpawnError
from sandbox_runtime.sandbox import BubblewrapBackend, SandboxSpec, shell_argv
from sandbox_runtime.sandbox.pool import MISS_ENDED, MISS_NETWORK, SandboxPool
from sandbox_runtime.sandbox.spec import ImageRoot

pytestmark = pytest.mark.integration

# Asks the relay's port for a name outside every policy here: the proxy answers 403.
PROBE = (
    "import socket; s = socket.create_connection(('127.0.0.1', 3128), timeout=10); "
    "s.sendall(b'CONNECT refused.invalid:443 HTTP/1.1\\r\\n"
    "Host: refused.invalid:443\\r\\n\\r\\n'); "
    "print(s.recv(200).split(b'\\r\\n')[0].decode())"
)
Denials = list[tuple[str, str]]  # (whose handler, host)


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[BubblewrapBackend]:
    async with started_backend(tmp_path) as backend:
        assert backend.private_dir is not None
        egress = EgressProxy(
            EgressSettings(), backend.private_dir / "egress", backend.sandbox_uid,
            backend.sandbox_gid,
        )  # fmt: skip
        await egress.start()
        assert egress.problem is None, egress.problem
        backend.egress = egress
        try:
            yield backend
        finally:
            await backend.aclose()
            await egress.aclose()


@pytest.fixture
async def pool(backend: BubblewrapBackend) -> AsyncIterator[SandboxPool]:
    pool = SandboxPool(backend, backend.config.limits, size=4, idle_seconds=60)
    pool.cpus = 64  # (refills are skipped on a machine without spare CPU: not here)
    pool.start()
    try:
        yield pool
    finally:
        await pool.aclose()


def proxy(backend: BubblewrapBackend) -> EgressProxy:
    assert isinstance(backend.egress, EgressProxy)
    return backend.egress


def policy(principal: str, allow: str = "allowed.test") -> EgressPolicy:
    return EgressPolicy(allow).granting(SecretsGrant(principal))


def spec(
    backend: BubblewrapBackend, workspace: Path, command: str, egress: EgressPolicy | None,
    denials: Denials | None = None, name: str = "",
) -> SandboxSpec:  # fmt: skip
    def denied(host: str, _port: int, _reason: str) -> None:
        if denials is not None:
            denials.append((name, host))

    return SandboxSpec(
        argv=shell_argv(command), workspace=workspace, limits=backend.config.limits,
        timeout=20.0, egress=egress, on_denied=denied,
    )  # fmt: skip


async def call(pool: SandboxPool, s: SandboxSpec) -> tuple[str, bool]:
    """Run `s` through the pool: (its stdout, whether a sandbox started ahead served it)."""
    hits = pool.hits
    done = await collect(await pool.spawn(s))
    assert done.outcome.exit_code == 0, done.stderr
    return done.stdout, pool.hits > hits


def socket_dirs(backend: BubblewrapBackend) -> list[str]:
    return sorted(p.name for p in proxy(backend).base_dir.iterdir())


async def test_a_pooled_sandbox_with_egress_serves_the_next_call_and_reports_to_it(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    denials: Denials = []
    probe = f'python3 -c "{PROBE}"'
    first = spec(backend, workspace, probe, policy("alice"), denials, "first")
    assert await call(pool, first) == ("HTTP/1.1 403 Forbidden\n", False)
    await wait_until(lambda: pool.ready_count == 1, what="a sandbox with egress started ahead")
    started = next(iter(pool._ready.values()))
    assert started.lease is not None
    # Its own socket, opened under the call's policy while nothing ran in it.
    assert started.lease.host_dir.name in socket_dirs(backend)
    second = spec(backend, workspace, f"{probe}; echo X=$X", policy("alice"), denials, "second")
    second.env = {"X": "1"}
    out, hit = await call(pool, second)
    assert (out, hit) == ("HTTP/1.1 403 Forbidden\nX=1\n", True)
    # Each call heard of its own denial only: the socket started ahead reported to the call.
    assert denials == [("first", "refused.invalid"), ("second", "refused.invalid")]


async def test_a_sandbox_started_ahead_is_never_given_to_another_principal_or_policy(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    await call(pool, spec(backend, workspace, "true", policy("alice")))
    await wait_until(lambda: pool.ready_count == 1, what="a sandbox with egress started ahead")
    alices = next(iter(pool._ready.values()))
    assert alices.lease is not None
    # The backend refuses it for bob even when asked directly; the proxy would too.
    bob = spec(backend, workspace, "true", policy("bob"))
    assert not proxy(backend).assign(alices.lease, policy("bob"), None)
    assert not proxy(backend).assign(alices.lease, policy("alice", "other.test"), None)
    misses = pool.misses.get(MISS_NETWORK, 0)
    out, hit = await call(pool, bob)
    assert not hit and pool.misses[MISS_NETWORK] == misses + 1
    # Nor to a call without network: that one gets a sandbox without the relay or a socket.
    await wait_until(lambda: pool.ready_count == 1, what="bob's sandbox started ahead")
    out, hit = await call(pool, spec(backend, workspace, "ls /run/srt-egress | wc -l", None))
    assert (out, hit) == ("0\n", False)
    # And the backend's own check, for a sandbox started for alice handed bob's call:
    started = await backend.prestart(workspace, backend.config.limits, None, policy("alice"))
    with pytest.raises(SandboxSpawnError, match="another network policy"):
        backend.launch(started, bob)
    await wait_until(lambda: not started.proc.running, what="the refused sandbox's end")


async def test_a_proxy_death_since_the_start_means_a_sandbox_of_its_own(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    denials: Denials = []
    probe = f'python3 -c "{PROBE}"'
    await call(pool, spec(backend, workspace, "true", policy("alice")))
    await wait_until(lambda: pool.ready_count == 1, what="a sandbox with egress started ahead")
    old = proxy(backend).pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    await wait_until(lambda: proxy(backend).deaths == 1, what="the proxy's death seen")
    failed = pool.misses.get("failed", 0)
    out, hit = await call(pool, spec(backend, workspace, probe, policy("alice"), denials, "c"))
    # Not the one started ahead (its socket died with the proxy): one of its own, on the new
    # proxy, through which the request went.
    assert (out, hit) == ("HTTP/1.1 403 Forbidden\n", False)
    assert pool.misses["failed"] == failed + 1
    assert proxy(backend).pid not in (None, old)
    assert denials == [("c", "refused.invalid")]


async def test_a_killed_sandbox_started_ahead_is_replaced_and_its_socket_closed(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    await call(pool, spec(backend, workspace, "true", policy("alice")))
    await wait_until(lambda: pool.ready_count == 1, what="a sandbox with egress started ahead")
    started = next(iter(pool._ready.values()))
    assert started.lease is not None
    lease_dir = started.lease.host_dir.name
    started.proc.kill("test")  # (its relay, pid 1 of the sandbox, with it)
    await wait_until(lambda: lease_dir not in socket_dirs(backend), what="its socket closed")
    ended = pool.misses.get(MISS_ENDED, 0)
    out, hit = await call(pool, spec(backend, workspace, "echo ok", policy("alice")))
    assert (out, hit) == ("ok\n", False)
    assert pool.misses[MISS_ENDED] == ended + 1


async def test_nothing_of_the_pooled_sandboxes_with_egress_outlives_the_pool(
    backend: BubblewrapBackend,
) -> None:
    pool = SandboxPool(backend, backend.config.limits, size=4, idle_seconds=60)
    pool.cpus = 64
    pool.start()
    try:
        for name in ("a", "b", "c"):
            workspace = backend.create_workspace(name)
            await call(pool, spec(backend, workspace, "true", policy(name)))
        await wait_until(lambda: pool.ready_count == 3, what="three sandboxes started ahead")
        assert len(socket_dirs(backend)) == 3
    finally:
        await pool.aclose()
    await wait_until(lambda: not socket_dirs(backend), what="every socket closed")
    assert not proxy(backend)._leases
    proxy_pid = proxy(backend).pid  # (it runs as the sandbox user too)
    await wait_until(
        lambda: not [p for p in sandbox_uid_processes(backend) if p != proxy_pid],
        what="no sandbox left",
    )


async def test_the_relay_is_init_undumpable_keeps_its_fds_and_passes_on_the_status(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    workspace = backend.create_workspace("ws")
    check = (
        "cat /proc/1/cmdline | tr '\\0' ' '; echo; "
        "cat /proc/1/environ >/dev/null 2>&1 && echo readable || echo unreadable; "
        "kill -KILL 1; echo alive; echo $(ls /proc/self/fd); kill -TERM $$"
    )
    for _ in range(2):  # (started for its call, then started ahead)
        s = spec(backend, workspace, check, policy("alice"))
        s.env = {"LD_PRELOAD": "/nonexistent.so"}
        hits = pool.hits
        done = await collect(await pool.spawn(s))
        lines = done.stdout.splitlines()
        assert lines[0].startswith("/usr/bin/perl /run/srt-relay.pl "), done.stdout
        # (and none of the relay's descriptors, its listeners or sockets, is the command's)
        assert lines[1:] == ["unreadable", "alive", "0 1 2 3"], done.stdout + done.stderr
        assert done.outcome.exit_code == 128 + signal.SIGTERM
        await wait_until(lambda: pool.ready_count == 1, what="a sandbox started ahead")
    assert pool.hits == hits + 1
    await asyncio.sleep(0)


@pytest.mark.parametrize("network", [True, False])
async def test_an_environments_loader_and_perl_variables_reach_its_command_not_our_perl(
    backend: BubblewrapBackend, tmp_path: Path, network: bool
) -> None:
    """The relay (with egress) and the stub of a sandbox started ahead run the host's Perl
    through the host's loader: an environment's LD_PRELOAD or PERL5OPT (an image's ENV) must
    not act on them (a preloaded library built for the image's libc, a module the host's
    Perl does not have), only on the command, which gets them as it would without us."""
    from test_environments_use import tiny_environment

    image = tiny_environment(tmp_path / "trees", "ldenv")
    env = (("LD_PRELOAD", "/nonexistent/lib.so"), ("PERL5OPT", "-MNo::Such::Module"))
    image = ImageRoot(image.name, image.digest, image.root, image.env + env, image.workdir)
    pool = SandboxPool(backend, backend.config.limits, size=4, idle_seconds=60)
    pool.cpus = 64
    pool.start()
    try:
        workspace = backend.create_workspace("ws")
        for _ in range(2):  # (started for its call, then started ahead)
            s = spec(backend, workspace, "echo $LD_PRELOAD $PERL5OPT", None)
            s.egress, s.image = (policy("alice") if network else None), image
            done = await collect(await pool.spawn(s))
            assert (done.stdout, done.stderr) == ("/nonexistent/lib.so -MNo::Such::Module\n", "")
            await wait_until(lambda: pool.ready_count == 1, what="a sandbox started ahead")
        assert pool.hits == 1
    finally:
        await pool.aclose()


async def test_a_daemon_of_the_command_ends_with_it_and_so_does_its_socket(
    backend: BubblewrapBackend, pool: SandboxPool
) -> None:
    """The relay is init: when the command ends, it does, and the kernel ends the rest of the
    sandbox (a daemon in a session of its own too); its socket on the proxy is closed."""
    workspace = backend.create_workspace("ws")
    daemon = "setsid sh -c 'sleep 60' </dev/null >/dev/null 2>&1 & echo started"
    for _ in range(2):  # (started for its call, then started ahead)
        hits = pool.hits
        proc = await pool.spawn(spec(backend, workspace, daemon, policy("alice")))
        [lease_dir] = socket_dirs(backend)  # (its own; the next is started after it)
        done = await collect(proc)
        assert (done.stdout, done.outcome.exit_code) == ("started\n", 0)
        gone = lambda d=lease_dir: d not in socket_dirs(backend)  # noqa: E731
        await wait_until(gone, what="its socket closed")
        await wait_until(lambda: pool.ready_count == 1, what="a sandbox started ahead")
        # Left: the proxy and the sandbox started ahead (bwrap and its relay), no sleep.
        assert not [p for p in sandbox_uid_processes(backend) if _cmdline(p).startswith("sleep")]
    assert pool.hits == hits + 1


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
