"""The Dockerfile subset environments are built from: FROM, RUN, COPY, ENV, WORKDIR, USER,
LABEL (and comments, line continuations, `# syntax`-style directives ignored). Anything else
is an error naming the instruction and its line."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from sandbox_runtime.environments.store import EnvironmentsError

SUPPORTED = ("FROM", "RUN", "COPY", "ENV", "WORKDIR", "USER", "LABEL")
KNOWN_UNSUPPORTED = (
    "ADD", "CMD", "ENTRYPOINT", "EXPOSE", "VOLUME", "ARG", "ONBUILD", "STOPSIGNAL",
    "HEALTHCHECK", "SHELL", "MAINTAINER",
)  # fmt: skip
_KEYWORD = re.compile(r"^\s*([A-Za-z]+)(\s+|$)(.*)$", re.S)


class DockerfileError(EnvironmentsError):
    """The Dockerfile is not in the subset environments are built from."""


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # as written (continuations joined)
    line: int  # 1-based line where it starts

    def text(self) -> str:
        """The instruction as the build cache keys it."""
        return f"{self.keyword} {self.args}"


def parse(text: str, name: str = "Dockerfile") -> list[Instruction]:
    """The instructions of `text`. Raises DockerfileError (with `name:line`)."""
    out: list[Instruction] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = i
        raw = lines[i]
        i += 1
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = [raw]
        while parts[-1].rstrip().endswith("\\") and i < len(lines):
            parts[-1] = parts[-1].rstrip()[:-1]
            while i < len(lines) and lines[i].lstrip().startswith("#"):
                i += 1  # (a comment inside a continued instruction is dropped)
            if i < len(lines):
                parts.append(lines[i])
                i += 1
        joined = " ".join(p.strip() for p in parts).strip()
        match = _KEYWORD.match(joined)
        if match is None:
            raise DockerfileError(f"{name}:{start + 1}: cannot read this line: {raw.strip()!r}")
        keyword, args = match.group(1).upper(), match.group(3).strip()
        if keyword not in SUPPORTED:
            what = "is not supported" if keyword in KNOWN_UNSUPPORTED else "is not an instruction"
            raise DockerfileError(
                f"{name}:{start + 1}: {keyword} {what} in environment builds; the subset is "
                f"{', '.join(SUPPORTED)} (docs/environments-build.md)"
            )
        if not args:
            raise DockerfileError(f"{name}:{start + 1}: {keyword} needs arguments")
        out.append(Instruction(keyword, args, start + 1))
    if not out or out[0].keyword != "FROM":
        raise DockerfileError(
            f"{name}: the first instruction must be FROM (debian:<suite>, default, or an "
            "environment's name)"
        )
    if any(ins.keyword == "FROM" for ins in out[1:]):
        extra = next(ins for ins in out[1:] if ins.keyword == "FROM")
        raise DockerfileError(f"{name}:{extra.line}: only one FROM (multi-stage builds are not "
                              "supported)")  # fmt: skip
    return out


def exec_form(args: str) -> list[str] | None:
    """A JSON array form (`["a", "b"]`) as a list; None when `args` is the shell form."""
    if not args.startswith("["):
        return None
    try:
        value = json.loads(args)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def pairs(ins: Instruction) -> dict[str, str]:
    """ENV and LABEL arguments: `k=v k2="v 2"` or the old `k v` form."""
    try:
        words = shlex.split(ins.args)
    except ValueError as exc:
        raise DockerfileError(f"line {ins.line}: {ins.keyword}: {exc}") from None
    if words and "=" not in words[0]:
        if len(words) < 2 or ins.keyword != "ENV":
            raise DockerfileError(f"line {ins.line}: {ins.keyword} takes key=value pairs")
        key, _, value = ins.args.partition(" ")
        return {key: value.strip()}
    result: dict[str, str] = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise DockerfileError(f"line {ins.line}: {ins.keyword}: {word!r} is not key=value")
        result[key] = value
    return result


def expand(value: str, env: dict[str, str]) -> str:
    """$NAME and ${NAME} from the ENV set so far (as Docker does in ENV, WORKDIR, COPY)."""
    return re.sub(
        r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))",
        lambda m: env.get(m.group(1) or m.group(2), ""),
        value,
    )
