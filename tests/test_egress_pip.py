"""The showcase of egress: a real `pip install --user` through the proxy, imported by the next
`run_code` of the same session.

Nothing here names a package index: the index is this machine's pip configuration, read at
run time (PIP_INDEX_URL, `pip config`, else pip's own default), and the hosts its files come
from are read off the index's page. Where those names resolve to addresses the policy refuses
by default (a mirror on a private or reserved range), they are allowed as exact addresses,
as an operator with such a mirror would. When the index cannot be reached from this machine
the test is skipped, saying so.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mcp_harness import ServerProcess, Servers, client_in_task

from sandbox_runtime.domain.egress import vet_address

TOKEN = "egress-pip-token-0123456789"
# Small pure-Python packages; the first one the runtime lacks is installed.
CANDIDATES = ("tomli-w", "toolz", "more-itertools", "six")


def _pip_config() -> dict[str, str]:
    """This machine's pip configuration (`pip config list`: key -> value)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    config: dict[str, str] = {}
    for line in done.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    return config


def _index_url(config: dict[str, str]) -> str:
    url = os.environ.get("PIP_INDEX_URL") or config.get("index-url")
    if url:
        return url.rstrip("/") + "/"
    from pip._internal.models.index import PyPI  # pip's own default, as pip would use it

    return str(PyPI.simple_url).rstrip("/") + "/"


def _runtime_lacks(package: str) -> bool:
    runtime = Path(os.environ.get("SRT_TEST_RUNTIME_DIR", "")) / "bin" / "python"
    module = package.replace("-", "_")
    done = subprocess.run(
        [str(runtime), "-c", f"import {module}"], capture_output=True, check=False, timeout=60
    )
    return done.returncode != 0


@pytest.fixture(scope="module")
def index() -> dict[str, object]:
    """What the server must allow for pip: the index's and its files' hosts (and, for names
    that resolve to refused ranges, their exact addresses)."""
    config = _pip_config()
    url = _index_url(config)
    package = next((p for p in CANDIDATES if _runtime_lacks(p)), None)
    assert package is not None, f"the runtime already has every one of {CANDIDATES}"
    context = ssl.create_default_context(cafile=config.get("cert") or None)
    try:
        with urllib.request.urlopen(f"{url}{package}/", timeout=20, context=context) as reply:
            page = reply.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        pytest.skip(f"pip's index {url} is unreachable from this machine ({exc})")
    links = re.findall(r'href="([^"]+)"', page)
    hosts = {urllib.parse.urlsplit(url)[1]}
    hosts |= {
        urllib.parse.urlsplit(urllib.parse.urljoin(url, link))[1]
        for link in links
        if urllib.parse.urlsplit(urllib.parse.urljoin(url, link))[0] in ("http", "https")
    }
    cidrs: set[str] = set()
    for host in hosts:
        name = urllib.parse.urlsplit(f"//{host}").hostname or host
        for info in socket.getaddrinfo(name, 443, type=socket.SOCK_STREAM):
            address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            if vet_address(address) is not None:
                cidrs.add(f"{address}/{address.max_prefixlen}")
    return {
        "url": url,
        "package": package,
        "hosts": sorted(hosts),
        "cidrs": sorted(cidrs),
        "cert": config.get("cert", ""),
    }


@pytest.fixture(scope="module")
def server(serve: Servers, index: dict[str, object]) -> ServerProcess:
    return serve(
        "egress-pip",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_EGRESS_ALLOW=",".join(index["hosts"]),  # type: ignore[arg-type]
        SANDBOX_EGRESS_ALLOW_CIDRS=",".join(index["cidrs"]),  # type: ignore[arg-type]
        SANDBOX_INTERPRETER_WARM="python=0",
        SANDBOX_MAX_WAIT="300",  # (pip may take a while: one waiting call sees it end)
    )


async def test_pip_install_user_then_import_in_next_run_code(
    server: ServerProcess, index: dict[str, object]
) -> None:
    package = str(index["package"])
    module = package.replace("-", "_")
    env = {"PIP_INDEX_URL": str(index["url"]), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cert = str(index["cert"])
    if cert:
        assert cert.startswith("/etc/ssl/certs/"), f"pip's cert {cert} is not seen in sandboxes"
        env["PIP_CERT"] = cert
    async with client_in_task(server.url, TOKEN, "auto") as conn:
        # The interpreter starts before the package exists: the import must still find it.
        first = await conn.ok("run_code", language="python", code="import sys; print(sys.path)")
        assert first["status"] == "completed", first
        installed = await conn.ok(
            "execute_code",
            command=f"python -m pip install --user --no-cache-dir {package}",
            environment=env,
            timeout_seconds=240,
        )
        output = "".join(e.get("data", "") for e in installed["output"])
        denied = [e for e in installed["output"] if e["type"] == "network_denied"]
        assert installed["exit_code"] == 0, f"pip install failed ({denied}):\n{output[-3000:]}"
        assert "Successfully installed" in output, output[-2000:]
        used = await conn.ok(
            "run_code",
            language="python",
            code=f"import {module}; print({module}.__file__)",
        )
        printed = "".join(e.get("data", "") for e in used["output"] if e["type"] == "stdout")
        assert used["status"] == "completed", used
        assert printed.startswith("/workspace/.local/lib/python"), str(used)[:3000]
