"""Building environments for real (issue 46): mmdebstrap from the distribution's packages,
RUN in our build sandbox with egress only to the registries, the layer cache, the limits,
and what a failed build leaves (the previous environment). The environments the other
modules use come from the shared `built_environments` fixture (tests/environments_harness.py).
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from environments_harness import BuiltEnvironments, build_all, locked, run_env_cli

from sandbox_runtime.environments.store import Environment

pytestmark = pytest.mark.timeout(3600)


def run_in(env: Environment, command: str, workspace: Path | None = None) -> str:
    """`command` by /bin/sh in a plain bwrap sandbox rooted (read-only) in `env` as uid 1000."""
    assert env.root is not None
    args = ["bwrap", "--ro-bind", str(env.root), "/", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--unshare-all", "--uid", "1000", "--gid", "1000",
            "--clearenv", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]  # fmt: skip
    for key, value in env.env.items():
        args += ["--setenv", key, value]
    if "PATH" not in env.env:
        args += ["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin"]
    if workspace is not None:
        args += ["--bind", str(workspace), "/workspace", "--chdir", "/workspace"]
    done = subprocess.run(
        [*args, "/bin/sh", "-c", command], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_r_environment_has_irkernel_computes_and_plots(
    built_environments: BuiltEnvironments,
) -> None:
    env = built_environments.get("test-r")
    assert "r" in env.languages and env.kernelspecs["r"].argv[0] == "R"
    script = (
        'cat(sum(1:10), "\\n"); png("/tmp/p.png"); plot(1:3); invisible(dev.off()); '
        'cat(file.size("/tmp/p.png") > 0)'
    )
    out = run_in(env, f"Rscript -e '{script}'")
    assert out.split() == ["55", "TRUE"]
    assert env.description == "R with IRkernel"


def test_go_environment_runs_go_run(built_environments: BuiltEnvironments, tmp_path: Path) -> None:
    env = built_environments.get("test-go")
    (tmp_path / "main.go").write_text(
        'package main\nimport "fmt"\nfunc main() { fmt.Println("go says", 6*7) }\n'
    )
    tmp_path.chmod(0o777)
    assert run_in(env, "go run main.go", tmp_path).strip() == "go says 42"


def test_default_based_environment_adds_a_pip_package(
    built_environments: BuiltEnvironments,
) -> None:
    env = built_environments.get("test-pip")
    assert env.env["PATH"].startswith("/opt/srt-runtime/bin:")
    assert "python" in env.languages
    out = run_in(env, "python -c 'import tabulate, numpy; print(tabulate.tabulate([[1, 2]]))'")
    assert "1  2" in out


def test_rebuild_of_an_unchanged_dockerfile_is_all_cached(
    built_environments: BuiltEnvironments, tmp_path: Path
) -> None:
    before = {name: built_environments.get(name).digest for name in ("test-base", "test-r")}
    started = time.monotonic()
    again = build_all(built_environments.base, tmp_path, ("test-base", "test-r"))
    assert time.monotonic() - started < 120
    for name, digest in before.items():
        assert again.get(name).digest == digest


def _build(
    built: BuiltEnvironments, tmp_path: Path, name: str, dockerfile: str, **extra: str
) -> Any:
    context = tmp_path / f"ctx-{name}"
    context.mkdir(exist_ok=True)
    (context / "Dockerfile").write_text(dockerfile)
    return run_env_cli(["build", name, str(context)], built.base, tmp_path / "state", **extra)


@pytest.fixture
def scratch_name(built_environments: BuiltEnvironments) -> Any:
    """A name for a test's own environment, removed afterwards with the cache entries and
    roots its builds made (under the store's lock: no other run's build meanwhile)."""
    names: list[str] = []
    store = built_environments.store

    def make(name: str) -> str:
        names.append(name)
        return name

    with locked(built_environments.base):
        cached = set(store.cache.glob("*.json"))
        try:
            yield make
        finally:
            for name in names:
                store.remove(name)
            for entry in set(store.cache.glob("*.json")) - cached:
                entry.unlink()
            store.collect()


def test_unsupported_instruction_is_refused_naming_it(
    built_environments: BuiltEnvironments, tmp_path: Path
) -> None:
    done = _build(built_environments, tmp_path, "test-bad", "FROM test-base\nRUN true\nEXPOSE 80\n")
    assert done.returncode == 1
    assert "Dockerfile:3: EXPOSE is not supported" in done.stderr
    assert built_environments.store.get("test-bad") is None


def test_build_that_fails_halfway_keeps_the_previous(
    built_environments: BuiltEnvironments, tmp_path: Path, scratch_name: Any
) -> None:
    name = scratch_name("test-halfway")
    first = _build(built_environments, tmp_path, name, "FROM test-base\nLABEL v=1\n")
    assert first.returncode == 0, first.stderr
    previous = built_environments.get(name).digest
    done = _build(
        built_environments, tmp_path, name,
        "FROM test-base\nRUN echo one > /one\nRUN echo failing; exit 3\nLABEL v=2\n",
    )  # fmt: skip
    assert done.returncode == 1
    assert "step 3/4: RUN echo failing; exit 3" in done.stderr and "exit status 3" in done.stderr
    assert built_environments.get(name).digest == previous
    assert list(built_environments.store.tmp.glob("build-*")) == []


def test_build_over_the_size_limit_is_refused_and_keeps_the_previous(
    built_environments: BuiltEnvironments, tmp_path: Path, scratch_name: Any
) -> None:
    name = scratch_name("test-toobig")
    base = built_environments.get("test-base")
    first = _build(built_environments, tmp_path, name, "FROM test-base\nLABEL v=1\n")
    assert first.returncode == 0, first.stderr
    previous = built_environments.get(name).digest
    limit_mb = base.size_bytes // 2**20 + 40
    done = _build(
        built_environments, tmp_path, name,
        "FROM test-base\nRUN head -c 300M /dev/zero > /big && sleep 30\n",
        SANDBOX_ENVIRONMENT_MAX_MB=str(limit_mb),
    )  # fmt: skip
    assert done.returncode == 1
    assert "SANDBOX_ENVIRONMENT_MAX_MB" in done.stderr and f"{limit_mb} MiB" in done.stderr
    assert built_environments.get(name).digest == previous
    assert list(built_environments.store.tmp.glob("build-*")) == []


def test_run_reaches_only_the_allowed_registries(
    built_environments: BuiltEnvironments, tmp_path: Path
) -> None:
    probe = (
        "exec 3<>/dev/tcp/127.0.0.1/3128; "
        "printf 'GET http://example.com/ HTTP/1.1\\r\\nHost: example.com\\r\\n\\r\\n' >&3; "
        "head -1 <&3; (exec 4<>/dev/tcp/1.1.1.1/80) 2>/dev/null || echo no-route; exit 7"
    )
    done = _build(
        built_environments, tmp_path, "test-net", f'FROM test-base\nRUN bash -c "{probe}"\n'
    )
    assert done.returncode == 1
    assert "HTTP/1.1 403" in done.stderr and "no-route" in done.stderr
    assert "egress refused example.com:80" in done.stderr


def test_copy_stays_in_the_context_and_in_the_root(
    built_environments: BuiltEnvironments, tmp_path: Path, scratch_name: Any
) -> None:
    # (not under /tmp: a RUN step's /tmp is its own tmpfs)
    victim = Path("/var/tmp") / f"srt-test-victim-{uuid.uuid4().hex[:8]}"
    victim.mkdir()
    try:
        _copy_through_links(built_environments, tmp_path, scratch_name, victim)
    finally:
        shutil.rmtree(victim)


def _copy_through_links(
    built_environments: BuiltEnvironments, tmp_path: Path, scratch_name: Any, victim: Path
) -> None:
    name = scratch_name("test-copy")
    context = tmp_path / f"ctx-{name}"
    context.mkdir()
    (context / "app.txt").write_text("app\n")
    (tmp_path / "secret.txt").write_text("secret\n")
    # a link in the root that points at a host directory: COPY through it lands in the root
    done = _build(
        built_environments, tmp_path, name,
        f"FROM test-base\nRUN mkdir -p {victim} && ln -s {victim} /linked\n"
        "COPY app.txt /linked/\nCOPY app.txt /opt/app/\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    env = built_environments.get(name)
    assert env.root is not None
    assert (env.root / "opt/app/app.txt").read_text() == "app\n"
    assert list(victim.iterdir()) == []
    assert (env.root / victim.relative_to("/") / "app.txt").read_text() == "app\n"
    outside = _build(built_environments, tmp_path, name, "FROM test-base\nCOPY ../secret.txt /s\n")
    assert outside.returncode == 1 and "outside the build context" in outside.stderr


def test_run_after_user_runs_as_that_user_without_privileges(
    built_environments: BuiltEnvironments, tmp_path: Path
) -> None:
    done = _build(
        built_environments, tmp_path, "test-user",
        "FROM test-base\nUSER 1234:1234\n"
        "RUN echo uid=$(id -u) gid=$(id -g); touch /etc/x 2>/dev/null || echo no-write; exit 9\n",
    )  # fmt: skip
    assert done.returncode == 1
    assert "uid=1234 gid=1234" in done.stderr and "no-write" in done.stderr
