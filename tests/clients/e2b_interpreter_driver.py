"""E2B's Python code-interpreter SDK (`e2b-code-interpreter`, unmodified) against our server.

Run in the SDK's venv with only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set:
`python e2b_interpreter_driver.py SCENARIO`. Each scenario creates a sandbox, does what E2B's
documentation and its own tests do, kills the sandbox, and prints what it saw as one JSON
object (tests/test_e2b_interpreter.py asserts on it).
"""

from __future__ import annotations

import base64
import json
import sys
import time

from e2b import NotFoundException, TimeoutException
from e2b_code_interpreter import Context, Sandbox

PANDAS_CHART = """
import pandas as pd
import matplotlib.pyplot as plt

df = pd.DataFrame({"year": [2020, 2021, 2022], "sales": [10.5, 12.0, 15.25]})
fig, ax = plt.subplots()
ax.plot(df["year"], df["sales"], label="sales")
ax.set_title("Sales by year")
ax.set_xlabel("Year")
ax.set_ylabel("Sales (kEUR)")
plt.show()
df
"""


def pandas_chart(sbx: Sandbox) -> dict:
    execution = sbx.run_code(PANDAS_CHART)
    out: dict = {"error": execution.error and execution.error.name, "results": []}
    for result in execution.results:
        item = {"formats": list(result.formats()), "main": result.is_main_result}
        if result.png:
            item["png_magic"] = base64.b64decode(result.png)[:8].hex()
            item["png_bytes"] = len(base64.b64decode(result.png))
        if result.chart:
            chart = result.chart
            item["chart"] = {
                "type": chart.type.value,
                "title": chart.title,
                "x_label": chart.x_label,
                "y_label": chart.y_label,
                "y_unit": chart.y_unit,
                "elements": [{"label": e.label, "points": e.points} for e in chart.elements],
            }
        if result.data:
            item["data"] = result.data
        if result.text:
            item["text"] = result.text
        out["results"].append(item)
    out["execution_count"] = execution.execution_count
    return out


def exception(sbx: Sandbox) -> dict:
    errors = []
    sbx.run_code("kept = 'still here'")
    execution = sbx.run_code(
        "def divide(a, b):\n    return a / b\n\ndivide(1, 0)", on_error=errors.append
    )
    error = execution.error
    after = sbx.run_code("kept")
    return {
        "name": error.name,
        "value": error.value,
        "traceback": error.traceback,
        "callbacks": len(errors),
        "results": len(execution.results),
        "after": after.text,
        "counts": [execution.execution_count, after.execution_count],
    }


def javascript(sbx: Sandbox) -> dict:
    default = sbx.run_code("const greeting = 'hello'; console.log(greeting); 40 + 2", language="js")
    again = sbx.run_code("greeting.toUpperCase()", language="javascript")
    context = sbx.create_code_context(language="javascript")
    separate = sbx.run_code("typeof greeting", context=context)
    awaited = sbx.run_code("await Promise.resolve('awaited')", context=context)
    return {
        "stdout": default.logs.stdout,
        "text": default.text,
        "again": again.text,
        "context_language": context.language,
        "separate": separate.text,
        "awaited": awaited.text,
    }


def contexts(sbx: Sandbox) -> dict:
    sbx.run_code("x = 1")
    context = sbx.create_code_context(cwd="/home/user")
    listed = sbx.list_code_contexts()
    independent = sbx.run_code("x", context=context)
    sbx.run_code("import os\nos.makedirs('sub', exist_ok=True)\ny = 2", context=context)
    other = sbx.create_code_context(language="python", cwd="/home/user/sub")
    cwd = sbx.run_code("import os; os.getcwd()", context=other)
    sbx.restart_code_context(context)
    restarted = sbx.run_code("y", context=context)
    sbx.remove_code_context(context.id)
    after = sbx.list_code_contexts()
    try:
        sbx.run_code("1", context=context)
        removed_run = "ran"
    except NotFoundException as exc:
        removed_run = f"NotFound: {exc}"
    try:
        sbx.run_code("1", context=Context("no-such-context", "python", "/home/user"))
        unknown = "ran"
    except NotFoundException as exc:
        unknown = f"NotFound: {exc}"
    return {
        "created": {"language": context.language, "cwd": context.cwd},
        "listed": [[c.id == context.id, c.language] for c in listed],
        "independent": independent.error and independent.error.value,
        "cwd": cwd.text,
        "restarted": restarted.error and restarted.error.value,
        "after_ids": [c.id for c in after],
        "removed_id": context.id,
        "removed_run": removed_run,
        "unknown": unknown,
        "default_x": sbx.run_code("x").text,
    }


def callbacks(sbx: Sandbox) -> dict:
    started = time.monotonic()
    seen: list[tuple[str, float]] = []
    stderr: list[str] = []
    execution = sbx.run_code(
        "import sys, time\nprint('first', flush=True)\ntime.sleep(2)\n"
        "print('oops', file=sys.stderr, flush=True)\nprint('second')",
        on_stdout=lambda m: seen.append((m.line, time.monotonic() - started)),
        on_stderr=lambda m: stderr.append(m.line),
    )
    returned = time.monotonic() - started
    return {
        "stdout": [line for line, _ in seen],
        "first_at": seen[0][1] if seen else None,
        "returned_at": returned,
        "stderr": stderr,
        "logs": execution.logs.stdout,
        "timestamp_type": type(seen[0][0]).__name__ if seen else None,
    }


def envs(sbx: Sandbox) -> dict:
    set_once = sbx.run_code("import os; os.getenv('FOO')", envs={"FOO": "bar"})
    gone = sbx.run_code("import os; os.getenv('FOO', 'default')")
    sandbox_wide = sbx.run_code("import os; os.getenv('SANDBOX_WIDE', 'missing')")
    home = sbx.run_code("import os; os.path.expanduser('~') + ' ' + os.environ['USER']")
    return {
        "set": set_once.text,
        "after": gone.text,
        "sandbox_wide": sandbox_wide.text,
        "home": home.text,
    }


def abandon(sbx: Sandbox) -> dict:
    sbx.run_code("state = 'kept'")
    started = time.monotonic()
    try:
        sbx.run_code("import time\nfor _ in range(600):\n    time.sleep(0.1)", timeout=2)
        outcome = "finished"
    except TimeoutException as exc:
        outcome = f"timeout: {exc}"
    abandoned_at = time.monotonic() - started
    # The next call waits behind the abandoned one unless the server interrupted it.
    started = time.monotonic()
    after = sbx.run_code("state")
    return {
        "outcome": outcome,
        "abandoned_at": abandoned_at,
        "next_took": time.monotonic() - started,
        "after": after.text,
        "sandbox_id": sbx.sandbox_id,
    }


SCENARIOS = {
    "pandas_chart": pandas_chart,
    "exception": exception,
    "javascript": javascript,
    "contexts": contexts,
    "callbacks": callbacks,
    "envs": envs,
    "abandon": abandon,
}


def main() -> None:
    scenario = SCENARIOS[sys.argv[1]]
    sbx = Sandbox.create(envs={"SANDBOX_WIDE": "everywhere"})
    try:
        print(json.dumps(scenario(sbx), default=str))
    finally:
        sbx.kill()


if __name__ == "__main__":
    main()
