"""The runtime: a Python environment for sandboxes (ipykernel, a data stack, Deno, kernels).

Built once per host by `srt-mcp-server runtime install` into SANDBOX_RUNTIME_DIR and bound
read-only at /opt/srt-runtime in every sandbox (first on PATH). It is not the server's
environment, whose files sandboxes never see. Its Jupyter kernelspecs are its languages: a
kernelspec installed into `share/jupyter/kernels/` appears as a language without code changes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_runtime.sandbox.host import RUNTIME
from sandbox_runtime.sandbox.spec import ImageRoot

MANIFEST = "srt-runtime.json"
# What the runtime's layout is: a runtime of an older layout is rebuilt by `runtime install`.
# 2: user site-packages on (`pip install --user` into the workspace, ~/.local); 3: found by a
# kernel when it appears after the kernel started, without creating it beforehand.
LAYOUT = 3
SYSTEM_PYTHON = "/usr/bin/python3"  # under /usr, so the environment works inside sandboxes
FILES = Path(__file__).with_name("runtime_files")
PACKAGES = (
    "ipykernel>=6.29",
    "numpy",
    "pandas",
    "matplotlib",
    "scipy",
    "pillow",
    "requests",
    "deno>=2.0",
    "pip",
)
PACKAGES_OF_NOTE = ("ipykernel", "numpy", "pandas", "matplotlib", "scipy", "pillow", "requests")
MPL_CACHE = "share/srt/matplotlib"  # a prebuilt font cache, copied to /tmp by srt_site

SITECUSTOMIZE = f'''"""sandbox_runtime: matplotlib's prebuilt font cache, copied to MPLCONFIGDIR; in
a kernel, the user site-packages (in the workspace) found even when it appears after start, so
a package `pip install --user` puts there imports in the next call (nothing is created)."""
import os as _os
if _os.environ.get("SRT_USER_SITE") == "1":
    import site as _site, sys as _sys

    class _LateUserSite:
        """Last on sys.meta_path: once ~/.local's site-packages exists, put it on sys.path
        (Python skipped it at start) and look there."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if path is not None:
                return None
            try:
                user = _site.getusersitepackages()
            except AttributeError:
                return None
            if user in _sys.path or not _os.path.isdir(user):
                return None
            _site.addsitedir(user)
            _sys.path_importer_cache.pop(user, None)
            import importlib.machinery
            return importlib.machinery.PathFinder.find_spec(name, [user], target)

    _sys.meta_path.append(_LateUserSite)
_target = _os.environ.get("MPLCONFIGDIR")
if _target and not _os.path.isdir(_target):
    try:
        import shutil as _shutil
        _shutil.copytree("{RUNTIME}/{MPL_CACHE}", _target)
    except OSError:
        pass
