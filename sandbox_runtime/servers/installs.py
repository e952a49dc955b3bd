"""Hosted servers' installs: each pypi:/npm: entry's environment, built ahead of time into
`<servers_dir>/install/<name>` and bound read-only at INSTALL_MOUNT in its sandboxes, so an
instance's start never downloads anything.

An install is made next to its final place and renamed into it only once it worked: a failed
one leaves nothing behind, and the previous good install stays until a new one replaces it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import posixpath
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sandbox_runtime.sandbox.host import SERVER_DIR
from sandbox_runtime.servers.catalog import NAME, CatalogError, Entry

INSTALL_MOUNT = SERVER_DIR  # where `install/<name>` appears inside the entry's sandboxes
RECORD = "installed.json"
TIMEOUT = 600.0  # seconds one pip/npm step may take
OUTPUT_LINES = 20  # of a failed tool's output, in the error
# Sandboxes see the host's /usr and nothing else of its programs: an interpreter elsewhere
# (pyenv, nvm, a uv-managed Python) would be missing inside.
VISIBLE_PREFIX = "/usr/"
SYSTEM_PYTHON = "/usr/bin/python3"  # when the server's own base interpreter is not under /usr
# Variables of the server's environment that would send pip or npm somewhere other than the
# environment being built (or change what Python loads while building it).
CHILD_ENV_DROP = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "VIRTUAL_ENV",
        "PIP_USER",
        "PIP_TARGET",
        "PIP_PREFIX",
        "PIP_ROOT",
        "PIP_NO_COMPILE",  # bytecode is compiled now: the sandbox's mount is read-only
        "NPM_CONFIG_GLOBAL",
        "NPM_CONFIG_LOCATION",
        "NPM_CONFIG_PREFIX",
    }
)
NPM_MISSING = "npm not found: install Node.js and npm (apt-get install nodejs npm)"

# Prints the installed distribution's version and console scripts (run by the environment's
# own Python, with the distribution's name as argv[1]).
DESCRIBE_DIST = """\
import json, sys, importlib.metadata as m
d = m.distribution(sys.argv[1])
scripts = {ep.name: ep.value for ep in d.entry_points if ep.group == "console_scripts"}
print(json.dumps({"name": d.metadata["Name"], "version": d.version, "scripts": scripts}))
"""
DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
ENTRY_POINT = re.compile(rf"\s*(?P<module>{DOTTED})\s*:\s*(?P<attr>{DOTTED})\s*(?:\[[^\]]*\])?\s*")


@dataclass(frozen=True)
class Installed:
    """What an install built: the program an instance runs, inside its sandbox."""

    name: str
    package: str  # the entry's package at install time (`pypi:…`, `npm:…`)
    version: str  # the version that was resolved and installed
    program: tuple[str, ...]  # argv inside the sandbox, before the entry's args
    installed_at: float  # time.time()


def install_dir(servers_dir: Path, name: str) -> Path:
    """Where entry `name`'s install lives on the host (bound at INSTALL_MOUNT)."""
    return servers_dir / "install" / name


