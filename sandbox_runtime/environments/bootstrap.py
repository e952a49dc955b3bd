"""The bases a build starts FROM: `debian:<suite>` (mmdebstrap from the distribution's
packages) and `default` (the host's suite with Python, plus a copy of the shared runtime).

mmdebstrap runs in its `root` mode (the caller is the host's root; builds need it) and
reads the mirror from the host's apt configuration, so a host behind a mirror or a proxy
builds through the same; the suite is the Dockerfile's.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from sandbox_runtime.environments.store import EnvironmentsError

SUITE = re.compile(r"^[a-z][a-z0-9-]{1,30}$")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
VARIANT = "minbase"
# What every debian: base gets besides minbase: the CAs (https for RUN's downloads) and
# what the sandbox's relay needs is the host's own Python, so nothing more.
BASE_PACKAGES = ("ca-certificates",)
# `FROM default`: what the shared runtime (a venv over the system's python3) needs.
DEFAULT_PACKAGES = ("ca-certificates", "python3", "python3-pip", "python3-venv", "libexpat1")
RUNTIME_AT = "opt/srt-runtime"
# Part of FROM default's cache key: a change to what default_base makes rebuilds it.
DEFAULT_BASE_VERSION = "2"

Log = Callable[[str], None]


class BootstrapError(EnvironmentsError):
    """mmdebstrap (or the copy of the runtime) failed."""


def host_mirror(sources: Path = Path("/etc/apt")) -> str:
    """The first Debian archive URI of the host's apt configuration (deb822 or one-line)."""
    candidates: list[str] = []
    for path in sorted((sources / "sources.list.d").glob("*.sources")):
        for line in _lines(path):
            if line.lower().startswith("uris:"):
                candidates += line.split(":", 1)[1].split()
    for path in [sources / "sources.list", *sorted((sources / "sources.list.d").glob("*.list"))]:
        for line in _lines(path):
            words = [w for w in line.split() if not w.startswith("[")]
            if len(words) >= 2 and words[0] == "deb":
                candidates.append(words[1])
    for uri in candidates:
        if "security" not in uri and "debian" in uri:
            return uri.rstrip("/")
    return candidates[0].rstrip("/") if candidates else DEFAULT_MIRROR


def host_suite() -> str | None:
    """The host's Debian suite (VERSION_CODENAME), or None when it is not Debian-family."""
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    fields = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    if fields.get("ID", "").strip('"') != "debian":
        return None
    return fields.get("VERSION_CODENAME", "").strip('"') or None


def debootstrap(
    suite: str,
    target: Path,
    log: Log,
    timeout: float,
    packages: tuple[str, ...] = BASE_PACKAGES,
) -> None:
    """A minbase Debian `suite` at `target` (which must not exist). Raises BootstrapError."""
    if not SUITE.match(suite):
        raise BootstrapError(f"FROM debian:{suite}: not a suite name (e.g. debian:bookworm)")
    if shutil.which("mmdebstrap") is None:
        raise BootstrapError(
            "FROM debian:... needs mmdebstrap on the host: apt-get install mmdebstrap"
        )
    mirror = host_mirror()
    components = "main"
    argv = [
        "mmdebstrap", f"--variant={VARIANT}", "--mode=root", "--format=directory",
        f"--include={','.join(packages)}",
        "--aptopt=Acquire::Retries \"3\"",
        "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--customize-hook=rm -rf \"$1\"/var/cache/apt/archives/*.deb \"$1\"/var/lib/apt/lists/*",
        suite, str(target), f"deb {mirror} {suite} {components}",
    ]  # fmt: skip
    log(f"mmdebstrap {suite} from {mirror} ({VARIANT}, +{','.join(packages)})")
    _run(argv, log, timeout, f"mmdebstrap of debian:{suite}")


def default_base(target: Path, runtime_dir: Path, log: Log, timeout: float) -> None:
    """`FROM default`: the host's suite with python3, and the shared runtime copied to
    /opt/srt-runtime (its venv points at /usr/bin/python3 of the same suite). Raises
    BootstrapError when the host is not Debian or has no runtime."""
    suite = host_suite()
    if suite is None:
        raise BootstrapError(
            "FROM default needs a Debian host (the runtime's Python is the host's): start from "
            "FROM debian:bookworm and install what you need with RUN"
        )
    if not (runtime_dir / "bin" / "python3").exists():
        raise BootstrapError(
            f"FROM default copies the shared runtime, which is not installed at {runtime_dir}: "
            "run `srt-mcp-server runtime install` first"
        )
    debootstrap(suite, target, log, timeout, DEFAULT_PACKAGES)
    log(f"copying the shared runtime from {runtime_dir}")
    dest = target / RUNTIME_AT
    dest.parent.mkdir(parents=True, exist_ok=True)
    _run(["cp", "-a", "--reflink=auto", f"{runtime_dir}/.", str(dest)], log, timeout, "cp")
    # The runtime is a venv made without pip over the system's: `pip` is the system's pip
    # run by the venv's Python, so `RUN pip install` lands in /opt/srt-runtime (PEP 668
    # refuses the system's own site-packages).
    for name in ("pip", "pip3"):
        wrapper = dest / "bin" / name
        wrapper.unlink(missing_ok=True)
        wrapper.write_text(f'#!/bin/sh\nexec /{RUNTIME_AT}/bin/python3 -m pip "$@"\n')
        wrapper.chmod(0o755)
    # The venv's own record of where it was made: where it is now.
    cfg = dest / "pyvenv.cfg"
    if cfg.is_file():
        text = re.sub(r"(?m)^command = .*$", "", cfg.read_text())
        cfg.write_text(text)


def copy_tree(source: Path, target: Path, log: Log, timeout: float) -> None:
    """A full copy of a stored root (reflinks where the filesystem has them), for a RUN
    or COPY step to change without touching the stored one."""
    _run(["cp", "-a", "--reflink=auto", str(source), str(target)], log, timeout, "cp")


def _run(argv: list[str], log: Log, timeout: float, what: str) -> None:
    """Run `argv` (its own process group), each output line to `log`; killed past `timeout`."""
    tail: list[str] = []
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "LC_ALL": "C.UTF-8"}, start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        raise BootstrapError(f"{what} did not start: {exc}") from None
    timer = threading.Timer(timeout, _kill_group, (proc,))
    timer.start()
    assert proc.stdout is not None
    try:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            log(line)
            tail = [*tail[-19:], line]
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    if code != 0:
        raise BootstrapError(f"{what} failed (exit {code}): " + " | ".join(tail[-5:]))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
