"""Environments built once per machine for the tests (issue 46): a Debian base, then `r`,
`go` and a `default`-based one adding a pip package, all FROM it or FROM default.

Builds are costly, so they go to one store shared by every test run on the machine, next to
the test runtime (`<runtime>.environments`, or SRT_TEST_ENVIRONMENTS_DIR): the build cache
there is keyed by (parent digest, instruction), so a rerun of an unchanged Dockerfile is a
few cached steps. A lock file serializes the test processes that build at once. Test modules
use the `built_environments` fixture (conftest.py): it gives the store's directory (for a
server's SANDBOX_ENVIRONMENTS_DIR) and each environment by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mcp_harness import runtime_dir

from sandbox_runtime.domain.egress import EgressPolicy
from sandbox_runtime.environments.store import Environment, EnvironmentStore

PREFIX = "test-"  # the names the tests build (a machine's own environments stay apart)
# The registries RUN steps reach: Debian's archive and PyPI.
REGISTRIES = ("deb.debian.org", "security.debian.org", "pypi.org", "files.pythonhosted.org")
PIP_PACKAGE = "tabulate"  # small, pure Python, and not in the shared runtime

DOCKERFILES = {
    "test-base": """\
FROM debian:bookworm
LABEL description="Debian bookworm (minbase) for the tests"
ENV LANG=C.UTF-8
""",
    "test-r": """\
FROM test-base
RUN apt-get update \\
 && apt-get install -y --no-install-recommends r-base-core r-cran-irkernel \\
 && rm -rf /var/lib/apt/lists/*
LABEL description="R with IRkernel"
""",
    "test-go": """\
FROM test-base
RUN apt-get update \\
 && apt-get install -y --no-install-recommends golang-go ca-certificates \\
 && rm -rf /var/lib/apt/lists/*
ENV GOPATH=/tmp/go GOCACHE=/tmp/go-cache GOFLAGS=-mod=mod
LABEL description="Go"
""",
    "test-pip": f"""\
FROM default
RUN pip install --no-cache-dir {PIP_PACKAGE}
LABEL description="the default runtime plus {PIP_PACKAGE}"
""",
}
ORDER = ("test-base", "test-r", "test-go", "test-pip")


def environments_dir() -> Path:
    given = os.environ.get("SRT_TEST_ENVIRONMENTS_DIR")
    if given:
        return Path(given)
    runtime = runtime_dir()
    return runtime.parent / f"{runtime.name}.environments"


def build_cidrs(names: tuple[str, ...] = REGISTRIES) -> str:
    """Exact addresses of the registries when they resolve to ranges the egress proxy
    refuses unless named (a machine whose mirror answers for them on a private or
    documentation address)."""
    policy = EgressPolicy(",".join(names))
    cidrs: set[str] = set()
    for name in names:
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM):
                address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
                if policy.vet_address(address) is not None:
                    cidrs.add(f"{address}/{address.max_prefixlen}")
    return ",".join(sorted(cidrs))


def cli_env(base: Path, state: Path, **extra: str) -> dict[str, str]:
    """The environment of an `srt-mcp-server env …` run of the tests."""
    return {
        **os.environ,
        "SANDBOX_STATE_DIR": str(state),
        "SANDBOX_ENVIRONMENTS_DIR": str(base),
        "SANDBOX_RUNTIME_DIR": str(runtime_dir()),
        "SANDBOX_ENVIRONMENT_BUILD_ALLOW": ",".join(REGISTRIES),
        "SANDBOX_ENVIRONMENT_BUILD_ALLOW_CIDRS": build_cidrs(),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        **extra,
    }


def run_env_cli(
    args: list[str], base: Path, state: Path, timeout: float = 1800, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_runtime.cli", "env", *args],
        env=cli_env(base, state, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass
class BuiltEnvironments:
    base: Path  # the store's directory: SANDBOX_ENVIRONMENTS_DIR for a server
    seconds: dict[str, float] = field(default_factory=dict)  # build time of this run's builds

    @property
    def store(self) -> EnvironmentStore:
        return EnvironmentStore(self.base)

    def get(self, name: str) -> Environment:
        env = self.store.get(name)
        assert env is not None, f"environment {name} was not built"
        return env


@contextlib.contextmanager
def locked(base: Path) -> Iterator[None]:
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".test-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_all(base: Path, work: Path, names: tuple[str, ...] = ORDER) -> BuiltEnvironments:
    """Build (or find cached) each of `names`, in order. `work`: a scratch directory for the
    build contexts and the CLI's state directory. Raises AssertionError with the build's log
    when one fails."""
    built = BuiltEnvironments(base)
    with locked(base):
        for name in names:
            context = work / name
            context.mkdir(parents=True, exist_ok=True)
            (context / "Dockerfile").write_text(DOCKERFILES[name])
            started = time.monotonic()
            done = run_env_cli(["build", name, str(context)], base, work / "state")
            built.seconds[name] = time.monotonic() - started
            assert done.returncode == 0, f"env build {name} failed:\n{done.stderr[-4000:]}"
    return built


def main() -> int:
    """Build (or find cached) every test environment in the machine's store: scripts/test runs
    this beside its other set-up, so the `built_environments` fixture finds them cached."""
    import tempfile

    parent = Path(os.environ.get("SRT_TEST_TMP") or "/tmp")
    work = Path(tempfile.mkdtemp(prefix="srt-env-builds-", dir=parent))
    os.chmod(work, 0o711)  # (the sandbox uid traverses to the build contexts)
    started = time.monotonic()
    try:
        built = build_all(environments_dir(), work)
    except AssertionError as exc:
        print(f"[environments] {exc}", file=sys.stderr)
        return 1
    finally:
        subprocess.run(["rm", "-rf", "--", str(work)], check=False)
    each = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in built.seconds.items())
    print(f"[environments] ready in {time.monotonic() - started:.0f} s ({each})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