def read_installed(servers_dir: Path, name: str) -> Installed | None:
    """The install record of `name`, or None: not installed (or its record is unreadable)."""
    if not NAME.fullmatch(name):
        return None
    try:
        data = json.loads((install_dir(servers_dir, name) / RECORD).read_text(encoding="utf-8"))
        if not isinstance(data["program"], list):
            return None
        record = Installed(
            name=data["name"],
            package=data["package"],
            version=data["version"],
            program=tuple(data["program"]),
            installed_at=float(data["installed_at"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    texts = (record.name, record.package, record.version, *record.program)
    if record.name != name or not record.program or not all(isinstance(t, str) for t in texts):
        return None
    return record


def install_entry(
    entry: Entry,
    servers_dir: Path,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Installed | None:
    """Build `entry`'s environment (pypi: a venv; npm: a node_modules tree) and return its
    record; None for a command or remote entry, which has nothing to install. An install of
    the same package is kept (its record returned, nothing downloaded) unless `force`.
    `log` gets a line per step.

    Raises CatalogError naming the entry (a failing pip/npm: with the end of its output).
    """
    if entry.kind not in ("pypi", "npm"):
        return None
    try:
        return _install(entry, servers_dir, force, log)
    except OSError as exc:  # the state dir itself (permissions, a full disk)
        where = f" ({exc.filename})" if exc.filename else ""
        raise CatalogError(f"{entry.name}: cannot install: {exc.strerror or exc}{where}") from None


def _install(entry: Entry, servers_dir: Path, force: bool, log: Callable[[str], None]) -> Installed:
    root = servers_dir / "install"
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    final = root / entry.name
    with _locked(root):
        current = read_installed(servers_dir, entry.name)
        if (
            current is not None
            and current.package == entry.package
            and (final / "env").is_dir()
            and not force
        ):
            return current
        _remove_leftovers(root, entry.name)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.new-", dir=root))
        try:
            os.chmod(staging, 0o755)
            if entry.kind == "pypi":
                version, program = _install_pypi(entry, staging, log)
            else:
                version, program = _install_npm(entry, staging, log)
            record = Installed(entry.name, entry.package, version, program, time.time())
            _readable_by_all(staging)
            _write_record(staging, record)
            _move_into_place(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return record


def remove_install(servers_dir: Path, name: str) -> None:
    """Remove `name`'s install (nothing there: nothing to do). Raises CatalogError for a name
    that no entry can have."""
    if not NAME.fullmatch(name):
        raise CatalogError(f"{name!r} is not a server's name")
    root = servers_dir / "install"
    if not root.is_dir():
        return
    with _locked(root):
        final = root / name
        if final.exists():
            # Out of its place first, so nobody sees a half-deleted install.
            gone = root / f".{name}.old-{os.getpid()}"
            final.rename(gone)
            shutil.rmtree(gone, ignore_errors=True)
        _remove_leftovers(root, name)


# --- pypi --------------------------------------------------------------------------------


def _install_pypi(
    entry: Entry, staging: Path, log: Callable[[str], None]
) -> tuple[str, tuple[str, ...]]:
    spec = entry.package_spec
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
    if match is None:  # (parse_entry checked it)
        raise CatalogError(f"{entry.name}: {spec!r} is not a PyPI requirement")
    dist = match.group(0)
    env = staging / "env"
    python = str(env / "bin" / "python")
    _run(entry, "creating a Python environment", [_base_python(entry), "-m", "venv", str(env)], log)
    _run(
        entry,
        f"pip install {spec}",
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", spec],
        log,
    )
    try:
        info = json.loads(
            _run(entry, "reading its programs", [python, "-c", DESCRIBE_DIST, dist], log)
        )
        version, scripts = str(info["version"]), dict(info["scripts"])
    except (ValueError, KeyError, TypeError):
        raise CatalogError(f"{entry.name}: cannot read what {dist} installed") from None
    script = _pick(entry, "console script", scripts, dist)
    found = ENTRY_POINT.fullmatch(str(scripts[script]))
    if found is None:
        raise CatalogError(
            f"{entry.name}: console script {script} = {scripts[script]!r} is not module:function"
        )
    module, attr = found.group("module"), found.group("attr")
    head = attr.split(".", 1)[0]
    program = (
        f"{INSTALL_MOUNT}/env/bin/python",
        "-c",
        f"import sys; from {module} import {head}; sys.exit({attr}())",
    )
    return version, program


def _base_python(entry: Entry) -> str:
    """An interpreter under /usr for the environment (its bin/python links to it)."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if base.startswith(VISIBLE_PREFIX):
        return base
    system = os.path.realpath(SYSTEM_PYTHON)
    if os.access(system, os.X_OK) and system.startswith(VISIBLE_PREFIX):
        return system
    raise CatalogError(
        f"{entry.name}: the server's Python is {base} and there is no {SYSTEM_PYTHON}: a "
        "hosted server's environment needs an interpreter under /usr, the only part of the "
        "host sandboxes see (apt-get install python3 python3-venv)"
    )


# --- npm ---------------------------------------------------------------------------------


def _install_npm(
    entry: Entry, staging: Path, log: Callable[[str], None]
) -> tuple[str, tuple[str, ...]]:
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        raise CatalogError(f"{entry.name}: {NPM_MISSING}")
    node = os.path.realpath(node)
    if not node.startswith(VISIBLE_PREFIX):
        raise CatalogError(
            f"{entry.name}: node is {node}, outside /usr, the only part of the host sandboxes "
            "see: install Node.js from the system's packages (apt-get install nodejs npm)"
        )
    spec = entry.package_spec
    package = _npm_name(spec)
    env = staging / "env"
    env.mkdir(mode=0o755)
    _run(
        entry,
        f"npm install {spec}",
        [npm, "install", "--prefix", str(env), "--no-audit", "--no-fund", "--omit=dev", spec],
        log,
    )
    home = env / "node_modules" / package
    try:
        manifest = json.loads((home / "package.json").read_text(encoding="utf-8"))
        version, bins = str(manifest["version"]), manifest.get("bin")
    except (OSError, ValueError, KeyError, TypeError):
        raise CatalogError(f"{entry.name}: cannot read {package}'s package.json") from None
    last = package.rsplit("/", 1)[-1]
    if isinstance(bins, str):
        bins = {last: bins}
    if not isinstance(bins, dict) or not all(isinstance(v, str) for v in bins.values()):
        bins = {}
    path = posixpath.normpath(bins[_pick(entry, "bin", bins, last)])
    if path.startswith(("/", "..")) or not (home / path).is_file():
        raise CatalogError(f"{entry.name}: {package}'s bin {path!r} is not a file of the package")
    return version, (node, f"{INSTALL_MOUNT}/env/node_modules/{package}/{path}")


def _npm_name(spec: str) -> str:
    """The package's name in `NAME`, `NAME@VERSION`, `@SCOPE/NAME@VERSION`."""
    if spec.startswith("@"):
        return "@" + spec[1:].split("@", 1)[0]
    return spec.split("@", 1)[0]


# --- common ------------------------------------------------------------------------------


def _pick(entry: Entry, what: str, choices: dict[str, Any], name: str) -> str:
    """The program among a package's `choices` named like the package, else the only one."""
    if not choices:
        raise CatalogError(
            f"{entry.name}: {entry.package} has no {what} (a program to run): add it as a "
            "command instead"
        )
    wanted = _normalized(name)
    for choice in choices:
        if _normalized(choice) == wanted:
            return choice
    if len(choices) == 1:
        return next(iter(choices))
    raise CatalogError(
        f"{entry.name}: {entry.package} has several {what}s and none is named {name}: "
        f"{', '.join(sorted(choices))}"
    )


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run(
    entry: Entry,
    step: str,
    argv: list[str],
    log: Callable[[str], None],
) -> str:
    """Run one install step (no shell, umask 022 so the sandbox user can read what it makes);
    its output, stdout and stderr together. Raises CatalogError."""
    log(f"{entry.name}: {step}")
    env = {k: v for k, v in os.environ.items() if k.upper() not in CHILD_ENV_DROP}
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            umask=0o022,
            start_new_session=True,  # its own group: a timeout ends npm's children too
        )
    except OSError as exc:
        raise CatalogError(f"{entry.name}: {step}: cannot run {argv[0]} ({exc.strerror})") from None
    with proc:
        try:
            raw, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise CatalogError(f"{entry.name}: {step} took longer than {TIMEOUT:.0f} s") from None
        except BaseException:
            _kill_group(proc)
            raise
    output = raw.decode("utf-8", "replace")
    if proc.returncode != 0:
        tail = "\n".join(output.rstrip().splitlines()[-OUTPUT_LINES:])
        raise CatalogError(f"{entry.name}: {step} failed (exit {proc.returncode}):\n{tail}")
    return output


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One install or removal at a time under `root` (two `servers install` at once)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_leftovers(root: Path, name: str) -> None:
    """Staging and old directories of `name` that a killed install or removal left."""
    for path in root.glob(f".{name}.*"):
        if path.is_dir() and re.fullmatch(rf"\.{re.escape(name)}\.(new|old)-.*", path.name):
            shutil.rmtree(path, ignore_errors=True)


def _write_record(directory: Path, record: Installed) -> None:
    tmp = directory / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(asdict(record), indent=1) + "\n", encoding="utf-8")
    os.chmod(tmp, 0o644)
    os.replace(tmp, directory / RECORD)


def _move_into_place(staging: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    try:
        staging.rename(final)
    except OSError:
        if old.exists():
            old.rename(final)  # the previous install stays
        raise
    shutil.rmtree(old, ignore_errors=True)


def _readable_by_all(root: Path) -> None:
    """The sandbox user (not root) reads the install: directories 0755, files 0644 (0755
    where the owner may execute); nobody else may write."""
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                mode = os.stat(full).st_mode
                os.chmod(full, (mode & 0o755) | 0o444 | (0o111 if mode & 0o100 else 0))
