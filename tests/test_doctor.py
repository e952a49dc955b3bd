"""`srt-mcp-server doctor` on this host: every layer checked for real, exit code by verdict."""

from __future__ import annotations

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
