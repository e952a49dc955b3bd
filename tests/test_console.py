"""The web console at `/`, in a real headless Chromium against a real server: signing in,
running code in every language with live output, plots, HTML kept in a sandboxed frame,
input(), cancel, the executions list, files up and down, security headers, a narrow window,
accessible names, and that no request URL ever carries the token.

Each test saves a screenshot of its end state under $SRT_ARTIFACTS (default: the pytest
basetemp's artifacts/). SRT_UPDATE_DOCS_SCREENSHOT=1 also writes the plot test's screenshot
to docs/console.png (the README's picture).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_harness import Browser, Console, browser_available, open_browser
from mcp_harness import ROOT, ServerProcess, Servers, open_client, running_server
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement

pytestmark = [pytest.mark.e2e]
# No browser is an error, not a skip: CI installs chromium and chromium-driver.
assert browser_available() is None, browser_available()

TOKEN = f"srt-console-{secrets.token_hex(16)}"
WRONG_TOKEN = f"srt-wrong-{secrets.token_hex(16)}"
SESSION = "console"  # the sign-in form's default

# Every browser of the module, for the whole-session checks at the end.
BROWSERS: list[Browser] = []


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(os.environ.get("SRT_ARTIFACTS") or tmp_path_factory.getbasetemp() / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    print(f"\nconsole screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def server(serve: Servers) -> ServerProcess:
    return serve("console-srv", SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_INTERPRETER_WARM="python=1")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    with open_browser(tmp_path_factory.mktemp("browser")) as b:
        BROWSERS.append(b)
        yield b


@pytest.fixture
def fresh_browser(tmp_path: Path) -> Iterator[Browser]:
    """A second browser with a profile of its own (nothing remembered from the main one)."""
    with open_browser(tmp_path / "fresh") as b:
        BROWSERS.append(b)
        yield b


@pytest.fixture(scope="module")
def page(browser: Browser, server: ServerProcess) -> Console:
    """The console in the module's browser (not signed in yet: the first test signs in)."""
    console = Console(browser, server.base_url)
    console.open()
    return console


@pytest.fixture
def app(page: Console) -> Iterator[Console]:
    """The console, signed in and idle; anything left running is cancelled afterwards."""
    if not (page.d.current_url.startswith(page.base_url) and page.displayed("#app")):
        page.open()
        if not page.displayed("#app"):
            page.sign_in(TOKEN)
        page.wait_signed_in()
    yield page
    page.cancel_running()


@pytest.fixture
def shot(request: pytest.FixtureRequest, artifacts: Path, browser: Browser) -> Iterator[ShotTaker]:
    """Saves the test's end state (its own `shot()` call, or the main browser's page after the
    test, pass or fail)."""
    taker = ShotTaker(artifacts / f"{request.node.name}.png", browser)
    yield taker
    if not taker.taken:
        taker()


