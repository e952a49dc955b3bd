"""Tool schemas that every agent framework's converter takes.

What the converters refuse (checked against their code): google-genai crashes on a root
`additionalProperties: false`; OpenAI strict mode (openai-agents' convert_schemas_to_strict)
needs every object closed with named properties, so an open dict (`{KEY: value}`) cannot be
expressed and the tool falls back to non-strict or the field to `{}`; several converters drop
`$ref`/`$defs`. So the schemas are self-contained, the root is left open, the sandbox config is
an object with its fields named, and the environment is a list of `{name, value}` (an object of
names to values is still accepted: 0.2's clients send one).
"""

from __future__ import annotations

import copy
from typing import Annotated, Any

from fastmcp import FastMCP
from pydantic import BeforeValidator, Field, WithJsonSchema


def _nullable(schema: dict[str, Any], description: str | None = None) -> dict[str, Any]:
    choices = schema["anyOf"] if set(schema) == {"anyOf"} else [schema]
    out: dict[str, Any] = {"anyOf": [*choices, {"type": "null"}]}
    return {**out, "description": description} if description else out


# The caller's limits, each at most the server's (sandbox.policy.SandboxLimits says what each
# is). Their names say what they are; the config's one description says the rest (it is in the
# schema of five tools: every character here is five in tools/list).
_INT, _NUMBER, _BOOL = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
SANDBOX_FIELDS: dict[str, dict[str, Any]] = {
    "memory_mb": _nullable(_INT),
    "pids": _nullable(_INT),
    "cpu_cores": _nullable(_NUMBER),
    "cpu_time_seconds": _nullable(_INT),
    "file_size_mb": _nullable(_INT),
    "tmp_size_mb": _nullable(_INT),
    "open_files": _nullable(_INT),
    "output_bytes": _nullable(_INT),
    "network": _nullable(
        {"anyOf": [_BOOL, {"type": "array", "items": {"type": "string"}}]},
        "false: none; a list: only these hosts (within the server's allowlist).",
    ),
    "pseudo_terminals": _nullable(_BOOL),
}
SANDBOX_CONFIG_SCHEMA = _nullable(
    {"type": "object", "properties": SANDBOX_FIELDS},
    "Tighter limits than the server's, never looser (memory: of all processes; CPU time, file "
    "size, open files: each process's); null fields keep the server's.",
)


ENVIRONMENT_SCHEMA = _nullable(
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
            "required": ["name", "value"],
        },
    },
    "Extra environment variables as [{name, value}] (an object {NAME: value} works too).",
)
MAX_ENVIRONMENT = 1000


def _environment(value: Any) -> Any:
    """The environment as a dict, from either form (the dict is checked as such after this)."""
    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, list):
        raise ValueError('must be a list of {"name": ..., "value": ...} (or an object)')
    if len(value) > MAX_ENVIRONMENT:
        raise ValueError(f"more than {MAX_ENVIRONMENT} variables")
    out: dict[str, str] = {}
    for item in value:
        if (
            not isinstance(item, dict)
            or set(item) != {"name", "value"}
            or not all(isinstance(v, str) for v in item.values())
        ):
            raise ValueError('each variable must be {"name": string, "value": string}')
        if item["name"] in out:
            raise ValueError(f"{item['name'][:60]!r} is given twice")
        out[item["name"]] = item["value"]
    return out


def _sandbox_config(value: Any) -> dict[str, Any] | None:
    """The caller's sandbox config without the fields it left null (strict-mode callers send
    every field)."""
    if not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if v is not None}


EnvironmentArg = Annotated[
    dict[str, str] | None,
    BeforeValidator(_environment),
    WithJsonSchema(ENVIRONMENT_SCHEMA),
    Field(description=ENVIRONMENT_SCHEMA["description"]),
]
SandboxConfigArg = Annotated[
    dict[str, Any] | None,
    BeforeValidator(_sandbox_config),
    WithJsonSchema(SANDBOX_CONFIG_SCHEMA),
    Field(description=SANDBOX_CONFIG_SCHEMA["description"]),
]


