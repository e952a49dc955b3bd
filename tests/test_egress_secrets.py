"""Secrets at the egress proxy, end to end: a real server, real sandboxes, the netlab's HTTPS
origin (its own CA) recording every request's headers.

Code in the sandbox holds no key: it calls the bound host through requests, httpx, curl,
Node's fetch (undici) and pip (a private index that wants Basic auth), and the origin sees the
real key. The key is nowhere the sandbox can look, in no response (echoes are masked), in no
log, event, metric or `secrets list`. Unbound hosts, redirects and a wrong certificate keep
it from anyone else; two principals with the same secret name each send their own.
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from hosted_harness import script_entry, text_of, toml
from mcp_harness import Conn, ServerProcess, Servers, open_client, traversable_by_others
from netlab import NetLab, netlab_fixture

pytestmark = pytest.mark.e2e

TOKEN_A, TOKEN_B = "secrets-alice-token-0123456789", "secrets-bob-token-0123456789"
KEY_A = "sk-alice-" + secrets.token_hex(16)  # the default value of `openai`
KEY_B = "sk-bob-" + secrets.token_hex(16)  # bob's own value of `openai`
PYPI_KEY = "pypi-" + secrets.token_hex(16)
SECRETS_KEY = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
ALL_KEYS = (KEY_A, KEY_B, PYPI_KEY)
PLACEHOLDER = "Bearer {{secret:openai}}"
BASIC = "Basic " + base64.b64encode(f"__token__:{PYPI_KEY}".encode()).decode()
UNDICI = Path(os.environ.get("SRT_CLIENTS_NODE", "/work/main/.clients/node")) / "node_modules"

RULES = """
[[rule]]
name = "openai-api"
secret = "openai"
hosts = ["api.allowed.test", "api.allowed.test:80"]  # (:80: in clear too, by name)
headers = { Authorization = "Bearer {{secret:openai}}" }

[[rule]]
name = "index"
secret = "pypi"
hosts = ["pypi.allowed.test"]
basic = "__token__"

[[rule]]
name = "tls-only"
secret = "openai"
hosts = ["tls.allowed.test:443"]
headers = { X-Api-Key = "{{secret:openai}}" }
methods = ["GET"]

