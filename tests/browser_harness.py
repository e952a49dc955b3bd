"""A real headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium, for
the web console's tests: a browser with its own profile and download directory that records
every request URL the page made, and a page object for the console's DOM contract."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    NoSuchElementException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

# No network but the server's: the closed sandbox has no internet, and Chromium's background
# services would otherwise keep trying to reach it.
CHROME_ARGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-features=Translate,OptimizationHints,MediaRouter,DialMediaRouteProvider",
    "--window-size=1280,860",
)

WAIT = 15.0  # seconds: generous, the first run_code of a session may take a second or two
INTERNAL_SCHEMES = ("chrome://", "chrome-untrusted://", "devtools://")
TERMINAL = ("completed", "failed", "cancelled", "timeout")

T = TypeVar("T")


def browser_available() -> str | None:
    """Why a browser cannot run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


def _urls_in(value: Any, out: list[str]) -> None:
    """Every string under a key naming a URL, anywhere in a DevTools event's params."""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, str) and key in ("url", "documentURL", "requestURL"):
                out.append(item)
            else:
                _urls_in(item, out)
    elif isinstance(value, list):
        for item in value:
            _urls_in(item, out)


@dataclass
class Browser:
    """One headless Chromium with a fresh profile; keeps its performance (network) log and
    console log across reads (chromedriver hands each entry out once)."""

    driver: webdriver.Chrome
    profile_dir: Path
    download_dir: Path
    perf: list[dict[str, Any]] = field(default_factory=list)
    console_log: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False
    last_url: str = ""

    def drain_logs(self) -> None:
        if self.closed:
            return  # what it logged was read when it closed
        with contextlib.suppress(WebDriverException):
            for entry in self.driver.get_log("performance"):
                with contextlib.suppress(ValueError, KeyError):
                    self.perf.append(json.loads(entry["message"])["message"])
        with contextlib.suppress(WebDriverException):
            self.console_log.extend(self.driver.get_log("browser"))

    def request_urls(self) -> list[str]:
        """Every URL the browser requested or navigated to (and saw a response from), plus
        WebSocket and EventSource URLs, in order; the address bar's last."""
        self.drain_logs()
        urls: list[str] = []
        for message in self.perf:
            method = message.get("method", "")
            if method.startswith(("Network.", "Page.")):
                _urls_in(message.get("params", {}), urls)
        urls.append(self.last_url if self.closed else self.driver.current_url)
        return urls

    def requests(self) -> list[tuple[str, str]]:
        """(method, URL) of every request a page sent (not the browser's own chrome:// pages,
        such as the new-tab page it starts with)."""
        self.drain_logs()
        return [
            (m["params"]["request"]["method"], m["params"]["request"]["url"])
            for m in self.perf
            if m.get("method") == "Network.requestWillBeSent"
            and not m["params"]["request"]["url"].startswith(INTERNAL_SCHEMES)
        ]

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        return path

    def downloaded(self, timeout: float = WAIT, min_size: int = 0) -> Path:
        """The first finished file in the download directory (waits for it)."""

        def done() -> Path | None:
            files = [p for p in self.download_dir.iterdir() if p.is_file()]
            if any(p.suffix == ".crdownload" for p in files):
                return None
            for p in files:
                if p.stat().st_size >= min_size:
                    return p
            return None

        return wait_for(done, timeout, f"a download in {self.download_dir}")

    def close(self) -> None:
        self.drain_logs()
        with contextlib.suppress(WebDriverException):
            self.last_url = self.driver.current_url
        self.closed = True
        with contextlib.suppress(WebDriverException):
            self.driver.quit()
        shutil.rmtree(self.profile_dir, ignore_errors=True)


