"""Sandboxes on an environment (DESIGN §21, the using half): the environment's root bound
read-only in place of the host's /usr, every layer of the sandbox the same, and nothing a
hostile tree carries (setuid files, device nodes, links out) giving anything.

The environments here are small trees built by the test from the host's static busybox,
laid out as the store keeps roots (a directory per root)."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import started_backend
from environments_harness import build_all, environments_dir
from hosted_harness import catalog_server, message_of, script_entry, text_of
from mcp.types import ImageContent
from mcp_harness import (
    ServerProcess,
    Servers,
    eventually,
    open_client,
    replica_process,
    run_server_once,
    running_server,
)
from netlab import NetLab, netlab_fixture
from redis_harness import RedisServer

from sandbox_runtime.environments.build import image_digest
from sandbox_runtime.environments.digest import summarize
from sandbox_runtime.environments.sharing import push
from sandbox_runtime.environments.store import Environment, EnvironmentStore
from sandbox_runtime.errors import SandboxUnavailableError
from sandbox_runtime.sandbox import BubblewrapBackend, SandboxSpec
from sandbox_runtime.sandbox.spec import ImageRoot, shell_argv
from sandbox_runtime.snapshots.stores import open_store

BUSYBOX = "/usr/bin/busybox"  # static: runs on any root
TOOLS = ("sh", "id", "cat", "ls", "test", "echo", "grep", "whoami", "unshare", "env", "pwd",
         "wc", "stat", "touch", "wget", "ps")  # fmt: skip


def tiny_environment(base: Path, name: str, hostile: bool = False) -> ImageRoot:
    """A merged-usr root with busybox as its tools, its own /etc/os-release, ENV and USER;
    `hostile`: a setuid-root copy of busybox, a /dev/mem-like device node, links to the
    host's /etc/shadow and to / itself, and a top-level /etc that is a link to the host's."""
    root = base / name
    (root / "usr" / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "usr" / "bin" / "busybox")
    for tool in TOOLS:
        (root / "usr" / "bin" / tool).symlink_to("busybox")
    (root / "bin").symlink_to("usr/bin")
    (root / "opt" / "tool").mkdir(parents=True)
    (root / "opt" / "tool" / "VERSION").write_text("tool 1.0\n")
    if hostile:
        share = root / "usr" / "share"
        share.mkdir()
        (share / "suid").mkdir()
        setuid = share / "suid" / "busybox"  # (busybox runs the applet named by argv[1])
        shutil.copy2(BUSYBOX, setuid)
        os.chown(setuid, 0, 0)
        os.chmod(setuid, 0o4755 | stat.S_ISGID)
        os.mknod(share / "mem", 0o666 | stat.S_IFCHR, os.makedev(1, 1))
        os.chmod(share / "mem", 0o666)
        (share / "shadow").symlink_to("/etc/shadow")
        (share / "everything").symlink_to("/")
        (root / "etc").symlink_to("/etc")  # the host's, were it followed on the host
        (root / "var").symlink_to("/etc")
    else:
        (root / "etc").mkdir()
        (root / "etc" / "os-release").write_text(
            f'ID=tiny\nPRETTY_NAME="tiny env"\nVARIANT={name}\n'
        )
        (root / "etc" / "secret").write_text("root only\n")
        os.chmod(root / "etc" / "secret", 0o600)
    for directory, dirs, _ in os.walk(root):
        for d in dirs:
            if not os.path.islink(os.path.join(directory, d)):
                os.chmod(os.path.join(directory, d), 0o755)
    os.chmod(root, 0o755)
    return ImageRoot(
        name=name,
        digest=f"sha256:{name:0>64}"[:71],
        root=root,
        env=(("TINY_HOME", "/opt/tool"), ("PATH", "/usr/bin:/bin")),
        workdir="/workspace",
        user="analyst",
    )


async def run(
    backend: BubblewrapBackend, image: ImageRoot | None, script: str
) -> tuple[int, str, str]:
    workspace = backend.create_workspace("ws")
    proc = await backend.spawn(
        SandboxSpec(
            argv=shell_argv(script),
            workspace=workspace,
            limits=backend.config.limits,
            timeout=30,
            image=image,
        )
    )
    try:
        out, err, outcome = await asyncio.gather(
            proc.stdout.read(), proc.stderr.read(), proc.wait()
        )
    finally:
        await proc.aclose()
    return outcome.exit_code or 0, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.fixture(params=[False, True], ids=["direct", "started-ahead"])
def ahead(request: pytest.FixtureRequest) -> bool:
    """Sandboxes started for their call, or started ahead (the pool's way) and handed it."""
    return bool(request.param)


@pytest.fixture
def images(tmp_path: Path) -> tuple[ImageRoot, ImageRoot]:
    base = tmp_path / "roots"
    base.mkdir(mode=0o755)
    return tiny_environment(base, "tiny"), tiny_environment(base, "hostile", hostile=True)


async def test_a_sandbox_runs_on_its_environment(
    tmp_path: Path, ahead: bool, images: tuple[ImageRoot, ImageRoot]
) -> None:
    tiny, _ = images
    async with started_backend(tmp_path, ahead) as backend:
        code, out, err = await run(
            backend, tiny,
            "cat /etc/os-release; cat /opt/tool/VERSION; echo home=$TINY_HOME; id -u; whoami;"
            " pwd; test -e /usr/bin/python3 && echo host-python; test -e /usr/bin/perl &&"
            " echo host-perl; cat /etc/secret || echo no-secret; touch /usr/x || echo ro;"
            " echo hi > /workspace/f && cat /workspace/f",
        )  # fmt: skip
        assert code == 0, err
        assert 'PRETTY_NAME="tiny env"' in out and "tool 1.0" in out
        assert "home=/opt/tool" in out
        lines = out.splitlines()
        assert "1000" in lines and "analyst" in lines and "/workspace" in lines
        assert "host-python" not in out and "host-perl" not in out  # (the host's /usr is not there)
        assert "no-secret" in out and "ro" in lines and "hi" in lines
        # The default root is what it was.
        code, out, _ = await run(backend, None, "test -e /usr/bin/perl && echo host-perl")
        assert out.strip() == "host-perl"
        assert not ahead or getattr(backend, "launched", 0) == 2  # (both through the stub)


async def test_a_hostile_environment_gives_nothing(
    tmp_path: Path, ahead: bool, images: tuple[ImageRoot, ImageRoot]
) -> None:
    _, hostile = images
    async with started_backend(tmp_path, ahead) as backend:
        _, out, err = await run(
            backend, hostile,
            "/usr/share/suid/busybox id -u;"
            " /usr/share/suid/busybox cat /proc/self/status | grep -E '^(Uid|NoNewPrivs)';"
            " cat /usr/share/mem > /dev/null && echo MEM-READ;"
            " cat /usr/share/shadow && echo SHADOW-READ; cat /etc/shadow && echo SHADOW2;"
            " grep -c . /etc/passwd; ls /usr/share/everything/ ; ls /var/ | wc -l",
        )  # fmt: skip
        assert "MEM-READ" not in out and "SHADOW" not in out, out + err
        lines = out.splitlines()
        assert lines[0] == "1000", (
            out + err
        )  # the setuid bit gave nothing (nosuid, a user namespace)
        assert "NoNewPrivs:\t1" in out and "Uid:\t1000\t1000\t1000\t1000" in out
        assert lines[lines.index("NoNewPrivs:\t1") + 1] == "3"  # our passwd, not the host's
        assert "workspace" in out  # / is the sandbox's own root
        assert not ahead or getattr(backend, "launched", 0) == 1


async def test_every_layer_holds_on_an_environment(
    tmp_path: Path, ahead: bool, images: tuple[ImageRoot, ImageRoot]
) -> None:
    tiny, _ = images
    async with started_backend(tmp_path, ahead) as backend:
        code, out, err = await run(
            backend, tiny,
            "unshare -U true && echo USERNS; unshare -n true && echo NETNS;"
            " grep -E '^(Seccomp|NoNewPrivs|CapEff)' /proc/self/status; cat /proc/self/uid_map;"
            " ls /sys 2>&1 | wc -l",
        )  # fmt: skip
        assert "USERNS" not in out and "NETNS" not in out
        assert (
            "Seccomp:\t2" in out and "NoNewPrivs:\t1" in out and "CapEff:\t0000000000000000" in out
        )
        assert code == 0, err
        # The execution's cgroup and rlimits: its pids (64 in the tests' policy), file size.
        loop = "i=0; while [ $i -lt 100 ]; do sleep 2 & i=$((i+1)); done; wait"
        code, out, err = await run(backend, tiny, loop)
        assert code != 0 and "can't fork" in err, (code, out, err[-500:])
        code, out, err = await run(backend, tiny, "cat /dev/zero > f; wc -c < f")
        assert int(out.split()[-1]) == backend.config.limits.file_size_mb * 2**20, (out, err)


async def test_an_environment_past_the_bounds_is_refused_saying_why(tmp_path: Path) -> None:
    base = tmp_path / "roots"
    base.mkdir(mode=0o755)
    wide = tiny_environment(base, "wide")
    for i in range(65):
        (wide.root / "opt" / f"tool{i}").mkdir(mode=0o755)
    async with started_backend(tmp_path) as backend:
        with pytest.raises(SandboxUnavailableError) as refused:
            await run(backend, wide, "true")
        assert "its /opt has 66 entries, at most 64" in str(refused.value)
        assert "rebuild or re-import it" in str(refused.value)


# -- sessions on environments, through the real server ----------------------------------------

ALICE, BOB = "alice-token-" + "a" * 20, "bob-token-" + "b" * 22


def install(
    state_dir: Path, image: ImageRoot, description: str, kernelspecs: dict[str, Any] | None = None
) -> Environment:
    """Put `image`'s tree into the server's environment store as a build would (root by its
    content digest, configuration by its digest, name); the tree is linked, not copied."""
    store = EnvironmentStore(state_dir / "environments")
    store.tmp.mkdir(parents=True, exist_ok=True)
    tree = store.tmp / image.name
    subprocess.run(["cp", "-al", str(image.root), str(tree)], check=True)
    root_digest = summarize(tree).digest
    store.add_root(tree, root_digest)
    for part in (store.base, store.roots, store.root_path(root_digest)):
        os.chmod(part, 0o755)
    config = {"root_digest": root_digest, "env": dict(image.env), "workdir": image.workdir,
              "user": image.user, "description": description, "size_bytes": 3 << 20,
              "kernelspecs": kernelspecs or {}, "labels": {}}  # fmt: skip
    digest = image_digest(config)
    store.add_image(digest, config)
    store.point(image.name, digest)
    env = store.get(image.name)
    assert env is not None
    return env


@pytest.fixture(scope="module")
def env_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("envs")
    settings = {"SANDBOX_AUTH_TOKENS": f"alice:{ALICE},bob:{BOB}",
                "SANDBOX_ENVIRONMENTS_ALLOW": "alice=*;*=tiny"}  # fmt: skip
    with running_server(workdir, **settings) as server:
        base = tmp_path_factory.mktemp("trees")
        os.chmod(base, 0o755)
        install(server.state_dir, tiny_environment(base, "tiny"), "busybox only")
        install(server.state_dir, tiny_environment(base, "other"), "another tiny one")
        yield server


async def test_sessions_run_on_the_environment_they_chose(env_server: ServerProcess) -> None:
    async with open_client(env_server.url, ALICE) as conn:
        listed = await conn.call("list_environments")
        names = [e["name"] for e in (listed.structured_content or {})["environments"]]
        assert names == ["default", "other", "tiny"]
        text = listed.content[0].text  # type: ignore[union-attr]
        assert "tiny (shell only, 3 MB) - busybox only" in text
        one = await conn.call("list_environments", name="tiny")
        assert [e["name"] for e in (one.structured_content or {})["environments"]] == ["tiny"]
        none = await conn.call("list_environments", name="tinny")
        assert "No environment 'tinny'" in none.content[0].text  # type: ignore[union-attr]
        a, b = await asyncio.gather(
            conn.ok("execute_code", session="a", image="tiny",
                    command="cat /etc/os-release; whoami; echo $TINY_HOME"),
            conn.ok("execute_code", session="b", command="test -x /usr/bin/perl && echo perl"),
        )  # fmt: skip
        out_a = "".join(e.get("data") or "" for e in a["output"])
        assert 'PRETTY_NAME="tiny env"' in out_a and "analyst" in out_a and "/opt/tool" in out_a
        assert "perl" in "".join(e.get("data") or "" for e in b["output"])
        # Fixed by the first sandbox: a later call naming another is refused, saying how.
        error = await conn.error("execute_code", session="a", image="other", command="true")
        assert "runs on environment 'tiny'" in error and "new session" in error
        error = await conn.error("execute_code", session="b", image="tiny", command="true")
        assert "runs on environment 'default'" in error
        again = await conn.ok("execute_code", session="a", command="cat /etc/os-release")
        assert "tiny env" in "".join(e.get("data") or "" for e in again["output"])
        same = await conn.ok("execute_code", session="a", image="tiny", command="true")
        assert same["exit_code"] == 0
        error = await conn.error("execute_code", session="c", image="nope", command="true")
        assert "no environment 'nope'" in error and "default, other, tiny" in error


def test_a_wrong_allow_setting_stops_the_start_saying_how(tmp_path: Path) -> None:
    code, err = run_server_once(tmp_path, SANDBOX_ENVIRONMENTS_ALLOW="alice")
    assert code == 2 and "entry 'alice' is not PRINCIPAL=NAME,NAME" in err, err[-500:]


async def test_the_operator_chooses_who_may_use_which(env_server: ServerProcess) -> None:
    async with open_client(env_server.url, BOB) as conn:
        listed = await conn.ok("list_environments")
        assert [e["name"] for e in listed["environments"]] == ["default", "tiny"]
        error = await conn.error("execute_code", session="x", image="other", command="true")
        assert "no environment 'other' you may use" in error
        done = await conn.ok("execute_code", session="y", image="tiny", command="whoami")
        assert done["exit_code"] == 0


async def test_a_fork_goes_on_on_the_snapshots_environment(env_server: ServerProcess) -> None:
    async with open_client(env_server.url, ALICE) as conn:
        await conn.ok("execute_code", session="f1", image="other", command="echo x > x.txt")
        await conn.ok("fork_session", from_session="f1", to_session="f2")
        done = await conn.ok("execute_code", session="f2", command="cat x.txt /etc/os-release")
        assert output_of(done).startswith("x\n") and "VARIANT=other" in output_of(done)
        error = await conn.error("execute_code", session="f2", image="tiny", command="true")
        assert "runs on environment 'other'" in error


# -- egress on an environment without Python ---------------------------------------------------

EGRESS_TOKEN = "env-egress-token-0123456789"
lab = netlab_fixture(scope="module", name="lab")


@pytest.fixture(scope="module")
def egress_server(
    lab: NetLab, tmp_path_factory: pytest.TempPathFactory, serve: Servers
) -> ServerProcess:
    lab.set_dns({"allowed.test": [lab.origin_ip], "other.test": [lab.origin_ip]})
    network = ipaddress.ip_interface(f"{lab.host_ip}/30").network
    server = serve("env-egress", SANDBOX_AUTH_TOKEN=EGRESS_TOKEN,
                   SANDBOX_EGRESS_ALLOW="allowed.test", SANDBOX_EGRESS_ALLOW_CIDRS=str(network),
                   SANDBOX_EGRESS_RESOLVER=lab.resolver)  # fmt: skip
    base = tmp_path_factory.mktemp("egress-trees")
    os.chmod(base, 0o755)
    install(server.state_dir, tiny_environment(base, "tiny"), "busybox only")
    return server


async def test_egress_holds_on_an_environment_without_python(egress_server: ServerProcess) -> None:
    """The relay (a Perl program) runs on the host's Perl through the host's loader: the
    environment has no Perl or Python at all; the policy is the same as on the default root,
    on a session's first call and on the next (a sandbox started ahead, when there was CPU to
    spare for one)."""
    async with open_client(egress_server.url, EGRESS_TOKEN) as conn:
        for _ in range(2):
            done = await conn.ok(
                "execute_code", session="net", image="tiny",
                command="test -e /usr/bin/python3 || test -e /usr/bin/perl || echo no-python;"
                " echo allowed=$(wget -q -O - http://allowed.test/hello);"
                " wget -q -O - http://other.test/hello || echo other-refused;"
                " tr '\\0' ' ' < /proc/1/cmdline",
            )  # fmt: skip
            out = "".join(e.get("data") or "" for e in done["output"])
            assert "no-python" in out and "allowed=hello from origin 80" in out, out
            assert "other-refused" in out, out
            assert "/run/srt-host/usr/bin/perl /run/srt-relay.pl" in out, out


# -- a session re-homed on another replica keeps its environment -------------------------------

REPLICA_TOKEN = "env-replica-token-0123456789"


def output_of(result: dict[str, Any]) -> str:
    return "".join(e.get("data") or "" for e in result["output"])


async def test_a_rehomed_session_keeps_its_environment(
    tmp_path: Path, redis_server: RedisServer, serve: Servers
) -> None:
    """Two replicas with state directories of their own, one snapshot store: the session's
    environment travels in its snapshot (by digest) and the replica it moves to runs it on
    the same one; naming another there is still refused."""
    store = str(tmp_path / "shared-store")
    base = tmp_path / "trees"
    base.mkdir(mode=0o755)
    replicas = []
    for name in ("ea", "eb"):
        server = replica_process(tmp_path, redis_server.url, f"{name}-{uuid.uuid4().hex[:6]}",
                                 REPLICA_TOKEN, SANDBOX_SNAPSHOT_STORE=store,
                                 SANDBOX_WORKSPACE_POOL="0")  # fmt: skip
        replicas.append(serve.add(server))
        install(server.state_dir, tiny_environment(base / name, "other"), "another")
    a, b = replicas
    # Only A has `tiny`; it is pushed to the shared store (`env push`), B fetches it by digest.
    tiny = install(a.state_dir, tiny_environment(base / "ea", "tiny"), "busybox only")
    shared = open_store(store, tmp_path / "unused", endpoint=None, region="", timeout=10)
    assert shared is not None
    await push(EnvironmentStore(a.state_dir / "environments"), tiny, shared, print)
    assert EnvironmentStore(b.state_dir / "environments").by_digest(tiny.digest) is None
    session = f"e-{uuid.uuid4().hex[:8]}"
    async with open_client(a.url, REPLICA_TOKEN) as on_a:
        done = await on_a.ok("execute_code", session=session, image="tiny",
                             command="echo kept > f.txt; whoami")  # fmt: skip
        assert output_of(done) == "analyst\n"
        taken = await on_a.ok("snapshot_session", session=session)
        assert taken["environment"]["name"] == "tiny", taken
    a.stop(timeout=60)
    async with open_client(b.url, REPLICA_TOKEN) as on_b:

        async def moved() -> dict[str, Any] | None:
            result = await on_b.call("execute_code", session=session,
                                     command="cat f.txt; cat /etc/os-release; whoami")  # fmt: skip
            return None if result.is_error else dict(result.structured_content or {})

        result = await eventually(moved, 30, "the session to be re-homed", interval=0.5)
        assert result["session_reset"]["restored_from"], result
        out = output_of(result)
        assert out.startswith("kept\n") and "tiny env" in out and "analyst" in out, out
        error = await on_b.error("execute_code", session=session, image="other", command="true")
        assert "runs on environment 'tiny'" in error
    assert EnvironmentStore(b.state_dir / "environments").by_digest(tiny.digest) is not None


# -- R and Go environments from the distribution's packages -----------------------------------


@pytest.fixture(scope="module")
def lang_server(tmp_path_factory: pytest.TempPathFactory, serve: Servers) -> ServerProcess:
    """A server on the tests' built environments (environments_harness.py, built once per
    machine: test-r with r-base-core and r-cran-irkernel, test-go with golang-go, from
    Debian's packages)."""
    names = ("test-base", "test-r", "test-go")
    built = build_all(environments_dir(), tmp_path_factory.mktemp("env-builds"), names)
    return serve("env-langs", SANDBOX_ENVIRONMENTS_DIR=str(built.base),
                 SANDBOX_INTERPRETER_WARM="python=0,r@test-r=1")  # fmt: skip


async def test_run_code_in_r_computes_and_plots(lang_server: ServerProcess) -> None:
    """On a warm R kernel (SANDBOX_INTERPRETER_WARM r@test-r=1): the session takes it."""
    warm = ("srt_interpreters{", 'language="r@test-r"', 'state="warm"')
    await eventually(lambda: lang_server.metric("none", *warm) == 1, 60, "a warm R kernel")
    async with open_client(lang_server.url, None) as conn:
        result = await conn.call(
            "run_code", session="r1", image="test-r", language="r",
            code="x <- c(2, 4, 9)\ncat(sprintf('mean=%.1f\\n', mean(x)))\nplot(x, type='l')",
        )  # fmt: skip
        assert not result.is_error, result.content
        structured = result.structured_content or {}
        text = json.dumps(structured)
        assert "mean=5.0" in text, text[:2000]
        images = [b for b in result.content if isinstance(b, ImageContent)]
        assert images and images[0].mime_type == "image/png", result.content
        assert base64.b64decode(images[0].data).startswith(b"\x89PNG")
        # State kept between calls, in the environment's own R.
        again = await conn.ok("run_code", session="r1", language="r",
                              code="cat(sum(x), R.version$major)")  # fmt: skip
        assert "15 4" in json.dumps(again), again
        hits = ("srt_interpreter_events_total{", 'language="r"', 'event="warm_hit"')
        assert lang_server.metric("none", *hits) == 1
        listed = await conn.ok("list_languages", session="r1")
        assert [(x["language"], x["running"]) for x in listed["languages"]] == [("r", True)]
        error = await conn.error("run_code", session="r1", language="javascript", code="1")
        assert "has no javascript kernel" in error and "its languages: r" in error


async def test_go_run_in_the_go_environment(lang_server: ServerProcess) -> None:
    program = 'package main\nimport "fmt"\nfunc main() { fmt.Println("sum", 2+40) }\n'
    async with open_client(lang_server.url, None) as conn:
        await conn.ok("write_file", session="g1", path="main.go", content=program)
        done = await conn.ok("execute_code", session="g1", image="test-go",
                             command="go run main.go", timeout_seconds=120)  # fmt: skip
        assert output_of(done).strip() == "sum 42", done


# -- a hosted server whose catalog entry names an environment ---------------------------------

HOST_PYTHON = [  # the host's Python as the relay runs it: what any environment can start
    "/run/srt-host/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    "--library-path", "/run/srt-host/usr/lib/x86_64-linux-gnu", "/run/srt-host/usr/bin/python3",
]  # fmt: skip


async def test_a_hosted_server_runs_on_the_environment_its_entry_names(
    tmp_path: Path,
) -> None:
    base = tmp_path / "trees"
    base.mkdir(mode=0o755)
    entry = script_entry("echoenv.py", image="tiny")
    entry["command"] = [*HOST_PYTHON, *entry["command"][1:]]
    catalog = {"ontiny": entry, "bad": {**script_entry("echoenv.py"), "image": "nope"}}
    (tmp_path / "server").mkdir()
    with catalog_server(tmp_path / "server", catalog, f"alice:{ALICE}") as server:
        install(server.state_dir, tiny_environment(base, "tiny"), "busybox only")
        async with open_client(f"{server.base_url}/servers/ontiny/mcp", ALICE) as conn:
            env = json.loads(text_of(await conn.client.call_tool("env", {})))
        assert env["TINY_HOME"] == "/opt/tool" and env["USER"] == "analyst", env
        async with open_client(server.url, ALICE) as conn:
            listed = await conn.ok("list_servers", server="bad")
        problem = listed["servers"][0]["problem"] or ""
        with pytest.raises(BaseException) as refused:  # (at initialize: the instance starts)
            async with open_client(f"{server.base_url}/servers/bad/mcp", ALICE) as conn:
                await conn.client.call_tool("env", {})
        assert "no environment 'nope' here" in message_of(refused.value) + problem