[[rule]]
name = "wrong-cert"
secret = "openai"
hosts = ["wrong.test"]
headers = { X-Api-Key = "{{secret:openai}}" }
"""

lab = netlab_fixture(scope="module", name="lab")
CLIENTS_PYTHON = os.environ.get("SRT_CLIENTS_PY", "/work/main/.clients/py/bin/python")
WHEELS = ("httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi", "typing_extensions")


def wheel_of(dist: str, out: Path) -> Path:
    """A wheel of `dist` as installed in the clients' venv (pure Python, py3-none-any): its
    files and dist-info, byte for byte."""
    probe = (
        "import importlib.metadata as m, json, sys; d = m.distribution(sys.argv[1]); "
        "print(json.dumps([d.metadata['Name'], d.version, str(d.locate_file('')), "
        "[str(f) for f in d.files]]))"
    )
    done = subprocess.run(
        [CLIENTS_PYTHON, "-c", probe, dist], capture_output=True, text=True, timeout=60, check=True
    )
    name, version, site, files = json.loads(done.stdout)
    wheel = out / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in files:
            if (
                file.startswith("..")
                or "__pycache__" in file
                or file.endswith(("INSTALLER", "REQUESTED", "direct_url.json"))
            ):
                continue
            archive.write(Path(site) / file, file)
    return wheel


def _cli(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_runtime.cli", "secrets", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def server(lab: NetLab, tmp_path_factory: pytest.TempPathFactory, serve: Servers) -> ServerProcess:
    origin = [lab.origin_ip]
    bound = ["api.allowed.test", "pypi.allowed.test", "tls.allowed.test"]
    lab.set_dns({name: origin for name in [*bound, "other.test", "wrong.test"]})
    lab.set_auth([f"Bearer {KEY_A}", f"Bearer {KEY_B}", BASIC])
    # The private index: httpx and what it needs, as wheels made from the clients' venv (no
    # index is reached: the files are those installed there, their RECORDs as they are).
    for dist in WHEELS:
        wheel_of(dist, lab.files_dir)
    workdir = tmp_path_factory.mktemp("secrets")
    tmpdir = workdir / "tmp"
    tmpdir.mkdir()
    traversable_by_others(tmpdir)
    rules = workdir / "secrets.toml"
    rules.write_text(RULES)
    # A hosted server whose catalog entry references the store: OPENAI_API_KEY's rule binds a
    # host the entry may reach (the proxy adds it), PYPI_TOKEN's does not (the value).
    entry = script_entry(
        "echoenv.py",
        egress=["api.allowed.test"],
        secrets={"OPENAI_API_KEY": "secret:openai", "PYPI_TOKEN": "secret:pypi"},
    )
    (workdir / "servers.toml").write_text(toml({"echoenv": entry}))  # fmt: skip
    settings = {
        "SANDBOX_STATE_DIR": str(workdir / "state"),
        "SANDBOX_SECRETS_KEY": SECRETS_KEY,
        "SANDBOX_SECRETS_RULES": str(rules),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")} | settings
    env["OPENAI_KEY"] = KEY_A
    assert _cli(env, "set", "openai", "--from-env", "OPENAI_KEY").returncode == 0
    (workdir / "bob.key").write_text(KEY_B + "\n")
    bob_file = str(workdir / "bob.key")
    done_b = _cli(env, "set", "openai", "--principal", "bob", "--from-file", bob_file)
    assert done_b.returncode == 0, done_b.stderr
    assert _cli(env, "set", "pypi", stdin=PYPI_KEY + "\n").returncode == 0
    running = serve(
        workdir=workdir,
        TMPDIR=str(tmpdir),
        SANDBOX_AUTH_TOKENS=f"alice:{TOKEN_A},bob:{TOKEN_B}",
        SANDBOX_EGRESS_ALLOW="*.allowed.test,other.test,wrong.test",
        SANDBOX_EGRESS_ALLOW_CIDRS=str(lab_network(lab)),
        SANDBOX_EGRESS_RESOLVER=lab.resolver,
        SANDBOX_EGRESS_UPSTREAM_CA_FILE=str(lab.ca_path),
        SANDBOX_MAX_WAIT="300",
        SANDBOX_SERVERS_FILE=str(workdir / "servers.toml"),
        **settings,
    )
    running.cli_env = env  # type: ignore[attr-defined]
    return running


def lab_network(lab: NetLab) -> str:
    import ipaddress

    return str(ipaddress.ip_interface(f"{lab.host_ip}/30").network)


def requests_seen(lab: NetLab, host: str) -> list[dict[str, Any]]:
    """The origin's records of requests whose Host was `host` (headers included)."""
    return [r for r in lab.requests() if str(r.get("host", "")).split(":")[0] == host]


async def run(conn: Conn, command: str, seconds: int = 120) -> tuple[int, str, list[Any]]:
    """Run `command` in the session's sandbox: exit code, stdout+stderr, every event."""
    result = await conn.ok("execute_code", command=command, timeout_seconds=seconds)
    shown = json.dumps(result)  # (every event, every response, every proxy error printed)
    assert not any(key in shown for key in ALL_KEYS), "a secret's value in an execution's result"
    text = "".join(e.get("data", "") for e in result["output"] if e["type"] in ("stdout", "stderr"))
    return result["exit_code"], text, result["output"]


async def put(conn: Conn, path: str, text: str) -> None:
    await conn.ok("write_file", path=path, content=text)


