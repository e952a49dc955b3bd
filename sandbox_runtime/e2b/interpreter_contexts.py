"""The code interpreter's contexts: which interpreter of ours each E2B context id names.

E2B runs one Jupyter kernel per context; a sandbox starts with a default context per language
and `POST /contexts` adds more, each with its own state. Here a sandbox is one session of ours,
whose interpreters are keyed by language: a language's default context is the session's
interpreter of that language (the one MCP `run_code` in the same session reaches too), and a
created context is one more interpreter of its language in the same session and workspace,
named `LANGUAGE:CONTEXT_ID` (interpreters/interpreter.py). So every context counts against the
interpreter limits (per replica, per principal: past them the least recently used idle one is
stopped, and its next call says so), is reaped when idle, and is a sandbox like any other.

The registry is this replica's memory, bounded (MAX_CONTEXTS per sandbox, MAX_SANDBOXES
sandboxes, least recently used first out): E2B requests for one sandbox reach one replica.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_runtime.interpreters.outputs import shell_quote

MAX_CONTEXTS = 16  # created contexts of one sandbox (its defaults aside)
MAX_SANDBOXES = 10_000  # sandboxes whose contexts a replica remembers
MAX_CWD_CHARS = 4096
DEFAULT_LANGUAGES = ("python", "javascript")  # listed from the start, as E2B's are
# The last lines of an edge's own Python cell: it gives its number back, and the history
# database is off (a number used twice would be refused there, with a line on stdout).
TAKE_COUNT_BACK = (
    "    get_ipython().history_manager.enabled = False\n    get_ipython().execution_count -= 1\n"
)
DISPLAY_SOURCE = (Path(__file__).with_name("runtime_files") / "e2b_display.py").read_text()


def normalize_language(language: object) -> str:
    """A language as E2B's server names it: python by default, `js` and `ts` spelled out."""
    name = language.lower().strip() if isinstance(language, str) else ""
    return {"": "python", "js": "javascript", "ts": "typescript"}.get(name, name)


@dataclass
class CodeContext:
    """One E2B context: its id, language and working directory, and our interpreter's name."""

    context_id: str
    language: str
    cwd: str
    interpreter: str  # `python` (a default context) or `python:<context_id>`
    prepared: bool = False  # its setup (cwd, environment, formatters) ran in this interpreter

    def wire(self) -> dict[str, str]:
        return {"id": self.context_id, "language": self.language, "cwd": self.cwd}


@dataclass
class SandboxContexts:
    """The contexts of one sandbox."""

    home: str
    by_id: dict[str, CodeContext] = field(default_factory=dict)
    defaults: dict[str, str] = field(default_factory=dict)  # language -> its context's id

    def default(self, language: str) -> CodeContext:
        """The default context of `language` (made on first use)."""
        context_id = self.defaults.get(language)
        if context_id is None:
            context_id = str(uuid.uuid4())
            self.defaults[language] = context_id
            self.by_id[context_id] = CodeContext(context_id, language, self.home, language)
        return self.by_id[context_id]

    def listed(self) -> list[CodeContext]:
        return list(self.by_id.values())

    def created(self) -> int:
        return sum(1 for c in self.by_id.values() if c.interpreter != c.language)


class ContextRegistry:
    """Every sandbox's contexts on this replica (bounded; see the module's docstring)."""

    def __init__(self, home: str) -> None:
        self.home = home
        self._sandboxes: OrderedDict[str, SandboxContexts] = OrderedDict()

    def of(self, sandbox_id: str) -> SandboxContexts:
        found = self._sandboxes.get(sandbox_id)
        if found is None:
            found = self._sandboxes[sandbox_id] = SandboxContexts(self.home)
            for language in DEFAULT_LANGUAGES:  # (listed first, as E2B starts them first)
                found.default(language)
            while len(self._sandboxes) > MAX_SANDBOXES:
                self._sandboxes.popitem(last=False)
        self._sandboxes.move_to_end(sandbox_id)
        return found

    def forget(self, sandbox_id: str) -> None:
        self._sandboxes.pop(sandbox_id, None)

    def create(self, sandbox_id: str, language: str, cwd: str) -> CodeContext:
        """A new context (not yet started). Raises ValueError past MAX_CONTEXTS."""
        contexts = self.of(sandbox_id)
        if contexts.created() >= MAX_CONTEXTS:
            raise ValueError(
                f"this sandbox has its maximum of {MAX_CONTEXTS} code contexts: remove one "
                "(DELETE /contexts/{id}, remove_code_context) first"
            )
        context_id = str(uuid.uuid4())
        context = CodeContext(context_id, language, cwd, f"{language}:{context_id}")
        contexts.by_id[context_id] = context
        return context


def setup_code(context: CodeContext, env: dict[str, str], full: bool) -> str:
    """Code that sets environment variables `env` in a context's interpreter and, when `full`
    (its first call there), its working directory and (Python) E2B's display formatters. A
    Python cell takes its own count back, so that the user's cells are numbered as E2B's are."""
    cwd = context.cwd  # (/home/user is the workspace in every sandbox: sandbox/host.py)
    if context.language == "python":
        lines = [f"    os.environ.update({json.dumps(env)})"]
        if full:
            lines += [
                f"    os.chdir({json.dumps(cwd)})",
                "    module = sys.modules.get('srt_e2b_display')",
                "    if module is None:",
                "        module = types.ModuleType('srt_e2b_display')",
                f"        exec(compile({json.dumps(DISPLAY_SOURCE)}, 'srt_e2b_display', 'exec'),"
                " module.__dict__)",
                "        sys.modules['srt_e2b_display'] = module",
                "    module.install(get_ipython())",
            ]
        body = "\n".join(lines)
        return (
            f"def _srt_e2b_setup():\n    import os, sys, types\n{body}\n"
            f"{TAKE_COUNT_BACK}_srt_e2b_setup()\ndel _srt_e2b_setup\n"
        )
    if context.language in ("javascript", "typescript"):
        sets = "".join(f"Deno.env.set({json.dumps(k)}, {json.dumps(v)});" for k, v in env.items())
        return (f"Deno.chdir({json.dumps(cwd)});" if full else "") + sets
    if context.language == "bash":
        exports = "".join(f"export {k}={shell_quote(v)}\n" for k, v in env.items())
        return (f"cd {shell_quote(cwd)}\n" if full else "") + exports
    return ""


def cleanup_code(language: str, env: dict[str, str], sandbox_env: dict[str, str]) -> str:
    """Code that takes a call's environment variables back (E2B's `envs` last one call): each
    back to the sandbox's value, or unset."""
    keep = {k: sandbox_env[k] for k in env if k in sandbox_env}
    drop = [k for k in env if k not in sandbox_env]
    if language == "python":
        return (
            "def _srt_e2b_env():\n"
            "    import os\n"
            f"    for key in {json.dumps(drop)}:\n"
            "        os.environ.pop(key, None)\n"
            f"    os.environ.update({json.dumps(keep)})\n"
            f"{TAKE_COUNT_BACK}_srt_e2b_env()\n"
            "del _srt_e2b_env\n"
        )
    if language in ("javascript", "typescript"):
        return "".join(f"Deno.env.delete({json.dumps(k)});" for k in drop) + "".join(
            f"Deno.env.set({json.dumps(k)}, {json.dumps(v)});" for k, v in keep.items()
        )
    if language == "bash":
        unsets = "".join(f"unset {k}\n" for k in drop)
        return unsets + "".join(f"export {k}={shell_quote(v)}\n" for k, v in keep.items())
    return ""
