"""What a model reads: the characters of the text blocks of every result of a fixed workflow,
in both protocol eras, and the size of tools/list. (The structured content is for programs: a
model reads the text; a 2025-era client's model reads nothing else.)

    .venv/bin/python bench/bench_screens.py [--json out.json]

Run it against another checkout's code with PYTHONPATH=/that/checkout (the server it starts
inherits PYTHONPATH), e.g. main's before a change. Target: at most a third of main's before
issue 42, with nothing a model needs lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mcp.types import TextContent
from mcp_harness import Conn, open_client, running_server

TOKEN = "bench-screens-token"
SETTINGS = {"SANDBOX_LOG_LEVEL": "WARNING", "SANDBOX_ACCESS_LOG": "false"}

CSV = "city,temp,rain\n" + "".join(f"c{i},{10 + i % 17},{(i * 7) % 11}\n" for i in range(50))
PANDAS = "import pandas as pd\ndf = pd.read_csv('weather.csv')\ndf.describe()"
PLOT = (
    "import matplotlib.pyplot as plt\nplt.plot(df['temp'], df['rain'], 'o')\n"
    "plt.title('rain by temperature')\nplt.show()"
)
POLLED = "for i in 1 2 3 4 5; do echo step $i; sleep 0.4; done"
LONG = "for i in range(200_000):\n    print(f'line {i}')"


def text_of(result: Any) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


async def workflow(conn: Conn, rows: list[tuple[str, int]]) -> None:
    session = f"bench-{uuid.uuid4().hex[:6]}"

    async def step(name: str, tool: str, **args: Any) -> dict[str, Any]:
        result = await conn.call(tool, **args)
        rows.append((name, len(text_of(result))))
        return dict(result.structured_content or {})

    await step(
        "write CSV (execute_code)",
        "execute_code",
        command=["python3", "-c", f"open('weather.csv','w').write({CSV!r})"],
        session=session,
    )
    await step("print(6*7) (execute_code)", "execute_code", command="python3 -c 'print(6*7)'")
    await step("pandas describe() (run_code)", "run_code", code=PANDAS, session=session)
    await step("matplotlib plot (run_code)", "run_code", code=PLOT, session=session)
    started = await step(
        "start async command", "execute_code_async", command=POLLED, session=session
    )
    first = await step(
        "poll at once (get_execution_output)",
        "get_execution_output",
        execution_id=started["execution_id"],
        session=session,
    )
    await step(
        "poll to the end (get_execution_output)",
        "get_execution_output",
        execution_id=started["execution_id"],
        last_event_id=first["next_cursor"],
        wait=True,
        session=session,
    )
    asked = await step(
        "interactive command",
        "execute_code_async",
        command="read name; echo hello $name",
        interactive=True,
        session=session,
    )
    await step(
        "send_stdin",
        "send_stdin",
        execution_id=asked["execution_id"],
        input_data="model",
        session=session,
    )
    await step(
        "its output (get_execution_output)",
        "get_execution_output",
        execution_id=asked["execution_id"],
        wait=True,
        session=session,
    )
    slow = await step("start sleep 60", "execute_code_async", command="sleep 60", session=session)
    await step(
        "cancel_execution",
        "cancel_execution",
        execution_id=slow["execution_id"],
        session=session,
    )
    await step(
        "status (get_execution_status)",
        "get_execution_status",
        execution_id=slow["execution_id"],
        session=session,
    )
    await step("list_executions", "list_executions", limit=3, session=session)
    long = await step("200,000 lines (run_code)", "run_code", code=LONG, session=session)
    await step(
        "its next page (get_execution_output)",
        "get_execution_output",
        execution_id=long["execution_id"],
        last_event_id=long["next_cursor"],
        session=session,
    )
    await step(
        "wrong call (unknown execution)",
        "get_execution_output",
        execution_id="no-such-execution",
        session=session,
    )


async def measure(url: str, mode: str) -> tuple[list[tuple[str, int]], int]:
    rows: list[tuple[str, int]] = []
    async with open_client(url, TOKEN, mode) as conn:  # type: ignore[arg-type]
        tools = await conn.client.list_tools()
        listed = len(
            json.dumps([t.model_dump(mode="json", exclude_none=True) for t in tools.tools])
        )
        await workflow(conn, rows)
    return rows, listed


LONG_STEPS = ("200,000 lines (run_code)", "its next page (get_execution_output)")


def table(numbers: dict[str, Any], before: dict[str, Any] | None) -> str:
    """A markdown table: characters per step and era (before → after, with `before`), the
    totals with and without the 200,000-line output, and tools/list."""
    eras = ("legacy", "modern")
    head = "| step | 2025 era | 2026 era |\n|---|---:|---:|"
    if before:
        head = "| step | 2025 before | 2025 after | 2026 before | 2026 after |\n"
        head += "|---|---:|---:|---:|---:|"

    def cells(i: int | None, keep: Any = None) -> str:
        out = []
        for era in eras:
            runs = [before[era], numbers[era]] if before else [numbers[era]]
            for run in runs:
                if i is not None:
                    out.append(f"{run[i][1]:,}")
                else:
                    out.append(f"{sum(n for name, n in run if keep(name)):,}")
        return " | ".join(out)

    rows = [head]
    for i, (name, _) in enumerate(numbers["legacy"]):
        rows.append(f"| {name} | {cells(i)} |")
    rows.append(
        f"| **total without the long output** | {cells(None, lambda n: n not in LONG_STEPS)} |"
    )
    rows.append(f"| **total** | {cells(None, lambda n: True)} |")
    listed = (
        f"{before['tools_list']:,} → {numbers['tools_list']:,}"
        if before
        else f"{numbers['tools_list']:,}"
    )
    return "\n".join(rows) + f"\n\ntools/list: {listed} characters of JSON"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--before", type=Path, help="numbers of an earlier run (--json) to show")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="bench-screens-") as tmp,
        running_server(Path(tmp), SANDBOX_AUTH_TOKEN=TOKEN, **SETTINGS) as server,
    ):
        legacy, listed = await measure(server.url, "legacy")
        modern, _ = await measure(server.url, "auto")
    numbers = {"legacy": legacy, "modern": modern, "tools_list": listed}
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=1))
    before = json.loads(args.before.read_text()) if args.before else None
    print(table(numbers, before))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
