"""A desktop client's MCP config (`{"mcpServers": {...}}`, as Claude Desktop, Cursor and
others write it) turned into catalog entries, for `srt-mcp-server servers import`."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from sandbox_runtime.servers.catalog import Catalog, CatalogError, parse_entry


def import_desktop_config(
    text: str, catalog: Catalog, *, replace_existing: bool = False
) -> tuple[Catalog, list[str]]:
    """Entries from a desktop client's `{"mcpServers": {...}}` JSON (command/args/env, or
    url/headers), added to `catalog`; returns it and what was done, one line per server.

    `npx -y PKG` and `uvx PKG` become npm:/pypi: packages (installed ahead by `servers
    install` instead of downloaded at every start). A name already in the catalog is an
    error unless `replace_existing`. Raises CatalogError.
    """
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CatalogError(f"not JSON: {exc}") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise CatalogError('expected an object with "mcpServers": {name: {command, args, env}}')
    report: list[str] = []
    imported: dict[str, str] = {}
    for raw_name, spec in servers.items():
        name = re.sub(r"[^a-z0-9_-]", "-", str(raw_name).lower()).strip("-_")[:48] or "server"
        if name in imported:
            raise CatalogError(
                f"mcpServers.{raw_name}: its name would be {name}, as {imported[name]}'s is"
            )
        imported[name] = str(raw_name)
        if name in catalog.entries and not replace_existing:
            raise CatalogError(
                f"mcpServers.{raw_name}: the catalog already has a server named {name} "
                "(remove it first, or replace it)"
            )
        if not isinstance(spec, dict):
            raise CatalogError(f"mcpServers.{raw_name} must be an object")
        table: dict[str, Any] = {}
        if "url" in spec:
            table["url"] = spec["url"]
            if spec.get("headers"):
                table["headers"] = spec["headers"]
        else:
            command = spec.get("command")
            args = spec.get("args", [])
            if not isinstance(command, str) or not isinstance(args, list):
                raise CatalogError(
                    f"mcpServers.{raw_name}: needs command (a string) and args (a list)"
                )
            table.update(_package_of(command, [str(a) for a in args]))
            env = spec.get("env") or {}
            if not isinstance(env, dict):
                raise CatalogError(f"mcpServers.{raw_name}.env must be an object")
            if env:
                table["env"] = {str(k): str(v) for k, v in env.items()}
        try:
            entry = parse_entry(name, table)
        except CatalogError as exc:
            raise CatalogError(f"mcpServers.{raw_name}: {exc}") from None
        source = entry.package or entry.url or " ".join(entry.command)
        replaced = " (replaced)" if name in catalog.entries else ""
        catalog = catalog.with_entry(entry)
        args = f" {' '.join(entry.args)}" if entry.args else ""
        report.append(f"{name}: {source}{args}{replaced}")
    return catalog, report


def _package_of(command: str, args: list[str]) -> dict[str, Any]:
    """`npx [-y] PKG ARGS` -> npm:PKG, `uvx PKG ARGS` / `pipx run PKG` -> pypi:PKG, else the
    command as it is."""
    base = os.path.basename(command)
    rest = list(args)
    if base == "npx":
        while rest[:1] in (["-y"], ["--yes"]):  # npx's own; later ones are the server's
            rest = rest[1:]
        if rest and not rest[0].startswith("-"):
            return {"package": f"npm:{rest[0]}", "args": rest[1:]}
    if base == "uvx" or (base == "pipx" and rest[:1] == ["run"]):
        if base == "pipx":
            rest = rest[1:]
        if rest and not rest[0].startswith("-"):
            spec = rest[0].removesuffix("@latest").replace("@", "==", 1)
            return {"package": f"pypi:{spec}", "args": rest[1:]}
    return {"command": [command], "args": rest}
