"""list_environments: the environments (root filesystems) a session may run on, for `image`
on execute_code and run_code (execution/images.py)."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastmcp import Context, FastMCP
from fastmcp.tools.base import ToolResult
from pydantic import BaseModel, Field

from sandbox_runtime.app.services import Root
from sandbox_runtime.server.calls import owner_of
from sandbox_runtime.server.replies import reply


class EnvironmentItem(BaseModel):
    name: str
    description: str = ""
    languages: list[str] = Field(default_factory=list, description="run_code's languages in it.")
    size_mb: int = 0


class EnvironmentList(BaseModel):
    environments: list[EnvironmentItem]


def environments_screen(items: list[dict[str, Any]]) -> str:
    """One line per environment: name, languages, size, description."""
    lines = []
    for item in items:
        langs = ", ".join(item["languages"]) or "shell only"
        size = f", {item['size_mb']} MB" if item["size_mb"] else ""
        text = f" - {item['description']}" if item["description"] else ""
        lines.append(f"{item['name']} ({langs}{size}){text}")
    lines.append("Choose one with image=NAME on a session's first execute_code or run_code.")
    return "\n".join(lines)


def register_environment_tools(mcp: FastMCP, root: Root) -> None:
    schema = EnvironmentList.model_json_schema()

    @mcp.tool(output_schema=schema)
    async def list_environments(
        ctx: Context,
        name: Annotated[
            str | None, Field(description="Only this environment; omitted: all of them.")
        ] = None,
    ) -> ToolResult:
        """The environments a session may run on (image= on its first call): their
        languages for run_code and what they hold."""
        # (An argument also gives the schema a named property: OpenAI's strict mode refuses
        # an object that names none.)
        s = root.services
        principal = owner_of(ctx, None).principal
        images = s.manager.images
        runtime = s.interpreters.runtime
        languages = list(runtime.languages) if runtime is not None else []
        items: list[dict[str, Any]] = []
        if images is not None:
            items = await anyio.to_thread.run_sync(images.describe, principal, languages)
        if name is not None:
            items = [item for item in items if item["name"] == name]
        structured = EnvironmentList.model_validate({"environments": items}).model_dump()
        if name is not None and not items:
            screen = f"No environment {name!r} that you may use: list_environments() lists them."
            return reply(structured, screen=screen)
        return reply(structured, screen=environments_screen(items))
