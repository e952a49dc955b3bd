"""Sandboxes on an environment (DESIGN §21, the using half): the environment's root bound
read-only in place of the host's /usr, every layer of the sandbox the same, and nothing a
hostile tree carries (setuid files, device nodes, links out) giving anything.

The environments here are small trees built by the test from the host's static busybox,
laid out as the store keeps roots (a directory per root)."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from pathlib import Path

import pytest
from conftest import started_backend

from sandbox_runtime.sandbox import BubblewrapBackend, SandboxSpec
from sandbox_runtime.sandbox.spec import ImageRoot, shell_argv

BUSYBOX = "/usr/bin/busybox"  # static: runs on any root
TOOLS = ("sh", "id", "cat", "ls", "test", "echo", "grep", "whoami", "unshare", "env", "pwd",
         "wc", "stat", "touch")  # fmt: skip


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
        (root / "etc" / "os-release").write_text('ID=tiny\nPRETTY_NAME="tiny env"\n')
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
        )  # fmt: skip
    )
    try:
        out, err, outcome = await asyncio.gather(
            proc.stdout.read(), proc.stderr.read(), proc.wait()
        )
    finally:
        await proc.aclose()
    return outcome.exit_code or 0, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.fixture
def images(tmp_path: Path) -> tuple[ImageRoot, ImageRoot]:
    base = tmp_path / "roots"
    base.mkdir(mode=0o755)
    return tiny_environment(base, "tiny"), tiny_environment(base, "hostile", hostile=True)


async def test_a_sandbox_runs_on_its_environment(
    tmp_path: Path, images: tuple[ImageRoot, ImageRoot]
) -> None:
    tiny, _ = images
    async with started_backend(tmp_path) as backend:
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


async def test_a_hostile_environment_gives_nothing(
    tmp_path: Path, images: tuple[ImageRoot, ImageRoot]
) -> None:
    _, hostile = images
    async with started_backend(tmp_path) as backend:
        code, out, err = await run(
            backend, hostile,
            "/usr/share/suid/busybox id -u; /usr/share/suid/busybox cat /proc/self/status | grep -E '^(Uid|NoNewPrivs)';"
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


async def test_every_layer_holds_on_an_environment(
    tmp_path: Path, images: tuple[ImageRoot, ImageRoot]
) -> None:
    tiny, _ = images
    async with started_backend(tmp_path) as backend:
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