CLIENTS_PY = r"""
import json, requests, sys
s = requests.Session()
out = {}
for i in range(3):  # keep-alive: one connection, three requests
    r = s.get("https://api.allowed.test/auth/hello?client=requests&i=%d" % i,
              headers={"Authorization": "Bearer {{secret:openai}}"})
    out["requests_%d" % i] = [r.status_code, r.text]
def body():  # a chunked request body
    for _ in range(4):
        yield b"x" * 10000
r = s.post("https://api.allowed.test/echo?client=requests-chunked", data=body())
out["chunked"] = [r.status_code, r.json()["body_length"], r.json()["headers"].get("authorization")]
r = s.get("https://api.allowed.test/bytes/300000?client=requests-download")
out["download"] = [r.status_code, len(r.content)]
print(json.dumps(out))
"""

NODE_FETCH = r"""
const { EnvHttpProxyAgent, setGlobalDispatcher, fetch } = require("undici");
setGlobalDispatcher(new EnvHttpProxyAgent());
(async () => {
  const r = await fetch("https://api.allowed.test/auth/hello?client=node",
                        { headers: { authorization: "Bearer {{secret:openai}}" } });
  const p = await fetch("https://api.allowed.test/echo?client=node-post",
                        { method: "POST", body: "y".repeat(70000) });
  const echo = await p.json();
  console.log(JSON.stringify({ status: r.status, text: await r.text(),
                               post: [p.status, echo.body_length] }));
})().catch((e) => { console.error("FAILED", e, e.cause); process.exit(1); });
"""

HTTPX_PY = r"""
import httpx
with httpx.Client() as client:
    r = client.get("https://api.allowed.test/auth/hello?client=httpx")
    print("httpx", r.status_code, r.text.strip())
"""


def _undici_archive() -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(UNDICI / "undici", arcname="node_modules/undici")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.timeout(600)
async def test_clients_without_the_key_reach_the_bound_host_with_it(
    server: ServerProcess, lab: NetLab
) -> None:
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        await put(conn, "clients.py", CLIENTS_PY)
        code, text, events = await run(conn, "python clients.py")
        assert code == 0, text
        got = json.loads(text.strip().splitlines()[-1])
        for i in range(3):
            assert got[f"requests_{i}"] == [200, "hello, authorized\n"], got
        assert got["chunked"][:2] == [200, 40000], got
        assert got["chunked"][2] == "Bearer " + "*" * len(KEY_A), got  # (the echo: masked)
        assert got["download"] == [200, 300000], got
        used = [e for e in events if e["type"] == "network_secret"]
        assert used and all(e["name"] == "openai-api" for e in used), events
        assert all(e["host"] == "api.allowed.test" for e in used), used

        code, text, _ = await run(conn, "curl -sS https://api.allowed.test/auth/hello?client=curl")
        assert (code, text) == (0, "hello, authorized\n"), text

        await conn.ok("write_file", path="undici.tgz", content=_undici_archive(), encoding="base64")
        await put(conn, "fetch.js", NODE_FETCH)
        code, text, _ = await run(conn, "tar xzf undici.tgz && node fetch.js")
        assert code == 0, text
        node = json.loads(text.strip().splitlines()[-1])
        assert node == {"status": 200, "text": "hello, authorized\n", "post": [200, 70000]}, node

        # pip, from a private index that wants Basic auth: the proxy adds it.
        code, text, _ = await run(
            conn,
            "python -m pip install -q --user --disable-pip-version-check --no-cache-dir "
            "--index-url https://pypi.allowed.test/auth/simple/ httpx==0.28.1",
            seconds=240,
        )
        assert code == 0, text[-3000:]
        await put(conn, "httpx_call.py", HTTPX_PY)
        code, text, _ = await run(conn, "python httpx_call.py")
        assert (code, text.strip()) == (0, "httpx 200 hello, authorized"), text
    seen = requests_seen(lab, "api.allowed.test")
    clients = {"requests", "curl", "node", "httpx"}
    for client in sorted(clients):
        mine = [r for r in seen if f"client={client}&" in r["target"] or
                r["target"].endswith(f"client={client}")]  # fmt: skip
        assert mine, f"{client}: no request reached the origin: {[r['target'] for r in seen]}"
        assert all(r["headers"].get("authorization") == f"Bearer {KEY_A}" for r in mine), mine
    index = requests_seen(lab, "pypi.allowed.test")
    assert index and all(r["headers"].get("authorization") == BASIC for r in index), index


