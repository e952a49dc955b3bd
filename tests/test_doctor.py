"""`srt-mcp-server doctor` on this host: every layer checked for real, exit code by verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.integration


def doctor(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    return subprocess.run(
        [sys.executable, "-m", "sandbox_runtime.cli", "doctor"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def layers(output: str) -> dict[str, str]:
    """layer name -> OK / FAIL / WARN, from the doctor's table."""
    found = {}
    for line in output.splitlines():
        label, _, rest = line.partition("  ")
        if label.strip() in ("OK", "FAIL", "WARN") and rest.strip():
            found[rest.strip().split("  ")[0]] = label.strip()
    return found


def test_doctor_passes_every_layer_on_this_host_and_checks_the_spawner() -> None:
    result = doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    seen = layers(result.stdout)
    for layer in (
        "bubblewrap",
        "user namespaces",
        "seccomp",
        "spawner",
        "sandbox run",
        "sandbox /dev",
    ):
        assert seen.get(layer) == "OK", (layer, result.stdout)
    assert "CapEff=0000000000000000" in result.stdout
    assert "NoNewPrivs=1" in result.stdout
    assert "executions can run" in result.stdout
    # Root, and a temporary directory where device nodes work: the cheap /dev must be in use.
    if os.geteuid() == 0 and not os.statvfs(tempfile.gettempdir()).f_flag & os.ST_NODEV:
        assert seen.get("prebuilt /dev") == "OK", result.stdout
    else:
        assert seen.get("prebuilt /dev") == "WARN", result.stdout


def test_doctor_fails_with_the_fix_when_bubblewrap_is_missing() -> None:
    result = doctor(SANDBOX_BWRAP_PATH="/nonexistent/bwrap")
    assert result.returncode == 1, result.stdout + result.stderr
    assert layers(result.stdout).get("bubblewrap") == "FAIL", result.stdout
    assert "apt-get install bubblewrap" in result.stdout
    assert "executions cannot run" in result.stdout


# In a process of its own (a backend makes its process a child subreaper): doctor's live
# checks with a prebuilt /dev whose /dev/null the sandbox user may not open (root may).
DEV_REFUSED = """
import asyncio, dataclasses, json, os
import sandbox_runtime.sandbox.prepare as prepare_module
from sandbox_runtime.config import Settings
from sandbox_runtime.doctor import check_live

real_build_dev = prepare_module.build_dev

def refused_inside(dev):
    built = real_build_dev(dev)
    os.chmod(built / "null", 0o600)
    return built

prepare_module.build_dev = refused_inside
checks = asyncio.run(check_live(Settings(_env_file=None)))
print(json.dumps({c.layer: dataclasses.asdict(c) for c in checks}))
"""


def test_doctor_fails_the_sandbox_dev_when_a_sandbox_cannot_open_its_devices() -> None:
    result = subprocess.run(
        [sys.executable, "-c", DEV_REFUSED],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")},
    )
    assert result.returncode == 0, result.stderr
    checks = json.loads(result.stdout)
    assert checks["sandbox run"]["ok"], checks["sandbox run"]
    assert checks["prebuilt /dev"]["ok"]
    dev = checks["sandbox /dev"]
    assert not dev["ok"] and dev["required"]
    assert "Permission denied" in dev["detail"] and "device cgroup" in dev["fix"]


def test_doctor_reports_each_language_and_starts_an_interpreter(
    sandbox_runtime_installed: object,
) -> None:
    from mcp_harness import runtime_dir

    with tempfile.TemporaryDirectory() as state:
        result = doctor(SANDBOX_RUNTIME_DIR=str(runtime_dir()), SANDBOX_STATE_DIR=state)
    assert result.returncode == 0, result.stdout + result.stderr
    found = layers(result.stdout)
    assert found["languages"] == "OK" and found["interpreter"] == "OK", result.stdout
    line = next(x for x in result.stdout.splitlines() if "languages" in x)
    for language in ("bash", "javascript", "python", "typescript"):
        assert language in line
    missing = doctor(SANDBOX_RUNTIME_DIR="/nonexistent/runtime")
    assert missing.returncode == 0, "no runtime: run_code is off, executions still run"
    assert layers(missing.stdout)["languages"] == "WARN"
    assert "runtime install" in missing.stdout
