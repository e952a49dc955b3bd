"""Interpreters on an environment (DESIGN §21): the kernels are the environment's own (its
Jupyter kernelspecs, e.g. IRkernel's `ir` for run_code(language="r")), run in a sandbox on
its root.

Between the host and a kernel sits our pipe (runtime_files/srt_kernel_pipe.py): Python with
pyzmq. An environment need not have either (an R one has neither), so the pipe runs as the
egress relay does: on the host's Python through the host's loader (the host's /usr is bound
read-only at HOST_DIR/usr on every environment's sandbox), importing pyzmq from the runtime
(bound at /opt/srt-runtime, built for that same Python). The kernel itself is started by the
pipe as a plain child: the environment's program, its libraries, its PATH. It listens on
loopback TCP (a kernel's ipc naming is not the same everywhere: IRkernel's is not Jupyter's).
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.environments.store import Environment
from sandbox_runtime.errors import InvalidRequestError, SandboxUnavailableError
from sandbox_runtime.execution.images import SessionImages, image_of
from sandbox_runtime.interpreters.runtime import KernelSpec
from sandbox_runtime.sandbox.host import RUNTIME
from sandbox_runtime.sandbox.spec import ImageRoot

# Runs the pipe with the runtime's site-packages first on sys.path (-I leaves out every
# variable and user directory: the environment's PYTHONPATH never reaches the pipe).
PIPE_BOOT = (
    "import runpy, sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[2:];"
    " runpy.run_path(sys.argv[0], run_name='__main__')"
)


def environment_spec(env: Environment, image: ImageRoot, language: str) -> KernelSpec:
    """The kernel of `language` (base name, lower case) in `env`. Raises InvalidRequestError
    when it has none."""
    found = env.kernelspecs.get(language)
    if found is None:
        found = next((k for k in env.kernelspecs.values() if k.language.lower() == language), None)
    if found is None:
        have = ", ".join(sorted(env.kernelspecs)) or "none"
        raise InvalidRequestError(
            f"the environment {env.name!r} has no {language} kernel (its languages: {have}); "
            "execute_code runs any program it has, or use an environment with a Jupyter "
            f"kernelspec for {language} (list_environments)"
        )
    return KernelSpec(
        language=language,
        kernel=language,
        argv=list(found.argv),
        tcp=True,
        linger=0.1,
        display_name=found.display_name,
        image=image,
    )


def pipe_argv(relay_python: list[str], runtime_dir: Path | None, pipe: str) -> list[str]:
    """How the pipe starts in a sandbox on an environment (then its own arguments).
    Raises SandboxUnavailableError when the host cannot run it there."""
    sites = (
        sorted(glob.glob(str(runtime_dir / "lib" / "python3*" / "site-packages")))
        if runtime_dir
        else []
    )
    if not relay_python or not sites:
        raise SandboxUnavailableError(
            "interpreters on environments need the host's python3 and the runtime (pyzmq) "
            "installed: run `srt-mcp-server runtime install`"
        )
    site = RUNTIME + sites[0].removeprefix(str(runtime_dir))
    return [*relay_python, "-I", "-c", PIPE_BOOT, site, pipe]


def session_spec(images: SessionImages | None, owner: Owner, language: str) -> KernelSpec | None:
    """The kernel of `language` (its base name, lower case) for `owner`'s session when it runs
    on an environment (None: the default's, the runtime's). Raises InvalidRequestError,
    SandboxUnavailableError."""
    env = images.session_environment(owner) if images is not None else None
    image = image_of(env) if env is not None else None
    if env is None or image is None:
        return None
    return environment_spec(env, image, language)


def session_languages(
    images: SessionImages | None, owner: Owner, running: Container[tuple[Owner, str]]
) -> list[dict[str, Any]] | None:
    """list_languages for `owner`'s session on an environment: its kernels (None: the
    session is on the default, or has not chosen yet: the runtime's)."""
    env = images.session_environment(owner) if images is not None else None
    if env is None:
        return None
    return [
        {
            "language": language,
            "version": None,
            "kernel": spec.display_name,
            "running": (owner, language) in running,
            "packages": {},
        }
        for language, spec in sorted(env.kernelspecs.items())
    ]


def pool_key(spec: KernelSpec) -> str:
    """The warm pool's key of `spec`: its language, `LANGUAGE@ENVIRONMENT` on an environment
    (as SANDBOX_INTERPRETER_WARM names them: `r@r=1`)."""
    return spec.language if spec.image is None else f"{spec.language}@{spec.image.name}"


def pool_spec(
    images: SessionImages | None, key: str, default: Callable[[str], KernelSpec]
) -> KernelSpec:
    """The kernel a warm pool key stands for (`default` of a bare language). Raises
    InvalidRequestError when its environment or kernel is not here."""
    language, _, name = key.partition("@")
    if not name:
        return default(key)
    env = images.store.get(name) if images is not None else None
    image = image_of(env) if env is not None else None
    if env is None or image is None:
        raise InvalidRequestError(f"SANDBOX_INTERPRETER_WARM {key}: no environment {name!r} here")
    return environment_spec(env, image, language)