SCAN = r"""
import os, sys
keys = [bytes.fromhex(k) for k in sys.argv[1:]]  # (hex: no key in any command line)
found = []
def check(path, data):
    for k in keys:
        if k in data:
            found.append(path)
for top in ("/etc", "/tmp", "/workspace", "/run", "/dev/shm", "/home", "/root", "/var"):
    for root, dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    check(path, f.read(64 << 20))
            except OSError:
                pass
check("environ", b"\0".join(f"{k}={v}".encode() for k, v in os.environ.items()))
readable = 0
for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
    for part in ("environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{part}", "rb") as f:
                check(f"/proc/{pid}/{part}", f.read())
        except OSError:
            pass
    try:  # every readable mapping of every process the sandbox can see
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                if "r" not in perms:
                    continue
                start, end = (int(x, 16) for x in span.split("-"))
                if end - start > 256 << 20:
                    continue
                try:
                    mem.seek(start)
                    check(f"/proc/{pid}/mem", mem.read(end - start))
                    readable += 1
                except (OSError, OverflowError, ValueError):
                    pass
    except OSError:
        pass
print("FOUND", found, "mappings read:", readable)
"""


async def test_the_key_is_nowhere_the_sandbox_can_look(server: ServerProcess, lab: NetLab) -> None:
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        await put(conn, "scan.py", SCAN)
        # A request that used the key just before, in the same sandbox, keeps its process alive.
        command = (
            "curl -sS -o /dev/null https://api.allowed.test/auth/hello?client=scan && "
            f"python scan.py {' '.join(k.encode().hex() for k in ALL_KEYS)}"
        )
        code, text, _ = await run(conn, command)
        assert code == 0, text
        assert "FOUND []" in text, text
        assert "mappings read: 0" not in text, text  # (the scan did read process memory)


async def test_unbound_host_and_redirect_get_only_the_placeholder(
    server: ServerProcess, lab: NetLab
) -> None:
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        # other.test is a blind tunnel: curl checks the lab's certificate with the lab's CA.
        await put(conn, "lab-ca.pem", lab.ca_path.read_text())
        trust = "cat /etc/ssl/certs/ca-certificates.crt lab-ca.pem > both.pem && "
        code, text, _ = await run(
            conn,
            trust + f"curl -sS --cacert both.pem -H 'Authorization: {PLACEHOLDER}' "
            "https://other.test/echo?case=unbound",
        )
        assert code == 0, text
        assert json.loads(text)["headers"]["authorization"] == PLACEHOLDER
        # curl --location-trusted sends Authorization on to any host a redirect names.
        code, text, _ = await run(
            conn,
            f"curl -sS --cacert both.pem -L --location-trusted -H 'Authorization: {PLACEHOLDER}' "
            "'https://api.allowed.test/redirect?to=https://other.test/echo?case=redirected'",
        )
        assert code == 0, text
        assert json.loads(text)["headers"]["authorization"] == PLACEHOLDER, text
    others = requests_seen(lab, "other.test")
    assert {r["target"] for r in others} >= {"/echo?case=unbound", "/echo?case=redirected"}
    assert all(KEY_A not in json.dumps(r) for r in others), others
    first = [r for r in requests_seen(lab, "api.allowed.test") if "redirect" in r["target"]]
    assert first and first[-1]["headers"]["authorization"] == f"Bearer {KEY_A}"


