"""What an instance of a stdio entry is started with: its program, its environment (with its
secrets resolved, here and only here), its sandbox's limits and the environment it runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from sandbox_runtime.config import cli_name
from sandbox_runtime.domain.limits import SandboxLimits
from sandbox_runtime.egress.supervisor import EgressProxy
from sandbox_runtime.errors import PolicyViolationError
from sandbox_runtime.execution.images import SessionImages, image_of
from sandbox_runtime.sandbox.host import WORKSPACE
from sandbox_runtime.sandbox.spec import ImageRoot
from sandbox_runtime.servers.catalog import CatalogError, Entry, resolve_secret
from sandbox_runtime.servers.installs import read_installed


def program(entry: Entry, servers_dir: Path) -> tuple[list[str], Path | None]:
    """argv inside the sandbox, and the host directory bound at /opt/srt-server (its
    install, or a command's directory). Raises CatalogError (not installed, or not as the
    catalog now asks: a start never downloads)."""
    if entry.kind == "command":
        directory = Path(entry.directory) if entry.directory else None
        if directory is not None and not directory.is_dir():
            raise CatalogError(f"server {entry.name}: directory {directory} does not exist")
        return [*entry.command, *entry.args], directory
    installed = read_installed(servers_dir, entry.name)
    if installed is None:
        raise CatalogError(
            f"server {entry.name} is not installed: run `{cli_name()} servers "
            f"install {entry.name}` (a start never downloads)"
        )
    if installed.package != entry.package:
        raise CatalogError(
            f"server {entry.name}: {installed.package} is installed but the catalog asks "
            f"for {entry.package}: run `{cli_name()} servers install {entry.name}`"
        )
    return [*installed.program, *entry.args], servers_dir / "install" / entry.name


def environment(entry: Entry, stored: Callable[[str], str] | None = None) -> dict[str, str]:
    """The entry's variables and its secrets' values (HOME is its state directory);
    `stored(NAME)` gives what a `secret:NAME` reference becomes (the secrets store's value,
    or a placeholder the egress proxy replaces: egress/secrets.py `for_instance`)."""
    env = {"HOME": WORKSPACE, **entry.env}
    for var, ref in entry.secrets.items():
        try:
            if ref.startswith("secret:"):
                if stored is None:
                    raise CatalogError(f"secret {ref}: this server has no secret rules or key")
                env[var] = stored(ref[7:])
            else:
                env[var] = resolve_secret(ref)
        except (CatalogError, ValueError) as exc:
            raise CatalogError(f"server {entry.name}: {exc}") from None
    return env


def stored_secrets(
    egress: EgressProxy | None, principal: str, entry: Entry
) -> Callable[[str], str] | None:
    """What `environment` resolves `secret:NAME` with for `principal`'s instance of `entry`
    (None: the server has no secret rules)."""
    broker = egress.secrets if egress is not None else None
    if broker is None:
        return None
    return lambda name: broker.for_instance(name, principal, list(entry.egress))


def instance_limits(entry: Entry, ceiling: SandboxLimits) -> SandboxLimits:
    """The server's sandbox ceiling, tightened to the entry's limits and egress names (its
    egress must lie within the server's policy). Raises PolicyViolationError."""
    if entry.egress and not ceiling.network:
        raise PolicyViolationError(
            f"server {entry.name} asks for egress to {', '.join(entry.egress)}, but this server "
            "allows no network egress (SANDBOX_EGRESS_ALLOW)"
        )
    try:
        return ceiling.tighten(
            {
                "memory_mb": min(entry.memory_mb, ceiling.memory_mb),
                "pids": min(entry.pids, ceiling.pids),
                "cpu_cores": min(entry.cpus, ceiling.cpu_cores),
                "network": list(entry.egress) if entry.egress else False,
            }
        )
    except PolicyViolationError as exc:
        raise PolicyViolationError(
            f"server {entry.name}: {exc} (its egress must lie within SANDBOX_EGRESS_ALLOW)"
        ) from None


async def entry_image(images: SessionImages | None, entry: Entry) -> ImageRoot | None:
    """The environment `entry`'s command runs on (None: default). Raises CatalogError when
    this replica has no such environment."""
    if not entry.image or images is None:
        return None
    env = await asyncio.to_thread(images.store.get, entry.image)
    if env is None:
        raise CatalogError(
            f"server {entry.name}: no environment {entry.image!r} here: build or import it "
            f"(`{cli_name()} env list` shows what there is)"
        )
    return image_of(env)