'''

# fontconfig (fc-list, which matplotlib runs) finds no /etc/fonts in a sandbox: its own file.
FONTS_CONF = "share/srt/fonts.conf"
FONTS_XML = """<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "fonts.dtd">
<fontconfig><dir>/usr/share/fonts</dir><cachedir>/tmp/.fontconfig</cachedir></fontconfig>
"""

BASH_KERNELSPEC = {
    "argv": ["python", "-m", "srt_bash_kernel", "-f", "{connection_file}"],
    "display_name": "bash",
    "language": "bash",
}
DENO_KERNELSPEC = {
    "argv": ["deno", "jupyter", "--kernel", "--conn", "{connection_file}"],
    "display_name": "Deno (TypeScript, JavaScript)",
    "language": "typescript",
    # Deno's kernel speaks TCP only: it runs behind a relay inside its own sandbox.
    # Its console output and results reach iopub on their own schedule, at times after the
    # cell's idle status: the host flushes them (kernel.py) and waits at least this long.
    "metadata": {
        "sandbox_runtime": {"transport": "tcp", "aliases": ["javascript"], "linger_seconds": 0.05}
    },
    "env": {"DENO_DIR": "/tmp/.deno", "DENO_NO_UPDATE_CHECK": "1", "NO_COLOR": "1"},
}


class RuntimeInstallError(Exception):
    """The runtime could not be built."""


@dataclass(frozen=True)
class KernelSpec:
    """One language of the runtime."""

    language: str
    kernel: str  # the kernelspec's directory name
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    tcp: bool = False  # a kernel that cannot use ipc sockets: behind the relay
    linger: float = 0.0  # output may trail the cell's end: flush, and wait at least this long
    display_name: str = ""
    # An environment's kernel (interpreters/env_kernels.py): the root it runs on; None: the
    # runtime's.
    image: ImageRoot | None = None


@dataclass
class Runtime:
    """An installed runtime: where it is, its languages and what it holds."""

    path: Path
    manifest: dict[str, Any]
    kernels: dict[str, KernelSpec]  # language (and alias) -> spec

    @property
    def languages(self) -> list[str]:
        return sorted(self.kernels)


def load_runtime(path: Path) -> Runtime | None:
    """The runtime at `path`, or None when none is installed there."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("layout", 1) < LAYOUT:
        return None  # an older layout: rebuilt by `runtime install`
    kernels: dict[str, KernelSpec] = {}
    root = path / "share" / "jupyter" / "kernels"
    for spec_file in sorted(root.glob("*/kernel.json")):
        try:
            spec = json.loads(spec_file.read_text())
            argv = [str(a) for a in spec["argv"]]
            language = str(spec.get("language") or spec_file.parent.name).lower()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        extra = (spec.get("metadata") or {}).get("sandbox_runtime") or {}
        kernel = KernelSpec(
            language=language,
            kernel=spec_file.parent.name,
            argv=argv,
            env={str(k): str(v) for k, v in (spec.get("env") or {}).items()},
            tcp=extra.get("transport") == "tcp",
            linger=min(1.0, float(extra.get("linger_seconds", 0) or 0)),
            display_name=str(spec.get("display_name", language)),
        )
        for name in (language, *extra.get("aliases", [])):
            kernels.setdefault(str(name).lower(), kernel)
    return Runtime(path, manifest, kernels)


def install_runtime(
    path: Path, requirements: Path | None = None, force: bool = False, log=print
) -> Runtime:
    """Build the runtime into `path` (next to it first, then renamed into place).

    Raises RuntimeInstallError with what failed.
    """
    if (path / MANIFEST).exists() and not force:
        runtime = load_runtime(path)
        if runtime is not None:
            log(f"runtime already installed at {path} (use --force to rebuild)")
            return runtime
    if not os.path.exists(SYSTEM_PYTHON):
        raise RuntimeInstallError(
            f"{SYSTEM_PYTHON} is missing: install python3 (apt-get install python3)"
        )
    staging = path.with_name(path.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    python = staging / "bin" / "python"

    def run(step: str, argv: list[str], env: dict[str, str] | None = None) -> str:
        log(f"[runtime] {step}")
        result = subprocess.run(
            argv,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE if env is not None else None,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeInstallError(f"{step} failed (exit {result.returncode})")
        return result.stdout or ""

    run(
        "1/5 creating the environment", [SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(staging)]
    )
    _enable_user_site(staging / "pyvenv.cfg")
    packages = [*PACKAGES]
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-input"]
    extra = ["-r", str(requirements)] if requirements is not None else []
    run(
        "2/5 installing ipykernel, the data stack and Deno (pip; this takes a while)",
        [*pip, *packages, *extra],
    )
    purelib = run(
        "3/5 adding the kernels",
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        env={},
    ).strip()
    for source in FILES.glob("*.py"):
        shutil.copy(source, Path(purelib) / source.name)
    # Run at every start by a .pth file (a sitecustomize.py would be shadowed by Debian's,
    # which comes first on sys.path once the system's site-packages are seen).
    (Path(purelib) / "srt_site.py").write_text(SITECUSTOMIZE)
    (Path(purelib) / "srt_site.pth").write_text("import srt_site\n")
    (staging / FONTS_CONF).parent.mkdir(parents=True, exist_ok=True)
    (staging / FONTS_CONF).write_text(FONTS_XML)
    kernels = staging / "share" / "jupyter" / "kernels"
    for name, spec in (("bash", BASH_KERNELSPEC), ("deno", DENO_KERNELSPEC)):
        (kernels / name).mkdir(parents=True, exist_ok=True)
        (kernels / name / "kernel.json").write_text(json.dumps(spec, indent=1))
    run(
        "4/5 building matplotlib's font cache",
        [str(python), "-c", "import matplotlib.font_manager"],
        env={"MPLCONFIGDIR": str(staging / MPL_CACHE)},
    )
    log("[runtime] 5/5 writing the manifest")
    manifest = {**_describe(python, staging), "layout": LAYOUT}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _point_scripts_at_sandbox_path(staging)
    _readable_by_all(staging)
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    staging.rename(path)
    log(f"[runtime] installed at {path} in {time.monotonic() - started:.0f} s")
    runtime = load_runtime(path)
    if runtime is None:
        raise RuntimeInstallError("the runtime was installed but cannot be read back")
    return runtime


def _enable_user_site(cfg: Path) -> None:
    """Let the environment see user site-packages (~/.local, in the workspace): pip then takes
    `pip install --user X` (and a plain `pip install X`, the runtime being read-only) there.
    Python turns user site on in a venv only with the system's site-packages visible too;
    they come after the runtime's own on sys.path."""
    text = cfg.read_text()
    cfg.write_text(
        text.replace("include-system-site-packages = false", "include-system-site-packages = true")
    )


def _describe(python: Path, root: Path) -> dict[str, Any]:
    script = (
        "import json, sys, importlib.metadata as m\n"
        "out = {'python': sys.version.split()[0], 'packages': {}}\n"
        f"for name in {list(PACKAGES_OF_NOTE)!r}:\n"
        "    try: out['packages'][name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    described = json.loads(
        subprocess.run(
            [str(python), "-c", script], capture_output=True, text=True, check=True
        ).stdout
    )
    deno = subprocess.run(
        [str(root / "bin" / "deno"), "--version"], capture_output=True, text=True, check=False
    )
    described["deno"] = deno.stdout.split()[1] if deno.returncode == 0 else None
    described["installed_at"] = time.time()
    return described


def _point_scripts_at_sandbox_path(root: Path) -> None:
    """pip wrote the staging path into scripts' #! lines; inside sandboxes it is RUNTIME."""
    old = f"#!{root}/bin/".encode()
    for script in (root / "bin").iterdir():
        if not script.is_file() or script.is_symlink():
            continue
        with open(script, "rb") as f:
            head = f.read(len(old))
        if head == old:
            data = script.read_bytes()
            script.write_bytes(f"#!{RUNTIME}/bin/".encode() + data[len(old) :])


def _readable_by_all(root: Path) -> None:
    """The sandbox user reads the runtime: every directory 0755, every file o+r."""
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                mode = os.stat(full).st_mode
                os.chmod(full, mode | 0o444 | (0o111 if mode & 0o100 else 0))