async def test_echoes_are_masked_and_plain_http_gets_the_key_too(
    server: ServerProcess, lab: NetLab
) -> None:
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        code, text, _ = await run(
            conn,
            "curl -sS https://api.allowed.test/echo?case=echo; echo; "
            "curl -sS http://api.allowed.test/echo?case=plain",
        )
        assert code == 0, text
        https_echo, plain_echo = (json.loads(line) for line in text.strip().splitlines())
    masked = "Bearer " + "*" * len(KEY_A)
    assert https_echo["headers"]["authorization"] == masked, https_echo
    assert plain_echo["headers"]["authorization"] == masked, plain_echo
    assert KEY_A not in text
    seen = {r["target"]: r for r in requests_seen(lab, "api.allowed.test")}
    assert seen["/echo?case=echo"]["headers"]["authorization"] == f"Bearer {KEY_A}"
    assert seen["/echo?case=plain"]["headers"]["authorization"] == f"Bearer {KEY_A}"


async def test_a_wrong_upstream_certificate_fails_closed(
    server: ServerProcess, lab: NetLab
) -> None:
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        _, text, events = await run(
            conn, "curl -sS -D - https://wrong.test/echo?case=wrong; echo exit=$?"
        )
    assert "502" in text and "upstream_certificate" in text, text
    denied = [e for e in events if e["type"] == "network_denied"]
    assert [e["reason"] for e in denied] == ["upstream_certificate"], events
    assert not requests_seen(lab, "wrong.test")  # (no request went: TLS failed first)


async def test_two_principals_send_their_own_values(server: ServerProcess, lab: NetLab) -> None:
    for token in (TOKEN_A, TOKEN_B):
        async with open_client(server.url, token, "legacy") as conn:
            who = "alice" if token == TOKEN_A else "bob"
            code, text, _ = await run(
                conn, f"curl -sS https://api.allowed.test/auth/hello?principal={who}"
            )
            assert (code, text) == (0, "hello, authorized\n"), text
    seen = {r["target"]: r for r in requests_seen(lab, "api.allowed.test")}
    alice = seen["/auth/hello?principal=alice"]["headers"]["authorization"]
    bob = seen["/auth/hello?principal=bob"]["headers"]["authorization"]
    assert (alice, bob) == (f"Bearer {KEY_A}", f"Bearer {KEY_B}")


async def test_a_caller_may_narrow_the_rules_never_widen(
    server: ServerProcess, lab: NetLab
) -> None:
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        # Without its rule the host is a blind tunnel (-k: the lab's CA is not the sandbox's).
        result = await conn.ok(
            "execute_code",
            command="curl -sSk -o /dev/null -w '%{http_code}' "
            "https://api.allowed.test/auth/hello?case=narrowed",
            sandbox_config={"secrets": ["index"]},
        )
        text = "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")
        assert text == "401", result
        refused = await conn.call(
            "execute_code", command="true", sandbox_config={"secrets": ["github"]}
        )
        assert refused.is_error


async def test_a_hosted_server_gets_the_placeholder_where_the_proxy_adds_the_key(
    server: ServerProcess,
) -> None:
    async with open_client(f"{server.base_url}/servers/echoenv/mcp", TOKEN_B) as conn:
        result = await conn.client.call_tool("env", {})
    env = json.loads(text_of(result))
    assert env["OPENAI_API_KEY"] == "{{secret:openai}}"
    assert env["PYPI_TOKEN"] == PYPI_KEY
    assert KEY_A not in json.dumps(env) and KEY_B not in json.dumps(env)


