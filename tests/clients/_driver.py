"""What the framework drivers share. They run in a clients venv (.clients/py on mcp 1.x,
.clients/py2 on mcp 2.x), not the project's, so this imports nothing of sandbox_runtime.

A driver prints exactly one JSON object on stdout (its observations); logs go to stderr. It
records what a framework did, including its exceptions as text, and leaves the judging to
tests/test_frameworks.py: a driver exits non-zero only when it crashed outside a step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from importlib.metadata import PackageNotFoundError, version
from typing import Any

Json = dict[str, Any]


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", required=True, help="the server's /mcp URL")
    parser.add_argument("--token", required=True, help="the bearer token")
    return parser


def versions(*distributions: str) -> dict[str, str | None]:
    """Installed versions of `distributions` (None when one is missing)."""
    found: dict[str, str | None] = {}
    for name in ("mcp", *distributions):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def mcp_major() -> int:
    return int(version("mcp").split(".", 1)[0])


def error_text(exc: BaseException) -> str:
    """`Type: message`, with the leaves of exception groups (anyio wraps transport errors)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        inner = getattr(e, "exceptions", None)
        if isinstance(inner, list | tuple) and inner:
            for sub in inner:
                walk(sub)
        else:
            leaves.append(e)

    walk(exc)
    return "; ".join(f"{type(e).__name__}: {e}" for e in leaves)


async def step(report: Json, name: str, body: Callable[[], Awaitable[Any]]) -> Any:
    """Run `body`; its value goes to report[name], or {"exception": ...} when it raised."""
    try:
        value = await body()
    except Exception as exc:
        report[name] = {"exception": error_text(exc), "traceback": traceback.format_exc()}
        return None
    report[name] = value
    return value


def payload_of(structured: Any, texts: list[str]) -> tuple[Json | None, list[bool]]:
    """A tool result's JSON object (structured content, else the first text block that parses)
    and, for each text block, whether it is JSON (the legacy era's contract: every one is)."""
    parsed: list[Any] = []
    is_json: list[bool] = []
    for text in texts:
        try:
            parsed.append(json.loads(text))
            is_json.append(True)
        except ValueError:
            is_json.append(False)
    if isinstance(structured, dict):
        return structured, is_json
    for value in parsed:
        if isinstance(value, dict):
            return value, is_json
    return None, is_json


def events_of(payload: Json | None) -> tuple[list[Json], str | None]:
    """The events of a result and the key they came under: `output` (the contract) or the
    older `events`."""
    if not payload:
        return [], None
    for key in ("output", "events"):
        if isinstance(payload.get(key), list):
            return [e for e in payload[key] if isinstance(e, dict)], key
    return [], None


def summary(payload: Json | None, texts: list[str], is_error: bool | None) -> Json:
    """What the tests look at in one tool result."""
    data, text_json = payload_of(payload, texts)
    events, key = events_of(data)
    return {
        "is_error": is_error,
        "status": (data or {}).get("status"),
        "exit_code": (data or {}).get("exit_code"),
        "session": (data or {}).get("session"),
        "stdout": "".join(str(e.get("data", "")) for e in events if e.get("type") == "stdout"),
        "error": (data or {}).get("error"),
        "state_reset": (data or {}).get("state_reset"),
        "output_key": key,
        "event_keys": sorted({k for e in events for k in e}),
        "text_blocks_json": text_json,
        "text": [t[:2000] for t in texts],
    }


def nullable(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(nullable(v) for v in schema.get("anyOf", []) + schema.get("oneOf", []))


def variants(schema: Any) -> list[Json]:
    """The non-null alternatives of a property schema."""
    if not isinstance(schema, dict):
        return []
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list):
        return [v for o in options for v in variants(o)]
    kind = schema.get("type")
    if kind == "null":
        return []
    return [schema]


def usable(schema: Any) -> bool:
    """Whether a model can put a value in this property: some non-null alternative is not an
    object without properties (strict mode turns an open dict into one that accepts only {})."""
    for option in variants(schema):
        kind = option.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if "object" in kinds:
            extra = option.get("additionalProperties")
            if option.get("properties") or isinstance(extra, dict) or extra is True:
                return True
        elif "array" in kinds:
            items = option.get("items")
            if not isinstance(items, dict) or usable(items):
                return True
        else:
            return True
    return False


def strict_arguments(schema: Json, given: Json) -> Json:
    """Arguments as a model under strict mode writes them: every property present, `given`
    ones as given, the rest null where the schema allows it, else their default, else the
    smallest value of their type (objects recursively)."""
    out: Json = {}
    for name, prop in (schema.get("properties") or {}).items():
        if name in given:
            out[name] = given[name]
            continue
        value = filler(prop)
        if value is not _NOTHING:
            out[name] = value
    return out


_NOTHING = object()


def filler(prop: Any) -> Any:
    if not isinstance(prop, dict):
        return _NOTHING
    if nullable(prop):
        return None
    if "default" in prop:
        return prop["default"]
    if prop.get("enum"):
        return prop["enum"][0]
    options = variants(prop)
    if not options:
        return _NOTHING
    first = options[0]
    kind = first.get("type")
    if kind == "object":
        return strict_arguments(first, {})
    return {"string": "", "integer": 0, "number": 0, "boolean": False, "array": []}.get(
        kind if isinstance(kind, str) else "", _NOTHING
    )


def emit(report: Json) -> None:
    sys.stdout.write(json.dumps(report, default=str) + "\n")
    sys.stdout.flush()


def main(run: Callable[[], Coroutine[Any, Any, Json]]) -> None:
    """Run a driver: its report on stdout; a crash outside its steps is reported too."""
    try:
        report = asyncio.run(run())
    except BaseException as exc:
        emit({"crash": error_text(exc), "traceback": traceback.format_exc()})
        sys.exit(1)
    emit(report)
