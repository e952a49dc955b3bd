"""`list_servers`: the hosted MCP servers a principal may use, and where."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastmcp import Context, FastMCP
from pydantic import BaseModel, Field

from sandbox_runtime.app.services import Root
from sandbox_runtime.config import cli_name
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.server.calls import may_use_server, owner_of
from sandbox_runtime.server.hosted import call_instance
from sandbox_runtime.servers.bridge import describe_tool, matches, query_words
from sandbox_runtime.servers.catalog import missing_secret, shown_url
from sandbox_runtime.servers.installs import read_installed
from sandbox_runtime.servers.launch import instance_limits, program
from sandbox_runtime.servers.learned import owner_of as instance_owner


class HostedServer(BaseModel):
    name: str
    endpoint: str = Field(description="Its MCP endpoint on this server (same token as /mcp).")
    kind: str = Field(description="pypi, npm, command or remote.")
    scope: str = Field(
        description="principal: an instance of your own; session: one per session; shared."
    )
    source: str | None = Field(
        None, description="The package it runs, or its URL (scheme://host[:port]/path)."
    )
    installed: str | None = Field(None, description="The installed version (pypi, npm).")
    ready: bool = Field(description="Whether a call can start it now.")
    problem: str | None = Field(None, description="Why not, or its last failure here.")
    network: list[str] = Field(default_factory=list, description="Hosts it may reach.")
    tools_allow: list[str] = Field(default_factory=list)
    tools_deny: list[str] = Field(default_factory=list)
    instances_here: int = Field(0, description="Its instances running on this replica.")
    crashes_recent: int = Field(0, description="Its instances that died here in 5 minutes.")


class ServerList(BaseModel):
    servers: list[HostedServer]
    catalog_problem: str | None = Field(
        None, description="Why the catalog file could not be read (the last good one is used)."
    )


def register_server_tools(mcp: FastMCP, root: Root) -> None:
    @mcp.tool
    async def list_servers(
        ctx: Context,
        server: Annotated[
            str | None, Field(description="Only this server (by name); omitted: all of them.")
        ] = None,
    ) -> ServerList:
        """The hosted MCP servers you may use: their endpoints (/servers/NAME/mcp, with the
        same token; /s/SESSION/servers/NAME/mcp for a session's own), what they run, and
        whether they are ready."""
        host = root.services.servers
        principal = owner_of(ctx, None).principal
        listed = []
        for entry in host.catalog().for_principal(principal):
            if server is not None and entry.name != server:
                continue
            if not may_use_server(entry.name, entry.required_scope):
                continue
            problem: str | None = None
            version: str | None = None
            if entry.kind in ("pypi", "npm"):
                installed = read_installed(host.servers_dir, entry.name)
                if installed is None:
                    problem = f"not installed ({cli_name()} servers install {entry.name})"
                elif installed.package != entry.package:
                    problem = f"{installed.package} installed, {entry.package} configured"
                else:
                    version = installed.version
            if problem is None:  # (a start would fail on it; the reference names no value)
                problem = missing_secret(entry)
            if problem is None and entry.kind != "remote":
                try:  # (what would refuse every start: its egress, its directory)
                    instance_limits(entry, root.services.manager.limits)
                    if entry.kind == "command":
                        program(entry, host.servers_dir)
                except SandboxRuntimeError as exc:
                    problem = str(exc)
            status = host.status(entry.name, principal)  # (its own instances' and shared)
            listed.append(
                HostedServer(
                    name=entry.name,
                    endpoint=f"/servers/{entry.name}/mcp",
                    kind=entry.kind,
                    scope=entry.scope,
                    source=entry.package or (shown_url(entry.url) if entry.url else None),
                    installed=version,
                    ready=problem is None,
                    problem=problem or status["last_error"],
                    network=list(entry.egress),
                    tools_allow=list(entry.tools_allow),
                    tools_deny=list(entry.tools_deny),
                    instances_here=status["instances"],
                    crashes_recent=status["crashes_recent"],
                )
            )
        return ServerList(servers=listed, catalog_problem=host.catalog_problem_for(principal))


class FoundTool(BaseModel):
    server: str
    tool: str
    summary: str | None = Field(None, description="The first line of its description.")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    output_schema: dict[str, Any] | None = None


class ToolSearch(BaseModel):
    tools: list[FoundTool]
    problems: list[str] = Field(
        default_factory=list, description="Servers whose tools could not be listed, and why."
    )


def register_search_tool(mcp: FastMCP, root: Root) -> None:
    @mcp.tool
    async def search_tools(
        ctx: Context,
        query: Annotated[
            str,
            Field(
                description="Words, all of which a tool's server, name "
                "or description must contain; empty: every tool."
            ),
        ],
        detail: Annotated[
            Literal["names", "summary", "full"],
            Field(description="names; summary (a line each); full (with input schemas)."),
        ] = "summary",
        server: Annotated[str | None, Field(description="Only this server's tools.")] = None,
        limit: Annotated[int, Field(description="At most this many (1-200).")] = 20,
    ) -> ToolSearch:
        """Search the tools of the hosted MCP servers you may use, without loading every
        schema: what to call through /servers/NAME/mcp or from code (servers=[...])."""
        services = root.services
        host = services.servers
        principal = owner_of(ctx, None).principal
        words = query_words(query)
        found: list[FoundTool] = []
        problems: list[str] = []
        for entry in host.catalog().for_principal(principal):
            if server is not None and entry.name != server:
                continue
            if not may_use_server(entry.name, entry.required_scope):
                continue
            # (What the principal's own instance listed, or the shared one: never another's.)
            owner = instance_owner(entry, principal, "default")
            known = host.known_tools(owner, entry)
            if known is not None:
                tools = known
            else:  # (listed once: the principal's instance starts, as a first call would)
                answer = await call_instance(services, owner, entry, "tools/list", {}, None)
                if "error" in answer:
                    problems.append(f"{entry.name}: {answer['error'].get('message')}")
                    continue
                tools = answer["result"].get("tools") or []
            for tool in tools:
                if isinstance(tool, dict) and matches(words, entry, tool):
                    found.append(FoundTool(**describe_tool(entry.name, tool, detail)))
        return ToolSearch(tools=found[: max(1, min(limit, 200))], problems=problems)