def test_no_value_in_list_logs_metrics_or_store(server: ServerProcess) -> None:
    env = server.cli_env  # type: ignore[attr-defined]
    listed = _cli(env, "list")
    assert listed.returncode == 0, listed.stderr
    assert "openai" in listed.stdout and "api.allowed.test" in listed.stdout, listed.stdout
    assert "principal=bob" in listed.stdout
    metrics = server.metric(TOKEN_A, "srt_egress_secret_uses_total", 'rule="openai-api"')
    assert metrics > 0
    deadline = time.monotonic() + 10
    while "secret used: rule=openai-api" not in server.stderr_path.read_text():
        assert time.monotonic() < deadline, "no audit line"
        time.sleep(0.2)
    import httpx2

    metrics_text = httpx2.get(
        f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {TOKEN_A}"}
    ).text
    store = (server.workdir / "state" / "secrets.store.json").read_text()
    log = server.stderr_path.read_text()
    for key in ALL_KEYS:
        for where, text in (("list", listed.stdout + listed.stderr), ("metrics", metrics_text),
                            ("store", store), ("log", log)):  # fmt: skip
            assert key not in text, f"a secret's value in the {where}"
    audit = [line for line in log.splitlines() if "secret used:" in line]
    assert any("principal=alice" in line and "host=api.allowed.test:443" in line for line in audit)
    assert any("principal=bob" in line for line in audit)
    ca_key = server.workdir / "state" / "egress-ca" / "ca.key"
    assert ca_key.stat().st_mode & 0o777 == 0o600


async def test_run_code_kernels_get_the_principals_rules(
    server: ServerProcess, lab: NetLab
) -> None:
    code = (
        "import os, requests\n"
        "r = requests.get('https://api.allowed.test/auth/hello?client=kernel')\n"
        "print(r.status_code, r.text.strip(), 'SSL_CERT_FILE' in os.environ)\n"
    )
    async with open_client(server.url, TOKEN_B, "legacy") as conn:
        result = await conn.ok("run_code", language="python", code=code)
    printed = "".join(e.get("data", "") for e in result["output"] if e["type"] == "stdout")
    assert printed.strip() == "200 hello, authorized True", result
    assert KEY_B not in json.dumps(result)
    seen = [r for r in requests_seen(lab, "api.allowed.test") if "client=kernel" in r["target"]]
    assert seen and seen[-1]["headers"]["authorization"] == f"Bearer {KEY_B}"


HANGUP = r"""
import time, requests
s = requests.Session()
print(s.get("https://api.allowed.test/hangup").text.strip())
time.sleep(1)  # (the origin's close reaches the proxy)
r = s.get("https://api.allowed.test/auth/hello?client=after-hangup")
print(r.status_code, r.text.strip())
"""


async def test_an_origin_that_closes_a_kept_alive_connection_is_dialled_again(
    server: ServerProcess, lab: NetLab
) -> None:
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        await put(conn, "hangup.py", HANGUP)
        code, text, _ = await run(conn, "python hangup.py")
    assert (code, text.split()) == (0, ["bye", "200", "hello,", "authorized"]), text


RAW_PY = r"""
import json, os, socket, ssl, sys
def exchange(request):
    raw = socket.create_connection(("127.0.0.1", 3128))
    raw.sendall(b"CONNECT api.allowed.test:443 HTTP/1.1\r\nHost: api.allowed.test:443\r\n\r\n")
    assert raw.recv(4096).startswith(b"HTTP/1.1 200"), "CONNECT refused"
    tls = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    conn = tls.wrap_socket(raw, server_hostname="api.allowed.test")
    conn.sendall(request)
    data = b""
    while True:
        try:
            piece = conn.recv(65536)
        except (ssl.SSLError, OSError):
            break
        if not piece:
            break
        data += piece
    return data.split(b"\r\n", 1)[0].decode()
print(json.dumps([exchange(bytes.fromhex(h)) for h in sys.argv[1:]]))
"""

