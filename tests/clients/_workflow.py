"""One fixed agent workflow, scripted (no model), as a model would work through the tools: it
reads only the text of each result (what a model is shown) and its image blocks, and follows
every hint the text gives exactly as written. tests/test_agent_workflow.py runs it through the
official client (2026 era) and tests/clients/workflow_driver.py through LangChain (2025 era);
both record what they saw here, and the test judges it.

Standard library only (it runs in the clients' venvs too). A caller makes one call and returns
{"text": the text blocks joined, "is_error": bool, "images": [{"png": bool, "url": str}]}.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from _hints import hints

Json = dict[str, Any]
Caller = Callable[[str, Json], Awaitable[Json]]

SESSION = "agent-flow"  # a named session: every hint must carry it to work
LINES = 200_000
CSV = "region,sales\n" + "".join(
    f"{r},{n}\n" for r, n in zip("NSEWNSEW", range(10, 90, 10), strict=True)
)
DESCRIBE = "import pandas as pd\ndf = pd.read_csv('data.csv')\ndf.describe()"
PLOT = (
    "import matplotlib.pyplot as plt\ndf.groupby('region').sales.sum().plot.bar()\n"
    "plt.savefig('by_region.png')\nplt.show()"
)
LONG = f"python3 -c 'for i in range({LINES}): print(f\"line {{i}}\")'"
HOSTED = "time"  # the catalog's server; code calls it by name, with a typo once
CODE = "from mcp_servers import time\nprint(time.echo(text='from code')['text'])"
CELL = "from mcp_servers import time\ntime.echo(text='from a cell')"
TYPO = "from mcp_servers import tme\ntme.echo(text='x')"
NOTE = re.compile(
    r"\n?\[… (the line goes on; )?[\d,]+ bytes, [\d,]+ lines omitted; read them with .*\]\n"
)
READ_ON = re.compile(r"\n\[bytes [\d,]+-[\d,]+ of [\d,]+(; read on with .*)?\]$")


def digest(text: str) -> Json:
    data = text.encode()
    return {
        "bytes": len(data),
        "lines": text.count("\n"),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


class Agent:
    """Calls tools, keeps what a model read (trimmed), and follows the hints it is given."""

    def __init__(self, call: Caller, hosted: Caller) -> None:
        self.call, self.hosted = call, hosted
        self.read: list[Json] = []
        self.followed: set[str] = set()
        self.unfollowed: list[Json] = []

    async def do(self, step: str, tool: str, args: Json, hint: bool = False) -> Json:
        seen = await (self.hosted if step == "hosted" else self.call)(tool, args)
        shown = {k: (v[:300] if isinstance(v, str) else v) for k, v in args.items()}
        self.read.append(
            {"step": step, "tool": tool, "args": shown, "hint": hint, "chars": len(seen["text"]),
             "budget": args.get("max_chars", 100_000), "is_error": seen["is_error"],
             "text": seen["text"][:1500], "images": seen.get("images") or []}
        )  # fmt: skip
        return seen

    async def follow(self, step: str, text: str, depth: int = 2) -> list[Json]:
        """Every call `text` names, exactly (an `input()` template answered), each once; and the
        hints those give, to `depth`."""
        out = []
        for tool, args in hints(text):
            if tool == "send_stdin" and args.get("input_data") == "<your answer>":
                args = {**args, "input_data": "model"}
            key = json.dumps([tool, args], sort_keys=True)
            if key in self.followed:
                continue
            self.followed.add(key)
            seen = await self.do(step, tool, args, hint=True)
            out.append(seen)
            if depth > 1 and not seen["is_error"]:
                out += await self.follow(step, seen["text"], depth - 1)
            else:
                self.left(step, seen["text"])
        return out

    def left(self, step: str, text: str) -> None:
        """Note the hints of `text` not followed (the test wants none)."""
        for tool, args in hints(text):
            if json.dumps([tool, args], sort_keys=True) not in self.followed:
                self.unfollowed.append({"step": step, "tool": tool, "args": args})


def before_note(text: str) -> str:
    """The output a result's text shows before its cut note (the note's line break is the
    output's unless the note says the line goes on)."""
    note = NOTE.search(text)
    if note is None:
        return text
    return text[: note.start() + ("the line goes on" not in note.group(0))]


def before_ending(text: str) -> str:
    """A page's output: its text without the bracketed lines that end it (how it ended, the
    call that reads on), the line break before them the output's unless they say otherwise."""
    lines = text.split("\n")
    k = len(lines)
    while k and lines[k - 1].startswith("[") and lines[k - 1].endswith("]"):
        k -= 1
    body = "\n".join(lines[:k])
    goes_on = any("the line goes on" in line for line in lines[k:])
    return body + ("\n" if body and not goes_on else "")