def portable(schema: dict[str, Any], root: bool = True) -> dict[str, Any]:
    """`schema` self-contained (every `$ref` inlined, no `$defs`) and, at the root, open (no
    `additionalProperties: false`). Our models are not recursive, so inlining ends."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                target = walk(copy.deepcopy(defs[ref.removeprefix("#/$defs/")]))
                rest = {k: walk(v) for k, v in node.items() if k != "$ref"}
                return {**target, **rest}
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out = walk(schema)
    if root and out.get("additionalProperties") is False:
        del out["additionalProperties"]
    return out


async def make_portable(mcp: FastMCP) -> None:
    """Rewrite every tool's input and output schema with `portable` (once, at startup)."""
    for tool in await mcp.list_tools(run_middleware=False):
        tool.parameters = portable(tool.parameters)
        if tool.output_schema is not None:
            tool.output_schema = outline(compact(portable(tool.output_schema)))


def outline(schema: dict[str, Any]) -> dict[str, Any]:
    """An output schema's outline: its required fields typed, every other field named (with
    its type) in the description.

    The official client checks an output schema against the 2020-12 meta-schema the first time
    a tool answers in a session, at ~0.5 ms per subschema: ~20 ms for a whole result's, on the
    first call of every tool, which a framework that opens a transport session per call pays on
    every call. The outline costs ~1 ms. Results carry the other fields as before (the object
    stays open); the tool descriptions say what they mean.
    """
    props = schema.get("properties")
    if not isinstance(props, dict):
        return schema
    required = [n for n in schema.get("required", []) if n in props]
    others = ", ".join(f"{n} ({_type_text(p)})" for n, p in props.items() if n not in required)
    out = {k: v for k, v in schema.items() if k not in ("properties", "required")}
    out["properties"] = {n: _shallow(props[n]) for n in required}
    if required:
        out["required"] = required
    if others:
        described = str(schema.get("description") or "").strip()
        out["description"] = f"{described} Other fields: {others}.".strip()
    return out


def _types(prop: dict[str, Any]) -> list[str]:
    kind = prop.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [str(k) for k in kind]
    branches = prop.get("anyOf") or prop.get("oneOf") or []
    return sorted({t for b in branches if isinstance(b, dict) for t in _types(b)})


def _shallow(prop: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: prop[k] for k in ("description", "enum", "const") if k in prop}
    kinds = _types(prop)
    if kinds:
        out["type"] = kinds[0] if len(kinds) == 1 else kinds
    return out


def _type_text(prop: dict[str, Any]) -> str:
    return "|".join(_types(prop)) or "any"


def compact(schema: Any) -> Any:
    """`anyOf: [{type: T}, {type: null}]` as `type: [T, null]`, the same in any dialect.

    For output schemas, which clients compile to check results: the official client checks a
    schema against the 2020-12 meta-schema before its first use, at a cost that grows with
    the subschemas (each of our result schemas took ~15 ms, ~10 ms compacted). Input schemas
    keep their shape: agent frameworks convert them, and some want no type lists.
    """
    if isinstance(schema, list):
        return [compact(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: compact(value) for key, value in schema.items()}
    branches = out.get("anyOf")
    if isinstance(branches, list) and len(branches) == 2 and {"type": "null"} in branches:
        other = branches[0] if branches[1] == {"type": "null"} else branches[1]
        simple = isinstance(other, dict) and set(other) == {"type"} and "type" not in out
        if simple and isinstance(other["type"], str):
            del out["anyOf"]
            out["type"] = [other["type"], "null"]
    return out


# The environment (root filesystem) the session's sandboxes run on: `image`, since 0.2's
# `environment` already means environment variables.
ImageArg = Annotated[
    str | None,
    Field(
        description="Environment the session runs on (list_environments); fixed by the "
        "session's first call, default `default`."
    ),
]