class ShotTaker:
    def __init__(self, path: Path, browser: Browser) -> None:
        self.path, self.browser, self.taken = path, browser, False

    def __call__(self, browser: Browser | None = None) -> Path:
        (browser or self.browser).screenshot(self.path)
        self.taken = True
        print(f"screenshot: {self.path}")
        return self.path


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    """GET `url` with urllib: (status, headers with lower-case names, body)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def in_row(row: WebElement | None, css: str) -> WebElement | None:
    """The element `css` inside `row` (None while the row is missing)."""
    return row.find_element(By.CSS_SELECTOR, css) if row is not None else None


def printed_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# -- 1. sign-in and the status strip ----------------------------------------------------------


def test_sign_in_shows_status_with_replica_id(
    page: Console, server: ServerProcess, shot: ShotTaker
) -> None:
    if page.displayed("#app"):
        page.forget()  # run after other tests: start signed out
    page.wait(lambda: page.displayed("#signin"), "the sign-in form #signin")
    assert not page.displayed("#app"), "#app is visible before signing in"
    token_input = page.el("#token")
    assert token_input.get_attribute("type") == "password", "#token is not a password input"
    assert page.el("#session").get_attribute("value") == SESSION, "#session default"

    page.sign_in(TOKEN)
    page.wait_signed_in()

    replica = server.health()["replica_id"]
    page.wait(
        lambda: replica in page.text("#status-replica"),
        f"#status-replica to show the replica id {replica!r}",
    )
    page.wait(
        lambda: re.search(r"\d", page.text("#status-running")),
        "#status-running to show a number",
    )
    page.wait(
        lambda: "disabled" in page.text("#status-redis"),
        '#status-redis to say "disabled" (no Redis)',
    )
    assert page.displayed("#status")
    shot()


# -- 2-5. running code ------------------------------------------------------------------------


STREAMING = "import time\nfor i in range(5):\n    print('line', i, flush=True)\n    time.sleep(0.6)"


def test_python_output_streams_while_running(app: Console, shot: ShotTaker) -> None:
    execution_id = app.start("python", STREAMING)

    def first_line() -> tuple[str, str] | None:
        state, text = app.js(
            "const o = document.querySelector('#output');"
            "return [o.getAttribute('data-state'), Array.from(o.querySelectorAll('.out-stdout'))"
            ".map(e => e.textContent).join('')];"
        )
        return (state, text) if "line 0" in text else None

    state, text = app.wait(first_line, '"line 0" in #output .out-stdout')
    assert state == "running", f"a line showed only at the end (data-state={state!r}): {text!r}"
    assert "line 4" not in text, f"all lines at once, not streamed: {text!r}"
    assert app.execution_status(execution_id) in ("pending", "running"), (
        "li[data-status] is not live while the run goes on"
    )

    exit_line = app.wait_done(execution_id)
    assert printed_lines(app.stdout()) == [f"line {i}" for i in range(5)], app.stdout()
    assert "completed" in exit_line and re.search(r"\b0\b", exit_line), exit_line
    assert app.execution_status(execution_id) == "completed"
    row = app.execution_text(execution_id)
    assert "completed" in row, f"the executions list's row does not show the status: {row!r}"
    shot()


def test_matplotlib_plot_shows_an_image(app: Console, shot: ShotTaker) -> None:
    _, exit_line = app.run(
        "python", "import matplotlib.pyplot as plt; plt.plot([1,3,2]); plt.show()"
    )
    assert "completed" in exit_line, exit_line
    image = app.wait(lambda: app.els("#output img.out-image"), "#output img.out-image")[0]
    assert (image.get_attribute("src") or "").startswith("data:image/"), image.get_attribute("src")
    width = app.wait(
        lambda: app.js("return arguments[0].complete && arguments[0].naturalWidth", image),
        "the plot image to load (naturalWidth > 0)",
    )
    assert width > 0
    assert image.is_displayed()
    path = shot()
    if os.environ.get("SRT_UPDATE_DOCS_SCREENSHOT") == "1":
        docs = ROOT / "docs" / "console.png"
        docs.parent.mkdir(exist_ok=True)
        docs.write_bytes(path.read_bytes())
        print(f"README screenshot: {docs}")


def test_javascript_bash_and_shell(app: Console, shot: ShotTaker) -> None:
    for language, code, expected in (
        ("javascript", "console.log(6*7)", "42"),
        ("bash", "echo $((6*7))", "42"),
        ("shell", "uname -s", "Linux"),
    ):
        _, exit_line = app.run(language, code)
        assert app.stdout().strip() == expected, (
            f"{language}: #output .out-stdout is {app.stdout()!r}, expected {expected!r}\n"
            + app.describe()
        )
        assert "completed" in exit_line and re.search(r"\b0\b", exit_line), (
            f"{language}: {exit_line!r}"
        )
    shot()


def test_python_error_shows_traceback(app: Console, shot: ShotTaker) -> None:
    _, exit_line = app.run("python", "def f():\n    return 1/0\nf()")
    error = app.text("#output .out-error")
    assert "ZeroDivisionError" in error, f".out-error: {error!r}\n{app.describe()}"
    assert re.search(r"\b1\b", exit_line), f"exit code 1 not in the exit line: {exit_line!r}"
    shot()


def test_ctrl_enter_runs(app: Console, shot: ShotTaker) -> None:
    before = set(app.execution_ids())
    app.set_code("python", "")
    code = app.el("#code")
    code.click()
    code.send_keys("print('via', 'keyboard')")
    code.send_keys(Keys.CONTROL, Keys.ENTER)
    execution_id = app.new_execution(before)
    app.wait_done(execution_id)
    assert app.stdout().strip() == "via keyboard", app.describe()
    shot()


def test_input_answered_from_stdin_box(app: Console, shot: ShotTaker) -> None:
    execution_id = app.start("python", "name = input('name? ')\nprint('hello', name)")
    app.wait(lambda: "name?" in app.text("#output .out-prompt"), ".out-prompt with 'name?'")
    assert app.output_state() == "running"
    assert app.el("#send-stdin").is_enabled(), "#send-stdin disabled while input() waits"
    box = app.el("#stdin")
    box.send_keys("console tester")
    app.el("#send-stdin").click()
    app.wait(lambda: "hello console tester" in app.stdout(), '"hello console tester" in stdout')
    exit_line = app.wait_done(execution_id)
    assert "completed" in exit_line, exit_line
    shot()


def test_a_shell_command_reads_typed_input_until_eof(app: Console, shot: ShotTaker) -> None:
    execution_id = app.start("shell", "wc -c; echo after-eof")
    app.wait(lambda: app.output_state() == "running", '#output[data-state="running"]')
    assert not app.stdout(), "wc printed before its input ended"
    app.wait(app.el("#close-stdin").is_enabled, "#close-stdin enabled for a shell command")
    app.el("#stdin").send_keys("abc")
    app.el("#send-stdin").click()  # "abc\n": 4 bytes
    app.el("#stdin").send_keys("de")
    app.el("#close-stdin").click()  # "de", then end of input
    exit_line = app.wait_done(execution_id)
    assert printed_lines(app.stdout()) == ["6", "after-eof"], app.describe()
    assert "completed" in exit_line, exit_line
    shot()


# -- 6. cancel ---------------------------------------------------------------------------------


def test_cancel_a_long_run(app: Console, shot: ShotTaker) -> None:
    execution_id = app.start("python", "import time; time.sleep(60)")
    app.wait(lambda: app.output_state() == "running", '#output[data-state="running"]')
    cancel = app.el("#cancel")
    app.wait(cancel.is_enabled, "#cancel enabled while running")
    app.wait(
        lambda: app.execution_status(execution_id) == "running",
        f"li {execution_id} data-status running",
    )
    clicked = time.monotonic()
    cancel.click()
    app.wait(
        lambda: "cancelled" in app.text("#output .out-exit"),
        '"cancelled" in the exit line',
        timeout=10,
    )
    took = time.monotonic() - clicked
    app.wait(
        lambda: app.execution_status(execution_id) == "cancelled",
        f"li {execution_id} data-status cancelled",
    )
    assert app.output_state() == "done"
    assert not app.el("#cancel").is_enabled(), "#cancel still enabled with nothing running"
    assert "cancelled" in app.execution_text(execution_id)
    print(f"cancelled after {took:.1f}s")
    shot()


def test_reopen_an_earlier_execution(app: Console, shot: ShotTaker) -> None:
    first, _ = app.run("python", "print('first run output')")
    app.run("python", "print('second run output')")
    assert "first run output" not in app.stdout()

    def reopen() -> WebElement:
        row = app.execution(first)
        buttons = row.find_elements(By.CSS_SELECTOR, "button.reopen")
        return buttons[0] if buttons else row

    app.click(reopen, f"execution {first}'s li (button.reopen)")
    app.wait(
        lambda: "first run output" in app.stdout() and "second run output" not in app.stdout(),
        f"#output to show execution {first} again",
    )
    app.wait(lambda: app.els("#output .out-exit"), "the reopened execution's exit line")
    assert "completed" in app.text("#output .out-exit")
    shot()


# -- 7. files ----------------------------------------------------------------------------------


UPLOAD_BYTES = b"\x00\xff\xfe console \x80\x81\xc3\x28 not utf-8\r\n" + bytes(range(256)) * 4


def test_upload_run_and_download(
    app: Console, browser: Browser, tmp_path: Path, shot: ShotTaker
) -> None:
    name = f"upload-{secrets.token_hex(4)}.bin"
    source = tmp_path / name
    source.write_bytes(UPLOAD_BYTES)
    app.el("input#upload").send_keys(str(source))
    app.wait(lambda: app.file_row(name), f'#files li[data-path] for "{name}"')

    digest = hashlib.sha256(UPLOAD_BYTES).hexdigest()
    app.run(
        "python",
        f"import hashlib\ndata = open('/workspace/{name}', 'rb').read()\n"
        "print(len(data), hashlib.sha256(data).hexdigest())",
    )
    assert app.stdout().split() == [str(len(UPLOAD_BYTES)), digest], (
        f"the sandbox read other bytes than were uploaded: {app.stdout()!r}"
    )

    for old in browser.download_dir.iterdir():
        old.unlink()
    app.click(
        lambda: in_row(app.file_row(name), "a.download"), f'a.download in the row of "{name}"'
    )
    got = browser.downloaded(min_size=len(UPLOAD_BYTES))
    assert got.read_bytes() == UPLOAD_BYTES, f"downloaded {got.name} differs from the upload"
    print(f"downloaded as {got.name}")
    shot()


def test_drop_zone_refresh_and_delete(app: Console, shot: ShotTaker) -> None:
    dropped = f"dropped-{secrets.token_hex(4)}.txt"
    app.js(
        "const zone = document.querySelector('#dropzone');"
        "const dt = new DataTransfer();"
        "dt.items.add(new File([arguments[1]], arguments[0], {type: 'text/plain'}));"
        "for (const type of ['dragenter', 'dragover', 'drop']) {"
        "  zone.dispatchEvent(new DragEvent(type, {bubbles: true, cancelable: true,"
        "    dataTransfer: dt}));"
        "}",
        dropped,
        "dropped text\n",
    )
    app.wait(lambda: app.file_row(dropped), f'#files li for the dropped "{dropped}"')
    app.run("python", f"print(open('/workspace/{dropped}').read(), end='')")
    assert app.stdout() == "dropped text\n", app.stdout()

    made = f"made-by-code-{secrets.token_hex(4)}.txt"
    app.run("python", f"open('/workspace/{made}', 'w').write('from code')")
    app.el("#refresh-files").click()
    app.wait(lambda: app.file_row(made), f'#files li for "{made}" after #refresh-files')
    app.click(lambda: in_row(app.file_row(made), "button.delete"), f'button.delete of "{made}"')
    app.accept_confirm()
    app.wait(lambda: app.file_row(made) is None, f'"{made}" gone from #files after delete')
    app.run("python", f"import os; print(os.path.exists('/workspace/{made}'))")
    assert app.stdout().strip() == "False", "the file is still in the workspace"
    shot()


# -- 8. the token ------------------------------------------------------------------------------


def test_wrong_token_shows_an_error(
    fresh_browser: Browser, server: ServerProcess, shot: ShotTaker
) -> None:
    console = Console(fresh_browser, server.base_url)
    console.open()
    console.sign_in(WRONG_TOKEN)
    console.wait(
        lambda: console.displayed("#signin-error") and console.text("#signin-error").strip(),
        "#signin-error visible with a message",
    )
    assert console.el("#signin-error").get_attribute("role") == "alert"
    time.sleep(0.5)  # nothing opens the app a moment later either
    assert not console.displayed("#app"), "#app is visible after a wrong token"
    assert console.displayed("#signin")
    assert_no_token_in_urls(fresh_browser, WRONG_TOKEN)
    shot(fresh_browser)


def assert_no_token_in_urls(browser: Browser, *tokens: str) -> None:
    urls = browser.request_urls()
    assert urls, "the performance log recorded no requests at all"
    for token in tokens:
        leaked = [u for u in urls if token in u]
        assert not leaked, f"request URLs carry the token: {leaked[:5]}"


# -- 9. HTML output and headers ---------------------------------------------------------------


HTML_CODE = (
    'from IPython.display import HTML, display; display(HTML("<script>parent.document.title'
    "='pwned'; document.cookie</script><img src=x onerror=\\\"parent.document.title='pwned'"
    '\\"><b id=marker>bold</b>"))'
)


def test_html_output_is_sandboxed(app: Console, shot: ShotTaker) -> None:
    title = app.d.title
    app.js("document.cookie = 'console_probe=1; path=/'")
    _, exit_line = app.run("python", HTML_CODE)
    assert "completed" in exit_line, exit_line
    frame = app.wait(lambda: app.els("#output iframe.out-html"), "#output iframe.out-html")[0]
    assert app.js("return arguments[0].hasAttribute('sandbox')", frame), "no sandbox attribute"
    assert app.js("return arguments[0].getAttribute('sandbox')", frame) == "", (
        "sandbox attribute is not empty: " + repr(frame.get_attribute("sandbox"))
    )
    assert "marker" in (frame.get_attribute("srcdoc") or ""), "the HTML is not in srcdoc"
    # An opaque origin: the page cannot reach into the frame (nor the frame into the page).
    assert app.js("return arguments[0].contentDocument === null", frame)
    time.sleep(1.0)  # give an onerror or script the chance it must not get
    assert app.d.title == title and "pwned" not in app.d.title, app.d.title
    app.d.switch_to.frame(frame)
    try:
        marker = app.wait(
            lambda: app.d.find_elements(By.CSS_SELECTOR, "b#marker"), "b#marker in the frame"
        )[0]
        assert marker.text == "bold"
        scripted = app.js("try { return document.cookie; } catch (e) { return 'blocked'; }")
        assert "console_probe" not in scripted, "the frame sees the page's cookies"
    finally:
        app.d.switch_to.default_content()
    assert app.d.title == title
    shot()


def test_security_headers(server: ServerProcess, page: Console, shot: ShotTaker) -> None:
    status, headers, _ = get(server.base_url + "/")
    assert status == 200
    csp = headers.get("content-security-policy", "")
    assert "default-src 'self'" in csp, csp
    assert "frame-ancestors 'none'" in csp, csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, csp
    assert headers.get("x-content-type-options", "").lower() == "nosniff", headers
    assert headers.get("referrer-policy"), headers
    # DNS rebinding: a page of another name resolving to this loopback server gets nothing.
    for name in ("index", "app.js"):
        path = "/" if name == "index" else f"/console/{name}"
        request = urllib.request.Request(server.base_url + path, headers={"Host": "evil.example"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                code = resp.status
        except urllib.error.HTTPError as exc:
            code = exc.code
        assert code == 421, f"{path} with Host: evil.example answered {code}"
    status, _, _ = get(server.base_url + "/console/../config.py")
    assert status == 404
    status, _, _ = get(server.base_url + "/console/secret.js")
    assert status == 404
    shot()


# -- 10. console off ---------------------------------------------------------------------------


async def test_console_can_be_turned_off(
    tmp_path: Path, fresh_browser: Browser, shot: ShotTaker
) -> None:
    with running_server(tmp_path / "off", SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_CONSOLE="false") as off:
        status, _, _ = get(off.base_url + "/")
        assert status == 404, f"GET / answered {status} with SANDBOX_CONSOLE=false"
        async with open_client(off.url, TOKEN) as conn:
            result = await conn.ok("execute_code", command="echo still-here")
            out = "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")
            assert out.strip() == "still-here"
        fresh_browser.driver.get(off.base_url + "/")
        assert not fresh_browser.driver.find_elements(By.ID, "signin")
        shot(fresh_browser)


# -- 11-12. layout and accessibility ----------------------------------------------------------


def test_narrow_window_has_no_horizontal_scroll(app: Console, shot: ShotTaker) -> None:
    app.run("python", "print('x' * 400)")  # a long line must wrap or scroll inside #output
    size = app.d.get_window_size()
    try:
        app.d.set_window_size(400, 900)
        app.wait(lambda: app.js("return window.innerWidth") <= 400, "the narrow window")
        time.sleep(0.3)
        scroll_width, inner_width = app.js(
            "return [document.documentElement.scrollWidth, window.innerWidth]"
        )
        run = app.el("#run")
        rect = app.js(
            "const r = arguments[0].getBoundingClientRect(); return [r.left, r.right]", run
        )
        shot()
        assert scroll_width <= inner_width + 1, (
            f"horizontal scroll at 400px: scrollWidth {scroll_width} > innerWidth {inner_width}"
        )
        assert run.is_displayed(), "#run hidden in a narrow window"
        assert rect[0] >= 0 and rect[1] <= inner_width + 1, f"#run off screen: {rect}"
    finally:
        app.d.set_window_size(size["width"], size["height"])


ACCESSIBLE_NAMES_JS = r"""
const named = (text) => /[\p{L}\p{N}]/u.test(text || '');
const bad = [];
const controls = document.querySelectorAll(
  'input:not([type=hidden]), select, textarea, button, a[href], [role=button],' +
  ' [tabindex]:not([tabindex="-1"])');