# Request lines whose target has bytes a request-target never has: a lenient origin (one
# that ends lines at a bare LF and splits on any whitespace, as Python's http.server does)
# reads `Host: other.test` from the first, before the Host the proxy pins; the audit log
# line (it quotes the path) would get a forged line of its own.
SMUGGLED = (
    b"GET /echo?case=lf\tHTTP/1.1\nHost:\tother.test\nX:\tx HTTP/1.1\r\n"
    b"Host: api.allowed.test\r\nConnection: close\r\n\r\n",
    b"GET /echo?case=cr\rsecret HTTP/1.1\r\nHost: api.allowed.test\r\nConnection: close\r\n\r\n",
    b"GET /echo?case=nul\x00 HTTP/1.1\r\nHost: api.allowed.test\r\nConnection: close\r\n\r\n",
    b"G\xc3\x89T /echo?case=method HTTP/1.1\r\nHost: api.allowed.test\r\nConnection: close\r\n\r\n",
)


async def test_a_request_target_with_control_bytes_is_refused(
    server: ServerProcess, lab: NetLab
) -> None:
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        await put(conn, "raw.py", RAW_PY)
        code, text, events = await run(conn, "python raw.py " + " ".join(r.hex() for r in SMUGGLED))
    assert code == 0, text
    assert json.loads(text) == ["HTTP/1.1 400 Bad Request"] * len(SMUGGLED), text
    assert not any(
        "case=" in r["target"]
        for r in requests_seen(lab, "api.allowed.test")
        if any(c in r["target"] for c in "\t\n\r\x00") or "case=method" in r["target"]
    )
    assert [e["reason"] for e in events if e["type"] == "network_denied"] == ["bad_request"] * 4


async def test_plain_http_gets_a_secret_only_where_a_rule_names_the_port(
    server: ServerProcess, lab: NetLab
) -> None:
    # The docs' promise: a rule that names :443 keeps its key off plain HTTP. A plain request
    # to port 443 (`http://host:443/`) would carry it in clear to whatever answers there.
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        _, _, plain = await run(
            conn,
            "curl -sS -m 20 http://tls.allowed.test:443/echo?case=plain443; "
            "curl -sS -m 20 http://api.allowed.test:443/echo?case=plain443; "
            # (a host named without a port gets its key over TLS only)
            "curl -sS -m 20 http://pypi.allowed.test/echo?case=plain80",
        )
        code, text, tls = await run(conn, "curl -sS https://tls.allowed.test/echo?case=tls443")
    assert not [e for e in plain if e["type"] == "network_secret"], plain
    assert code == 0 and json.loads(text)["headers"]["x-api-key"] == "*" * len(KEY_A), text
    assert [e["name"] for e in tls if e["type"] == "network_secret"] == ["tls-only"], tls
    seen = {r["target"]: r for r in requests_seen(lab, "tls.allowed.test")}
    assert seen["/echo?case=tls443"]["headers"]["x-api-key"] == KEY_A


async def test_a_refused_narrowing_leaves_no_socket_directory(server: ServerProcess) -> None:
    (egress,) = (server.workdir / "tmp").glob("srt-*/egress")
    before = sorted(p.name for p in egress.iterdir())
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        for _ in range(5):
            refused = await conn.call(
                "execute_code", command="true", sandbox_config={"secrets": ["github"]}
            )
            assert refused.is_error
            assert "not among the secret rules" in json.dumps(refused.model_dump()), refused
    assert sorted(p.name for p in egress.iterdir()) == before


async def test_a_rule_for_some_methods_takes_method_overrides_away(
    server: ServerProcess, lab: NetLab
) -> None:
    # tls-only is for GET: a GET that an origin would take for a DELETE (the override headers
    # many frameworks honour) must not carry its key there.
    overrides = ("X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override")
    headers = " ".join(f"-H '{name}: DELETE'" for name in overrides)
    async with open_client(server.url, TOKEN_A, "legacy") as conn:
        code, text, _ = await run(
            conn, f"curl -sS {headers} https://tls.allowed.test/echo?case=override"
        )
    assert code == 0, text
    seen = {r["target"]: r for r in requests_seen(lab, "tls.allowed.test")}
    got = seen["/echo?case=override"]["headers"]
    assert got["x-api-key"] == KEY_A
    assert not {name.lower() for name in overrides} & set(got), got
