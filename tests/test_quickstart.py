"""The README's quick start from a fresh clone: `./scripts/serve` prints what the README shows
(nothing of the installs before it), the printed commands run as printed (`./scripts/srt
connect claude-code`, `./scripts/srt servers logs NAME`), and the README's first call answers
42.

The clone gets a stand-in for `.venv` (the running interpreter, with the clone first on its
path) and the tests' sandbox runtime: what is checked is the scripts and what they print, not
pip or the runtime's build (`./scripts/test` runs those itself)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mcp_harness import ServerProcess, Servers, server_env, traversable_by_others

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def block_after(marker: str, lang: str) -> str:
    start = README.index(marker)
    match = re.compile(rf"```{lang}\n(.*?)```", re.S).search(README, start)
    assert match, f"no ```{lang} block after {marker!r}"
    return match.group(1)


def test_the_quick_start_is_two_commands() -> None:
    block = block_after("## Quick start", "sh")
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["./scripts/serve", "./scripts/test"], block


@dataclass
class Clone(ServerProcess):
    """`./scripts/serve` of a fresh clone, as a user starts it."""

    clone: Path = field(default_factory=Path)
    venv: Path = field(default_factory=Path)
    home: Path = field(default_factory=Path)

    def env(self) -> dict[str, str]:
        env = server_env(self.state_dir, self.port, **self.settings)
        env.update(HOME=str(self.home), SRT_VENV=str(self.venv), PYTHONPATH=str(self.clone))
        env.update(SRT_SETUP_LOG=str(self.workdir / "setup.log"))
        env.pop("SRT_CLI", None)
        return env

    def start(self, timeout: float = 90.0) -> ServerProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(exist_ok=True)
        traversable_by_others(self.state_dir)
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                ["./scripts/serve"], env=self.env(), cwd=self.clone,
                stdin=subprocess.DEVNULL, stdout=err, stderr=err,
            )  # fmt: skip
        try:
            self._wait_answering(timeout)
        except BaseException:
            self.kill()
            raise
        return self


def fresh_clone(tmp: Path) -> tuple[Path, Path]:
    """A clone of this repository's HEAD and a stand-in venv for it."""
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    entry = venv / "bin" / "srt-mcp-server"
    entry.write_text(f'#!/bin/sh\nexec {sys.executable} -m sandbox_runtime.cli "$@"\n')
    entry.chmod(0o755)
    (venv / ".srt-installed").touch()
    os.utime(clone / "pyproject.toml", (0, 0))  # the stand-in is up to date: no pip install
    return clone, venv


def test_serve_prints_what_the_readme_says_and_its_hints_run(
    serve: Servers, tmp_path: Path
) -> None:
    if shutil.which("git") is None:
        pytest.fail("git is not installed")
    clone, venv = fresh_clone(tmp_path)
    home = tmp_path / "user-home"
    home.mkdir()
    server = Clone(tmp_path / "work", clone=clone, venv=venv, home=home)
    serve.add(server)
    printed = server.stderr_text()
    listening = next(i for i, line in enumerate(printed.splitlines()) if "listening on" in line)
    before = printed.splitlines()[:listening]
    assert len(before) <= 2 and not any("pip" in line for line in before), printed

    shown = block_after("Once it listens", "")
    for line in shown.strip().splitlines():
        line = line.replace(":8080", f":{server.port}")
        pattern = re.escape(line).replace("…", ".*")
        assert re.search(pattern, printed), f"README shows {line!r}; serve printed:\n{printed}"
    hint = re.search(r"wire an MCP client to it: (\./scripts/srt connect claude-code)", printed)
    assert hint, printed

    env = server.env()
    env["PATH"] = "/usr/bin:/bin"  # no claude CLI: connect edits ~/.claude.json
    done = subprocess.run(hint.group(1).split(), cwd=clone, env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"http://127.0.0.1:{server.port}/mcp" in (home / ".claude.json").read_text()

    done = subprocess.run(["./scripts/srt", "servers", "logs", "tme"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.stderr.startswith("./scripts/srt servers: no server named 'tme'"), done.stderr

    example = block_after("## A model's first call", "python").replace(":8080", f":{server.port}")
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.stdout == "42\n", done.stderr[-2000:]

    server.proc.send_signal(signal.SIGINT)  # type: ignore[union-attr]
    deadline = time.monotonic() + 20
    while server.proc.poll() is None and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.1)
    assert server.proc.returncode in (0, 130), server.stderr_text()[-2000:]  # type: ignore[union-attr]
    assert "Traceback" not in server.stderr_text(), server.stderr_text()[-3000:]