for (const el of controls) {
  const names = [];
  names.push(el.getAttribute('aria-label'));
  for (const id of (el.getAttribute('aria-labelledby') || '').split(/\s+/).filter(Boolean)) {
    const ref = document.getElementById(id);
    if (ref) names.push(ref.textContent);
  }
  if (el.id) {
    for (const label of document.querySelectorAll('label[for="' + CSS.escape(el.id) + '"]'))
      names.push(label.textContent);
  }
  const wrapping = el.closest('label');
  if (wrapping) names.push(wrapping.textContent);
  if (!el.matches('input, select, textarea')) names.push(el.textContent);
  if (el.matches('input[type=submit], input[type=button], input[type=reset]'))
    names.push(el.value);
  names.push(el.getAttribute('title'));
  if (!names.some(named)) {
    bad.push(el.outerHTML.slice(0, 160));
  }
}
return [controls.length, bad];
"""


def test_every_control_has_an_accessible_name(app: Console, shot: ShotTaker) -> None:
    # Run after the other tests: the executions and files lists have their own buttons now.
    count, unnamed = app.js(ACCESSIBLE_NAMES_JS)
    assert count >= 10, f"only {count} controls found"
    assert not unnamed, "controls without an accessible name:\n" + "\n".join(unnamed)
    shot()


# -- the whole session -------------------------------------------------------------------------


def test_no_request_url_carries_the_token(app: Console, shot: ShotTaker) -> None:
    """Last: over every browser of the module (the signed-in one made all the calls above)."""
    for b in BROWSERS:
        assert_no_token_in_urls(b, TOKEN, WRONG_TOKEN)
    hrefs = app.js(
        "return Array.from(document.querySelectorAll('[href], [src]'))"
        ".map(e => e.getAttribute('href') || e.getAttribute('src'))"
    )
    assert not [h for h in hrefs if TOKEN in h], "a link on the page carries the token"
    shot()


def test_every_request_goes_to_the_server(app: Console, browser: Browser, shot: ShotTaker) -> None:
    requests = browser.requests()
    assert any(m == "POST" and u.startswith(app.base_url + "/mcp") for m, u in requests), (
        "the console made no POST to /mcp"
    )
    foreign = [
        u for _, u in requests if not u.startswith((app.base_url + "/", "data:", "blob:", "about:"))
    ]
    assert not foreign, f"requests to elsewhere: {foreign[:10]}"
    shot()


def test_no_uncaught_errors_in_the_console_scripts(
    app: Console, browser: Browser, shot: ShotTaker
) -> None:
    browser.drain_logs()
    uncaught = [
        e["message"]
        for e in browser.console_log
        if e.get("level") == "SEVERE" and "Uncaught" in e.get("message", "")
    ]
    assert not uncaught, "uncaught errors in the page:\n" + "\n".join(uncaught)
    shot()
