"""The E2B code interpreter (sandbox port 49999) against E2B's own SDKs, unmodified.

Python's `e2b-code-interpreter` and JavaScript's `@e2b/code-interpreter` (under Node) are
pointed at a real server with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY only, and run E2B's
documented examples (tests/clients/e2b_interpreter_driver.*): pandas with a matplotlib chart
(its PNG and its chart data), an exception, a JavaScript context, code contexts created,
listed, restarted and removed, stdout callbacks while the code runs, per-call environment
variables, a client that gives up on a call. Then the wire itself, hostile: `context_id` with
`language`, an unknown context, an oversized body, bad JSON, tokens that do not match, a
stream abandoned mid-call, keepalives.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp_harness import ROOT, ServerProcess
from topology_harness import running_topology

pytestmark = pytest.mark.e2e

KEY = "e2b_" + "5a" * 16
OTHER_KEY = "e2b_" + "b7" * 16
DRIVERS = Path(__file__).parent / "clients"


def e2b_python(which: str = "") -> str:
    """The venv with E2B's Python SDKs, the latest (SRT_CLIENTS_E2B_PY) or `which="_OLD"` the
    oldest pinned (SRT_CLIENTS_E2B_PY_OLD); scripts/_setup.sh makes them."""
    default = ROOT / (".clients/e2b-py-old" if which else ".clients/e2b-py") / "bin/python"
    python = os.environ.get(f"SRT_CLIENTS_E2B_PY{which}") or str(default)
    assert Path(python).exists(), (
        f"no E2B Python SDK venv at {python}: run scripts/test once (ensure_clients) or set "
        f"SRT_CLIENTS_E2B_PY{which}"
    )
    return python


def e2b_node_modules() -> Path:
    """node_modules holding `@e2b/code-interpreter` (SRT_CLIENTS_E2B_NODE)."""
    base = Path(os.environ.get("SRT_CLIENTS_E2B_NODE") or ROOT / ".clients/e2b-node")
    modules = base / "node_modules"
    assert (modules / "@e2b/code-interpreter").is_dir(), (
        f"no @e2b/code-interpreter under {modules}: run scripts/test once (ensure_clients) or "
        "set SRT_CLIENTS_E2B_NODE"
    )
    return modules


@pytest.fixture(scope="module")
def server(serve: Any) -> ServerProcess:
    return serve(
        "e2b-interpreter",
        SANDBOX_E2B="true",
        SANDBOX_AUTH_TOKENS=f"alice:{KEY},bob:{OTHER_KEY}",
        SANDBOX_MAX_INTERPRETERS_PER_PRINCIPAL="12",
    )


def sdk_env(server: ServerProcess, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Only what points the SDKs here (and what runs a program at all)."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env.update(
        E2B_API_URL=f"{server.base_url}/e2b",
        E2B_SANDBOX_URL=f"{server.base_url}/e2b",
        E2B_API_KEY=KEY,
    )
    env.update(extra or {})
    return env


def run_python(
    server: ServerProcess, scenario: str, which: str = "", env: dict[str, str] | None = None
) -> dict[str, Any]:
    done = subprocess.run(
        [e2b_python(which), str(DRIVERS / "e2b_interpreter_driver.py"), scenario],
        env=env or sdk_env(server),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"{scenario} failed:\n{done.stdout}\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- the Python SDK ---------------------------------------------------------------------------


def test_python_sdk_runs_pandas_with_a_matplotlib_chart(server: ServerProcess) -> None:
    seen = run_python(server, "pandas_chart")
    assert seen["error"] is None
    figure, frame = seen["results"]
    assert figure["main"] is False and figure["png_magic"] == "89504e470d0a1a0a"
    assert figure["png_bytes"] > 1000
    assert set(figure["formats"]) >= {"png", "chart"}
    assert figure["chart"] == {
        "type": "line",
        "title": "Sales by year",
        "x_label": "Year",
        "y_label": "Sales (kEUR)",
        "y_unit": "kEUR",
        "elements": [
            {"label": "sales", "points": [[2020.0, 10.5], [2021.0, 12.0], [2022.0, 15.25]]}
        ],
    }
    assert frame["main"] is True and "html" in frame["formats"]
    assert frame["data"] == {"year": [2020, 2021, 2022], "sales": [10.5, 12.0, 15.25]}
    assert "2021" in frame["text"]
    # The context's setup cell gave its number back: the user's first cell is 1, as on E2B.
    assert seen["execution_count"] == 1


def test_python_sdk_exception_has_name_value_and_traceback(server: ServerProcess) -> None:
    seen = run_python(server, "exception")
    assert (seen["name"], seen["value"]) == ("ZeroDivisionError", "division by zero")
    assert "----> 4 divide(1, 0)" in seen["traceback"]
    assert "return a / b" in seen["traceback"] and "\x1b[" not in seen["traceback"]
    assert seen["callbacks"] == 1 and seen["results"] == 0
    assert seen["after"] == "still here"  # an exception keeps the context's state
    assert seen["counts"] == [2, 3]


def test_python_sdk_javascript_context(server: ServerProcess) -> None:
    seen = run_python(server, "javascript")
    assert seen["stdout"] == ["hello\n"] and seen["text"] == "42"
    assert seen["again"] == "HELLO"  # `js` and `javascript` are one default context
    assert seen["context_language"] == "javascript"
    assert seen["separate"] == "undefined"  # a created context has its own state
    assert seen["awaited"] == "awaited"


def test_python_sdk_code_contexts_are_created_listed_restarted_removed(
    server: ServerProcess,
) -> None:
    seen = run_python(server, "contexts")
    assert seen["created"] == {"language": "python", "cwd": "/home/user"}
    # The defaults first (python, javascript), then the created context last, as on E2B.
    assert seen["listed"] == [[False, "python"], [False, "javascript"], [True, "python"]]
    assert seen["independent"] == "name 'x' is not defined"
    assert seen["cwd"] == "/workspace/sub"  # (/home/user is the workspace)
    assert seen["restarted"] == "name 'y' is not defined"
    assert seen["removed_id"] not in seen["after_ids"] and len(seen["after_ids"]) == 3
    assert seen["removed_run"].startswith("NotFound: Context ")
    assert seen["unknown"] == "NotFound: Context no-such-context not found"
    assert seen["default_x"] == "1"


def test_python_sdk_on_stdout_streams_while_the_code_runs(server: ServerProcess) -> None:
    seen = run_python(server, "callbacks")
    assert seen["stdout"] == ["first\n", "second\n"] and seen["logs"] == seen["stdout"]
    assert seen["stderr"] == ["oops\n"]
    # The first line reached the callback while the code still slept (2 s) before its end.
    assert seen["first_at"] < seen["returned_at"] - 1.0


def test_python_sdk_envs_last_one_call_and_sandbox_envs_stay(server: ServerProcess) -> None:
    seen = run_python(server, "envs")
    assert seen == {
        "set": "bar",
        "after": "default",
        "sandbox_wide": "everywhere",
        "home": "/home/user user",  # (as E2B's sandboxes, and its commands here)
    }


def test_a_client_that_gives_up_interrupts_its_call_and_the_state_stays(
    server: ServerProcess,
) -> None:
    """E2B's server interrupts the kernel when the client goes away (its #213): so here. The
    next call does not wait for the abandoned one (60 s of sleep), and the state is kept."""
    seen = run_python(server, "abandon")
    assert seen["outcome"].startswith("timeout: Execution timed out")
    assert seen["next_took"] < 15, seen
    assert seen["after"] == "kept"
    assert "e2b execute stream abandoned" in server.stderr_text()


def test_the_oldest_pinned_python_sdk_runs_the_chart_and_contexts(server: ServerProcess) -> None:
    """The oldest SDK pinned (E2B_SANDBOX_URL arrived in e2b-code-interpreter 2.9.0)."""
    chart = run_python(server, "pandas_chart", "_OLD")
    assert chart["results"][0]["chart"]["type"] == "line"
    assert chart["results"][1]["data"]["sales"] == [10.5, 12.0, 15.25]
    contexts = run_python(server, "contexts", "_OLD")
    assert contexts["listed"] == [[False, "python"], [False, "javascript"], [True, "python"]]
    assert contexts["restarted"] == "name 'y' is not defined"


# -- the JavaScript SDK under Node ------------------------------------------------------------


def test_js_sdk_under_node_runs_the_documented_examples(server: ServerProcess) -> None:
    modules = e2b_node_modules()
    done = subprocess.run(
        ["node", str(DRIVERS / "e2b_interpreter_driver.mjs")],
        env=sdk_env(server, {"NODE_PATH": str(modules)}),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    figure, frame = seen["results"]
    assert figure["main"] is False and figure["png"] == "89504e470d0a1a0a"
    assert figure["chart"]["type"] == "bar" and figure["chart"]["title"] == "Bars"
    assert [(e["label"], e["value"]) for e in figure["chart"]["elements"]] == [
        ("a", 2),
        ("b", 4),
        ("c", 8),
    ]
    assert frame["main"] is True and frame["data"] == {"x": [1, 2, 3], "y": [2, 4, 8]}
    assert seen["count"] == 1
    assert "".join(seen["printed"]) == "one\ntwo\n" and seen["logs"] == seen["printed"]
    assert seen["error"]["name"] == "ValueError" and seen["error"]["value"] == "bad value"
    assert 'raise ValueError("bad value")' in seen["error"]["traceback"]
    assert seen["js"] == "40"
    assert seen["listed_last"] and seen["z"] == "7" and seen["z_default"] == "NameError"
    assert seen["z_restarted"] == "NameError"
    assert seen["removed"] and seen["removed_run"] == "NotFoundError"


# -- the wire, hostile ------------------------------------------------------------------------


@pytest.fixture
def sandbox(server: ServerProcess) -> Any:
    """A sandbox made through the control plane: (id, envd access token); killed after."""
    with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=60) as http:
        made = http.post(
            "/sandboxes", json={"templateID": "code-interpreter-v1"}, headers={"X-API-KEY": KEY}
        )
        assert made.status_code == 201, made.text
        body = made.json()
        yield body["sandboxID"], body["envdAccessToken"]
        http.delete(f"/sandboxes/{body['sandboxID']}", headers={"X-API-KEY": KEY})


def interp(sandbox_id: str, token: str | None) -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49999"}
    if token is not None:
        headers["X-Access-Token"] = token
    return headers


def ndjson(response: Any) -> list[dict[str, Any]]:
    lines = response.text.split("\n")
    assert lines[-1] == "" and all(lines[:-1]), "NDJSON: one object a line, no empty line"
    return [json.loads(line) for line in lines[:-1]]


def test_context_id_with_language_is_refused_and_an_unknown_context_is_404(
    server: ServerProcess, sandbox: Any
) -> None:
    sandbox_id, token = sandbox
    with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=60) as http:
        both = http.post(
            "/execute",
            json={"code": "1", "context_id": "x", "language": "python"},
            headers=interp(sandbox_id, token),
        )
        assert both.status_code == 400
        assert both.text == "Only one of context_id or language can be provided"
        unknown = http.post(
            "/execute", json={"code": "1", "context_id": "nope"}, headers=interp(sandbox_id, token)
        )
        assert (unknown.status_code, unknown.text) == (404, "Context nope not found")
        for path, method in (("/contexts/nope", "DELETE"), ("/contexts/nope/restart", "POST")):
            gone = http.request(method, path, headers=interp(sandbox_id, token))
            assert (gone.status_code, gone.text) == (404, "Context nope not found")
        bad_language = http.post(
            "/execute", json={"code": "1", "language": "cobol"}, headers=interp(sandbox_id, token)
        )
        assert bad_language.status_code == 400 and "'cobol' is not available" in bad_language.text
        not_text = http.post("/execute", json={"code": ["1"]}, headers=interp(sandbox_id, token))
        assert (not_text.status_code, not_text.text) == (400, "code must be a string")
        not_json = http.post("/execute", content=b"{nope", headers=interp(sandbox_id, token))
        assert not_json.status_code == 400
        bad_env = http.post(
            "/execute",
            json={"code": "1", "env_vars": {"A B": "x"}},
            headers=interp(sandbox_id, token),
        )
        assert bad_env.status_code == 400 and "not valid" in bad_env.text
        # Nothing of these made a context.
        listed = http.get("/contexts", headers=interp(sandbox_id, token)).json()
        assert [c["language"] for c in listed] == ["python", "javascript"]


def test_an_oversized_body_is_refused_before_it_is_read_whole(
    server: ServerProcess, sandbox: Any
) -> None:
    sandbox_id, token = sandbox
    huge = json.dumps({"code": "x = '" + "a" * (3 * 1024 * 1024) + "'"}).encode()

    def chunks() -> Any:  # (no Content-Length: the server counts what it reads)
        for start in range(0, len(huge), 65536):
            yield huge[start : start + 65536]

    with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=60) as http:
        declared = http.post("/execute", content=huge, headers=interp(sandbox_id, token))
        assert declared.status_code == 413 and "over 2097152 bytes" in declared.text
        streamed = http.post("/execute", content=chunks(), headers=interp(sandbox_id, token))
        assert streamed.status_code == 413
        fine = http.post("/execute", json={"code": "6 * 7"}, headers=interp(sandbox_id, token))
        assert next(e for e in ndjson(fine) if e["type"] == "result")["text"] == "42"


def test_tokens_that_do_not_match_reach_nothing(server: ServerProcess) -> None:
    """Every call to port 49999 needs the sandbox's access token or its traffic access token
    (what E2B's SDKs send to /contexts): the sandbox id alone, another sandbox's tokens, or
    the traffic token on envd reach nothing, with the answer an unknown sandbox gets."""
    with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=60) as http:
        made = http.post(
            "/sandboxes", json={"templateID": "code-interpreter-v1"}, headers={"X-API-KEY": KEY}
        ).json()
        other = http.post(
            "/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": OTHER_KEY}
        ).json()
        sandbox_id, traffic = made["sandboxID"], made["trafficAccessToken"]
        try:
            assert traffic and traffic != made["envdAccessToken"]
            connected = http.post(
                f"/sandboxes/{sandbox_id}/connect", json={}, headers={"X-API-KEY": KEY}
            ).json()
            assert connected["trafficAccessToken"] == traffic
            by_traffic = {**interp(sandbox_id, None), "E2B-Traffic-Access-Token": traffic}
            assert http.get("/contexts", headers=by_traffic).status_code == 200
            ran = http.post("/execute", json={"code": "6 * 7"}, headers=by_traffic)
            assert next(e for e in ndjson(ran) if e["type"] == "result")["text"] == "42"
            unknown_id = "i" + "0" * 19
            unknown = http.get(
                "/contexts", headers=interp(unknown_id, other["envdAccessToken"])
            ).json()
            assert unknown["message"] == f"The sandbox {unknown_id} was not found"
            others = {
                **interp(sandbox_id, other["envdAccessToken"]),
                "E2B-Traffic-Access-Token": other["trafficAccessToken"],
            }
            for path in ("/contexts", "/execute"):
                for headers in (
                    interp(sandbox_id, None),  # the id alone
                    interp(sandbox_id, "wrong"),
                    {**interp(sandbox_id, None), "E2B-Traffic-Access-Token": "wrong"},
                    others,  # another principal's sandbox's tokens
                ):
                    refused = http.post(path, json={"code": "1"}, headers=headers)
                    assert refused.status_code in (401, 502), refused.text
                    if refused.status_code == 502:
                        assert refused.json()["message"] == (
                            f"The sandbox {sandbox_id} was not found"
                        )
            envd = {
                "E2b-Sandbox-Id": sandbox_id,
                "E2B-Traffic-Access-Token": traffic,
                "Content-Type": "application/json",
            }
            listed = http.post("/process.Process/List", json={}, headers=envd)
            assert listed.status_code == 401, listed.text
        finally:
            http.delete(f"/sandboxes/{sandbox_id}", headers={"X-API-KEY": KEY})
            http.delete(f"/sandboxes/{other['sandboxID']}", headers={"X-API-KEY": OTHER_KEY})


def test_a_stream_keeps_alive_and_an_abandoned_one_is_interrupted(
    server: ServerProcess, sandbox: Any
) -> None:
    sandbox_id, token = sandbox
    with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=60) as http:
        slow = http.post(
            "/execute",
            json={"code": "import time\nkept = 5\nprint('a', flush=True)\ntime.sleep(6)\nkept"},
            headers=interp(sandbox_id, token),
        )
        items = ndjson(slow)
        kinds = [i["type"] for i in items]
        assert kinds[0] == "stdout" and "keepalive" in kinds
        assert kinds[-3:] == ["result", "number_of_executions", "end_of_execution"]
        assert items[0]["text"] == "a\n" and items[0]["timestamp"].endswith("Z")
        # A client that reads the first line, then closes the connection.
        started = time.monotonic()
        with http.stream(
            "POST",
            "/execute",
            json={"code": "import time\nprint('go', flush=True)\ntime.sleep(120)"},
            headers=interp(sandbox_id, token),
        ) as stream:
            first = json.loads(next(stream.iter_lines()))
            assert first["type"] == "stdout"
        after = http.post("/execute", json={"code": "kept"}, headers=interp(sandbox_id, token))
        assert time.monotonic() - started < 30
        results = [i for i in ndjson(after) if i["type"] == "result"]
        assert results[0]["text"] == "5"


def test_context_registry_is_bounded() -> None:
    from sandbox_runtime.e2b.interpreter_contexts import MAX_CONTEXTS, ContextRegistry

    registry = ContextRegistry("/home/user")
    for _ in range(MAX_CONTEXTS):
        registry.create("sbx", "python", "/home/user")
    with pytest.raises(ValueError, match="maximum of 16 code contexts"):
        registry.create("sbx", "python", "/home/user")
    assert len(registry.of("sbx").listed()) == MAX_CONTEXTS + 2


def test_bash_and_typescript_contexts_and_input_over_the_wire(
    server: ServerProcess, sandbox: Any
) -> None:
    sandbox_id, token = sandbox
    with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=120) as http:

        def run(body: dict[str, Any]) -> list[dict[str, Any]]:
            answer = http.post("/execute", json=body, headers=interp(sandbox_id, token))
            assert answer.status_code == 200, answer.text
            return ndjson(answer)

        made = http.post(
            "/contexts", json={"language": "bash", "cwd": "/tmp"}, headers=interp(sandbox_id, token)
        )
        assert made.status_code == 200 and made.json()["cwd"] == "/tmp"
        bash = run({"code": "pwd; export Q=7", "context_id": made.json()["id"]})
        assert "".join(i["text"] for i in bash if i["type"] == "stdout").strip() == "/tmp"
        again = run({"code": "echo $Q", "context_id": made.json()["id"]})
        # (the bash kernel may send a line in pieces)
        assert "".join(i["text"] for i in again if i["type"] == "stdout") == "7\n"
        ts = run({"code": "const s: string = 'typed'; s.length", "language": "ts"})
        assert [i.get("text") for i in ts if i["type"] == "result"] == ["5"]
        asked = run({"code": "name = input('name? ')"})
        errors = [i for i in asked if i["type"] == "error"]
        assert [e["name"] for e in errors] == ["StdinNotImplementedError"]
        assert run({"code": "'after'"})[0]["text"] == "after"  # (unquoted, as E2B's)
        bad_cwd = http.post(
            "/contexts", json={"cwd": "/no/such/dir"}, headers=interp(sandbox_id, token)
        )
        assert bad_cwd.status_code == 500 and "No such file or directory" in bad_cwd.text
        listed = http.get("/contexts", headers=interp(sandbox_id, token)).json()
        assert [c["language"] for c in listed] == [
            "python",
            "javascript",
            "bash",
            "typescript",
        ]


def test_results_and_ends_are_e2b_lines() -> None:
    from sandbox_runtime.domain.models import ExecutionInfo, ExecutionStatus
    from sandbox_runtime.e2b.interpreter_stream import end_lines, result_line

    chart = {"type": "pie", "title": None, "elements": []}
    bundle = {"text/plain": "'abc'", "image/png": "iVBOR", "e2b/chart": chart, "x/y": 1}
    assert result_line(bundle, True) == {
        "type": "result",
        "text": "abc",
        "png": "iVBOR",
        "chart": chart,
        "extra": {"x/y": 1},
        "is_main_result": True,
    }
    info = ExecutionInfo.model_construct(
        status=ExecutionStatus.TIMEOUT, error="timed out after 5 seconds", reason="timeout",
        execution_count=4,
    )  # fmt: skip
    assert end_lines(info, raised=False) == [
        {"type": "error", "name": "TimeoutError", "value": "timed out after 5 seconds",
         "traceback": ""},
        {"type": "number_of_executions", "execution_count": 4},
        {"type": "end_of_execution"},
    ]  # fmt: skip
    assert next(i["type"] for i in end_lines(info, raised=True)) == "number_of_executions"


def test_the_edges_own_cells_are_valid_code() -> None:
    from sandbox_runtime.e2b.interpreter_contexts import CodeContext, cleanup_code, setup_code

    context = CodeContext("c1", "python", "/home/user/it's", "python:c1")
    env = {"A": "x'y\"z\n", "B": ""}
    for full in (True, False):
        compile(setup_code(context, env, full), "setup", "exec")
    compile(cleanup_code("python", env, {"B": "kept"}), "cleanup", "exec")
    bash = CodeContext("c2", "bash", "/tmp/a b", "bash:c2")
    assert setup_code(bash, {"A": "it's"}, True) == "cd '/tmp/a b'\nexport A='it'\\''s'\n"
    assert cleanup_code("bash", {"A": "1", "B": "2"}, {"B": "old"}) == "unset A\nexport B='old'\n"


def test_calls_through_a_replica_that_is_not_the_sandboxs_home(tmp_path: Path) -> None:
    """Two replicas sharing Redis: a sandbox homed on one is used through the other, which
    forwards each call to the home and streams it from there (output while it runs, results,
    contexts); and the SDK through nginx, which keeps a sandbox's requests on one replica."""
    with running_topology(
        tmp_path, count=2, SANDBOX_E2B="true", SANDBOX_AUTH_TOKENS=f"alice:{KEY}"
    ) as topology:
        home, other = topology.replicas.values()
        with httpx2.Client(timeout=120) as http:
            made = http.post(
                f"{home.base_url}/e2b/sandboxes",
                json={"templateID": "code-interpreter-v1"},
                headers={"X-API-KEY": KEY},
            ).json()
            headers = interp(made["sandboxID"], made["envdAccessToken"])
            here = http.post(
                f"{home.base_url}/e2b/execute", json={"code": "x = 1"}, headers=headers
            )
            assert here.status_code == 200  # (its session is homed on `home` now)
            code = "import time\nprint('b', flush=True)\ntime.sleep(6)\nx + 1"
            there = ndjson(
                http.post(f"{other.base_url}/e2b/execute", json={"code": code}, headers=headers)
            )
            kinds = [i["type"] for i in there]
            assert kinds[0] == "stdout" and "keepalive" in kinds
            assert kinds[-3:] == ["result", "number_of_executions", "end_of_execution"]
            assert there[-3]["text"] == "2"
            context = http.post(
                f"{other.base_url}/e2b/contexts",
                json={"language": "python"},
                headers={
                    **interp(made["sandboxID"], None),
                    "E2B-Traffic-Access-Token": made["trafficAccessToken"],
                },
            ).json()
            separate = ndjson(
                http.post(
                    f"{other.base_url}/e2b/execute",
                    json={"code": "x", "context_id": context["id"]},
                    headers=headers,
                )
            )
            assert separate[0]["type"] == "error" and separate[0]["name"] == "NameError"
            forwarded = other.metric(
                KEY, "srt_forwarded_calls_total", 'op="run_code"', 'result="ok"'
            )
            assert forwarded >= 3, forwarded
            http.delete(
                f"{home.base_url}/e2b/sandboxes/{made['sandboxID']}", headers={"X-API-KEY": KEY}
            )
        via_nginx = f"http://127.0.0.1:{topology.nginx.port}/e2b"
        env = sdk_env(home, {"E2B_API_URL": via_nginx, "E2B_SANDBOX_URL": via_nginx})
        chart = run_python(home, "pandas_chart", env=env)
        assert chart["results"][0]["chart"]["type"] == "line"
        contexts = run_python(home, "contexts", env=env)
        assert contexts["restarted"] == "name 'y' is not defined"
        assert contexts["unknown"] == "NotFound: Context no-such-context not found"


def test_a_sandbox_without_internet_runs_its_contexts_under_that_limit(
    server: ServerProcess,
) -> None:
    """allow_internet_access=false: every interpreter of the sandbox starts without network
    (the sandbox's sandbox_config), its defaults, created contexts and restarts alike."""
    with httpx2.Client(base_url=f"{server.base_url}/e2b", timeout=120) as http:
        made = http.post(
            "/sandboxes",
            json={"templateID": "code-interpreter-v1", "allow_internet_access": False},
            headers={"X-API-KEY": KEY},
        ).json()
        headers = interp(made["sandboxID"], made["envdAccessToken"])
        try:
            first = ndjson(http.post("/execute", json={"code": "6 * 7"}, headers=headers))
            assert first[0]["text"] == "42"
            context = http.post("/contexts", json={}, headers=headers).json()
            restarted = http.post(f"/contexts/{context['id']}/restart", headers=headers)
            assert restarted.status_code == 200, restarted.text
            ran = ndjson(
                http.post(
                    "/execute", json={"code": "'ok'", "context_id": context["id"]}, headers=headers
                )
            )
            assert ran[0]["text"] == "ok"
        finally:
            http.delete(f"/sandboxes/{made['sandboxID']}", headers={"X-API-KEY": KEY})