async def read_log(agent: Agent, text: str) -> Json:
    """The whole of a cut output through the note's read_file call and each part's "read on"
    call, to the end: the head the result showed, then each part's text."""
    got = [before_note(text)]
    tool_args = next((a for t, a in hints(text) if t == "read_file"), None)
    calls = 0
    while tool_args is not None and calls < 200:
        calls += 1
        agent.followed.add(json.dumps(["read_file", tool_args], sort_keys=True))
        seen = await agent.do("long", "read_file", tool_args, hint=True)
        if seen["is_error"]:
            return {"calls": calls, "error": seen["text"][:500]}
        part = READ_ON.search(seen["text"])
        got.append(seen["text"][: part.start()] if part else seen["text"])
        tool_args = next((a for t, a in hints(seen["text"]) if t == "read_file"), None)
    return {"calls": calls, **digest("".join(got))}


async def also(agent: Agent, text: str) -> None:
    """The calls `text` names besides the one the reader goes on with, each made once (a cut
    page names a read_file of the log, and the next page's call after its note)."""
    for tool, args in hints(text):
        key = json.dumps([tool, args], sort_keys=True)
        if key not in agent.followed:
            agent.followed.add(key)
            await agent.do("long", tool, args, hint=True)


async def read_pages(agent: Agent, text: str) -> Json:
    """The whole of a cut output through its get_execution_output calls: the output before a
    cut note and the note's call, or a whole page and its "more output" call, to the end."""
    got: list[str] = []
    calls = 0
    seen_args: set[str] = set()
    while calls < 200:
        note = NOTE.search(text)
        pages = [a for t, a in hints(text) if t == "get_execution_output"]
        got.append(before_note(text) if note else before_ending(text))
        if not pages:
            break
        args = pages[0] if note else pages[-1]
        key = json.dumps(args, sort_keys=True)
        if key in seen_args:
            return {"calls": calls, "stuck": args, **digest("".join(got))}
        seen_args.add(key)
        agent.followed.add(json.dumps(["get_execution_output", args], sort_keys=True))
        calls += 1
        seen = await agent.do("long", "get_execution_output", args, hint=True)
        if seen["is_error"]:
            return {"calls": calls, "error": seen["text"][:500]}
        await also(agent, text)
        text = seen["text"]
    return {"calls": calls, **digest("".join(got))}


def execution_id(text: str) -> str | None:
    """The execution a result's text names (in the call it says to make next)."""
    found = re.search(r"execution_id='([^']+)'", text)
    return found.group(1) if found else None


async def workflow(call: Caller, hosted: Caller) -> Json:
    agent = Agent(call, hosted)
    report: Json = {}

    async def step(name: str, tool: str, follow: bool = True, **args: Any) -> str:
        seen = await agent.do(
            name, tool, args if name == "hosted" else {**args, "session": SESSION}
        )
        if name == "plot":
            report["plot"] = {"text": seen["text"], "images": seen.get("images") or []}
        if follow:
            await agent.follow(name, seen["text"])
        return str(seen["text"])

    async def then(name: str, text: str, depth: int = 2) -> list[str]:
        """The texts of the hints `text` gives, followed."""
        return [str(seen["text"]) for seen in await agent.follow(name, text, depth)]

    await step("csv", "write_file", path="data.csv", content=CSV)
    report["describe"] = await step("pandas", "run_code", code=DESCRIBE)
    await step("plot", "run_code", code=PLOT)

    ticks = "for i in 1 2 3; do echo tick $i; sleep 0.3; done"
    started = await step("async", "execute_code_async", follow=False, command=ticks)
    report["async"] = [started, *await then("async", started, depth=6)]  # polled to the end

    reads = "read name; echo hello $name"
    asked = await step("stdin", "execute_code_async", False, command=reads, interactive=True)
    sent = await step("stdin", "send_stdin", execution_id=execution_id(asked), input_data="model")
    report["stdin"] = [sent, *await then("stdin", asked)]

    slow = await step("cancel", "execute_code_async", follow=False, command="sleep 60")
    cancelled = await step("cancel", "cancel_execution", execution_id=execution_id(slow))
    report["cancel"] = [cancelled, *await then("cancel", slow)]

    long = await step("long", "execute_code", follow=False, command=LONG)
    report["long"] = {
        "text_head": long[:200],
        "text_tail": long[-600:],
        "read_file": await read_log(agent, long),
        "get_execution_output": await read_pages(agent, long),
    }
    log = re.search(r"\.outputs/[\w.-]+\.log", long)
    if log:
        count = f"wc -l -c {log.group(0)} && sha256sum {log.group(0)}"
        report["long"]["file"] = await step("long", "execute_code", command=count)

    report["hosted"] = await step("hosted", "echo", text="hi")
    servers = [HOSTED]
    code = ["python3", "-c", CODE]
    report["code_mode"] = await step("code", "execute_code", command=code, servers=servers)
    report["cell"] = await step("code", "run_code", code=CELL, servers=servers)
    typo = ["python3", "-c", TYPO]
    report["typo"] = await step("typo", "execute_code", command=typo, servers=servers)
    report["typo_cell"] = await step("typo", "run_code", code=TYPO, servers=servers)
    report["read"] = agent.read
    report["unfollowed"] = agent.unfollowed
    return report