@contextlib.contextmanager
def open_browser(workdir: Path) -> Iterator[Browser]:
    """A headless Chromium with a fresh profile under `workdir` (never selenium-manager: the
    driver's path is given), downloads allowed into `workdir`/downloads."""
    workdir.mkdir(parents=True, exist_ok=True)
    profile = Path(tempfile.mkdtemp(prefix="profile-", dir=workdir))
    downloads = workdir / "downloads"
    downloads.mkdir(exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in CHROME_ARGS:
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_experimental_option(
        "prefs",
        {
            "download.default_directory": str(downloads),
            "download.prompt_for_download": False,
            "download.directory_upgrade": True,
            "safebrowsing.enabled": False,
        },
    )
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    # Headless Chromium drops downloads unless told where they go.
    driver.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
    )
    browser = Browser(driver, profile, downloads)
    try:
        yield browser
    finally:
        browser.close()


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float = WAIT,
    what: str = "a condition",
    describe: Callable[[], str] | None = None,
    interval: float = 0.05,
) -> T:
    """Poll `predicate` until it returns something truthy (stale or missing elements count as
    not yet); fail at the deadline with `what` and `describe()`."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
        except (NoSuchElementException, StaleElementReferenceException) as exc:
            value, last_exc = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            detail = describe() if describe else ""
            cause = f"\n(last: {type(last_exc).__name__}: {last_exc.msg})" if last_exc else ""
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what}{cause}\n{detail}"
            )
        time.sleep(interval)


# -- the console's DOM ------------------------------------------------------------------------


@dataclass
class Console:
    """The web console at `base_url`, as its DOM contract describes it."""

    browser: Browser
    base_url: str

    @property
    def d(self) -> webdriver.Chrome:
        return self.browser.driver

    def el(self, css: str) -> WebElement:
        return self.d.find_element(By.CSS_SELECTOR, css)

    def els(self, css: str) -> list[WebElement]:
        return self.d.find_elements(By.CSS_SELECTOR, css)

    def js(self, script: str, *args: Any) -> Any:
        return self.d.execute_script(script, *args)

    def displayed(self, css: str) -> bool:
        found = self.els(css)
        return bool(found) and found[0].is_displayed()

    def describe(self) -> str:
        """What the page shows now, for failure messages."""
        try:
            state = self.js(
                "const q = s => document.querySelector(s);"
                "const cut = (e, n) => e ? e.outerHTML.slice(0, n) : '(missing)';"
                "return {url: location.href, title: document.title,"
                " signin_error: q('#signin-error') ? q('#signin-error').textContent : null,"
                " output: cut(q('#output'), 3000), executions: cut(q('#executions'), 1500),"
                " files: cut(q('#files'), 1500)};"
            )
        except WebDriverException as exc:
            return f"(page not readable: {exc.msg})"
        self.browser.drain_logs()
        errors = [e["message"] for e in self.browser.console_log if e.get("level") in ("SEVERE",)][
            -8:
        ]
        lines = [f"{k}: {v}" for k, v in state.items()]
        lines.append("browser console errors: " + json.dumps(errors, indent=1))
        return "\n".join(lines)

    def wait(self, predicate: Callable[[], T | None], what: str, timeout: float = WAIT) -> T:
        return wait_for(predicate, timeout, what, self.describe)

    # -- sign-in --

    def open(self) -> None:
        self.d.get(self.base_url + "/")
        self.wait(lambda: self.displayed("#signin") or self.displayed("#app"), "the console")

    def forget(self) -> None:
        """Back to a signed-out page (clears what the console may have stored)."""
        self.d.get(self.base_url + "/")
        self.js("try { sessionStorage.clear(); localStorage.clear(); } catch (e) {}")
        self.d.delete_all_cookies()
        self.open()

    def sign_in(self, token: str, session: str | None = None) -> None:
        self.wait(lambda: self.displayed("#signin"), "the sign-in form #signin")
        self.el("#token").clear()
        self.el("#token").send_keys(token)
        if session is not None:
            self.el("#session").clear()
            self.el("#session").send_keys(session)
        self.el("#signin-button").click()

    def wait_signed_in(self) -> None:
        self.wait(
            lambda: self.displayed("#app") and not self.displayed("#signin"),
            "#app visible and #signin hidden after signing in",
        )

    # -- running --

    def execution_ids(self) -> list[str]:
        # One script, not element by element: the list re-renders while it is read.
        ids: list[str] = self.js(
            "return Array.from(document.querySelectorAll('#executions li[data-execution-id]'))"
            ".map(li => li.getAttribute('data-execution-id') || '');"
        )
        return ids

    def execution(self, execution_id: str) -> WebElement:
        return self.el(f'#executions li[data-execution-id="{execution_id}"]')

    def execution_status(self, execution_id: str) -> str | None:
        status: str | None = self.js(
            "const li = Array.from(document.querySelectorAll('#executions li'))"
            ".find(e => e.getAttribute('data-execution-id') === arguments[0]);"
            "return li ? li.getAttribute('data-status') : null;",
            execution_id,
        )
        return status

    def execution_text(self, execution_id: str) -> str:
        """The visible text of an execution's row."""
        text: str = self.js(
            "const li = Array.from(document.querySelectorAll('#executions li'))"
            ".find(e => e.getAttribute('data-execution-id') === arguments[0]);"
            "return li ? li.innerText : '';",
            execution_id,
        )
        return text

    def click(self, find: Callable[[], WebElement | None], what: str) -> None:
        """Click what `find()` finds, finding it again if the page re-rendered it meanwhile."""

        def attempt() -> bool:
            element = find()
            if element is None:
                return False
            try:
                element.click()
            except StaleElementReferenceException:
                return False
            return True

        self.wait(attempt, f"to click {what}")

    def set_code(self, language: str, code: str) -> None:
        Select(self.el("#language")).select_by_value(language)
        # The value is set, not typed: an editor's auto-indent must not reshape Python.
        self.js(
            "const t = arguments[0]; t.value = arguments[1];"
            "t.dispatchEvent(new Event('input', {bubbles: true}));"
            "t.dispatchEvent(new Event('change', {bubbles: true}));",
            self.el("#code"),
            code,
        )

    def start(self, language: str, code: str) -> str:
        """Run `code` with the #run button; returns the new execution's id (its `li`)."""
        before = set(self.execution_ids())
        self.set_code(language, code)
        self.el("#run").click()
        return self.new_execution(before)

    def new_execution(self, before: set[str]) -> str:
        def new() -> str | None:
            fresh = [i for i in self.execution_ids() if i and i not in before]
            return fresh[0] if fresh else None

        return self.wait(new, "a new li[data-execution-id] in #executions after #run")

    def wait_done(self, execution_id: str, timeout: float = WAIT) -> str:
        """Wait until `execution_id` ended (its li's data-status) and #output is "done" with
        an exit line; returns the exit line's text."""
        self.wait(
            lambda: self.execution_status(execution_id) in TERMINAL,
            f"execution {execution_id} to end (li data-status terminal)",
            timeout,
        )
        self.wait(
            lambda: (
                self.el("#output").get_attribute("data-state") == "done"
                and self.els("#output .out-exit")
            ),
            '#output[data-state="done"] with an .out-exit line',
            timeout,
        )
        return self.text("#output .out-exit")

    def run(self, language: str, code: str, timeout: float = WAIT) -> tuple[str, str]:
        """Run `code` to its end: (execution id, exit line text)."""
        execution_id = self.start(language, code)
        return execution_id, self.wait_done(execution_id, timeout)

    def text(self, css: str) -> str:
        """The concatenated textContent of every element matching `css` (hidden ones too)."""
        joined: str = self.js(
            "return Array.from(document.querySelectorAll(arguments[0]))"
            ".map(e => e.textContent).join('');",
            css,
        )
        return joined

    def stdout(self) -> str:
        return self.text("#output .out-stdout")

    def output_state(self) -> str | None:
        return self.el("#output").get_attribute("data-state")

    def cancel_running(self) -> None:
        """Leave nothing running for the next test (best effort)."""
        with contextlib.suppress(WebDriverException):
            if self.output_state() == "running" and self.el("#cancel").is_enabled():
                self.el("#cancel").click()
                wait_for(lambda: self.output_state() != "running", WAIT, "the cancel")

    # -- files --

    def file_row(self, name: str) -> WebElement | None:
        """The `#files` row of `name` (data-path is the name or ends in /name)."""
        row: WebElement | None = self.js(
            "return Array.from(document.querySelectorAll('#files li[data-path]')).find(li => {"
            "  const p = li.getAttribute('data-path');"
            "  return p === arguments[0] || p.endsWith('/' + arguments[0]);"
            "}) || null;",
            name,
        )
        return row

    def accept_confirm(self, timeout: float = 2.0) -> bool:
        """Accept a confirm() if one opens within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.d.switch_to.alert.accept()
                return True
            except NoAlertPresentException:
                time.sleep(0.05)
        return False
