"""The doctor's checks that start real things: a sandbox (looked at from inside), a workspace
store, a Python interpreter in a sandbox, a request through the egress relay and proxy."""

from __future__ import annotations

import asyncio
import os
import pwd
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from sandbox_runtime.config import Settings
from sandbox_runtime.doctor.host import Check, in_container, read, sandbox_user
from sandbox_runtime.egress.supervisor import EgressProxy
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.sandbox import BackendConfig, BubblewrapBackend, SandboxSpec, shell_argv

# The spawner (the sandbox uid) moves bwrap into its cgroups through cgroup.procs files the
# server opened as root; the kernel must judge such a write by the opener's credentials.
CGROUP_MOVE_FIX = (
    "the kernel refused the spawner's move into the execution cgroup: it needs Linux >= 5.16 "
    "or a kernel with the CVE-2021-4197 fix (open-time credentials for cgroup.procs writes)"
)
CONTAINER_FIX = (
    "inside Docker/Kubernetes the default seccomp and AppArmor profiles block the unshare() and "
    "mount() bwrap needs: run the container with `--security-opt seccomp=unconfined "
    "--security-opt apparmor=unconfined` (Kubernetes: seccompProfile Unconfined, "
    "appArmorProfile Unconfined), or a seccomp profile that allows unshare/clone with "
    "CLONE_NEWUSER; see DEPLOYMENT.md"
)


async def check_live(settings: Settings) -> list[Check]:
    """Start a real sandbox and look at it from inside."""
    with tempfile.TemporaryDirectory(prefix="srt-doctor-") as tmp:
        os.chmod(tmp, 0o711)
        backend = _backend(settings, Path(tmp), "srt-doctor")
        if backend.unavailable_reason is not None:
            return [Check("sandbox run", False, backend.unavailable_reason, "see the checks above")]
        spawner = _spawner_check(backend)
        dev_problem = backend.dev_problem
        try:
            proc = await backend.spawn(
                SandboxSpec(
                    argv=shell_argv(
                        "grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/self/status; "
                        "if (: >/dev/null </dev/zero) 2>/dev/null; then echo Devices: usable; "
                        "else echo Devices: refused; fi"
                    ),
                    workspace=backend.create_workspace("doctor"),
                    limits=replace(settings.limits(), pseudo_terminals=False),  # the prebuilt /dev
                    timeout=20,
                )
            )
            out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            outcome = await proc.wait()
            await proc.aclose()
        except SandboxRuntimeError as exc:
            fix = ""
            if "into its cgroup" in str(exc):
                fix = CGROUP_MOVE_FIX
            return [Check("sandbox run", False, str(exc), fix)]
        finally:
            await backend.aclose()
    text = out.decode("utf-8", "replace")
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines())
    )
    if outcome.exit_code != 0 or not fields:
        detail = err.decode("utf-8", "replace").strip() or f"exit code {outcome.exit_code}"
        fix = CONTAINER_FIX if in_container() else "see the user namespaces check"
        return [Check("sandbox run", False, f"bwrap failed: {detail}", fix)]
    checks = [
        spawner,
        Check("sandbox run", True, f"started and exited 0 in {outcome.duration_s * 1e3:.0f} ms"),
        Check(
            "prebuilt /dev",
            dev_problem is None,
            dev_problem
            or "device nodes made once at start; every sandbox binds that one directory",
            "bwrap builds /dev for every sandbox instead (~1.5 ms more CPU per start): run the "
            "server as root, with TMPDIR on a filesystem mounted without nodev",
            required=False,
        ),
    ]
    checks.append(
        Check(
            "sandbox /dev",
            fields.get("Devices") == "usable",
            "/dev/null and /dev/zero open inside"
            if fields.get("Devices") == "usable"
            else f"cannot open /dev/null or /dev/zero inside: {err.decode(errors='replace')}",
            "a device cgroup or security module (SELinux, AppArmor) refuses the sandbox user "
            "its devices: allow the character devices 1:3, 1:5, 1:7, 1:8, 1:9 and 5:0",
        )
    )
    checks.append(
        Check(
            "seccomp active",
            fields.get("Seccomp") == "2",
            f"Seccomp mode {fields.get('Seccomp')} inside",
            "bwrap --seccomp failed to load the filter",
        )
    )
    checks.append(
        Check(
            "no privileges",
            fields.get("NoNewPrivs") == "1" and int(fields.get("CapEff", "1"), 16) == 0,
            f"NoNewPrivs={fields.get('NoNewPrivs')} CapEff={fields.get('CapEff')}",
            "the sandbox kept capabilities: report a bug",
        )
    )
    return checks


def check_workspaces(settings: Settings) -> list[Check]:
    """How workspaces get their quota here, and how file tools resolve paths safely."""
    from sandbox_runtime.workspaces.store import WorkspaceStore

    checks = [check_project_quotas(settings)]
    if checks[0].ok and settings.workspace_quota in ("auto", "project"):
        checks.append(_file_tools())
        return checks
    user, _ = sandbox_user(settings)
    try:
        entry = pwd.getpwnam(user)
        uid, gid = entry.pw_uid, entry.pw_gid
    except KeyError:
        uid = gid = os.geteuid()
    with tempfile.TemporaryDirectory(prefix="srt-doctor-") as tmp:
        store = WorkspaceStore(
            Path(tmp) / "ws",
            size_mb=settings.workspace_mb,
            inodes=settings.workspace_inode_count(),
            quota=settings.workspace_quota,
            retention_seconds=settings.workspace_retention_seconds,
        )
        try:
            store.start(uid, gid)
            if store.mode == "image":
                inodes = settings.workspace_inode_count()
                detail = (
                    f"a {settings.workspace_mb} MiB, {inodes}-file ext4 image per workspace "
                    "(the kernel enforces both)"
                )
                checks.append(Check("workspace quota", True, detail))
            else:
                checks.append(
                    Check(
                        "workspace quota",
                        False,
                        f"none: {store.problem}",
                        "run as root with loop devices and e2fsprogs, or accept no quota",
                        False,
                    )
                )
        except SandboxRuntimeError as exc:
            checks.append(Check("workspace quota", False, str(exc), "SANDBOX_WORKSPACE_QUOTA"))
    checks.append(_file_tools())
    return checks


def _file_tools() -> Check:
    from sandbox_runtime.workspaces.fsops import openat2_available

    if openat2_available():
        return Check("file tools", True, "paths resolved with openat2 (RESOLVE_BENEATH)")
    return Check("file tools", True, "no openat2 (kernel < 5.6): paths walked with O_NOFOLLOW")


def check_project_quotas(settings: Settings) -> Check:
    """Whether the state filesystem gives workspaces a project quota (the first choice of
    SANDBOX_WORKSPACE_QUOTA=auto), and the one command that enables it where it does not."""
    from sandbox_runtime.workspaces.quotamode import quota_dirs

    where = settings.state_dir / "workspaces"
    while not where.exists() and where != where.parent:  # (the doctor makes nothing)
        where = where.parent
    dirs = quota_dirs(where)
    problem = dirs.probe()
    wanted = settings.workspace_quota
    if problem is None:
        detail = (
            f"{dirs.kind} directories with a quota on the state filesystem ({where}): "
            f"{settings.workspace_mb} MiB"
            + (
                " (btrfs has no file limit: metadata bytes count)"
                if dirs.kind == "btrfs"
                else f", {settings.workspace_inode_count()} files"
            )
        )
        if wanted not in ("auto", "project"):
            detail += f"; not used: SANDBOX_WORKSPACE_QUOTA={wanted}"
        return Check("workspace project quota", True, detail)
    fallback = "images (if the next check passes)" if wanted == "auto" else "not used"
    return Check(
        "workspace project quota",
        False,
        f"unavailable: {problem}; workspaces are {fallback}",
        f"to enable: {dirs.enable_command()}",
        wanted == "project",
    )


def _backend(
    settings: Settings, tmp: Path, group: str, runtime_dir: Path | None = None
) -> BubblewrapBackend:
    """A started backend under the server's policy, its workspaces in `tmp`."""
    backend = BubblewrapBackend(
        BackendConfig(
            limits=settings.limits(),
            sandbox_user=settings.sandbox_user,
            workspace_root=tmp / "ws",
            bwrap_path=settings.bwrap_path,
            group_name=group,
            runtime_dir=runtime_dir,
        )
    )
    backend.start()
    return backend


def _spawner_check(backend: BubblewrapBackend) -> Check:
    """What the running spawner's /proc/PID/status says of its ids and privileges."""
    pid = backend.spawner_pid
    text = read(f"/proc/{pid}/status") if pid is not None else None
    fields = {
        key: value.split()
        for key, _, value in (line.partition(":") for line in (text or "").splitlines())
    }
    uids = set(fields.get("Uid", []))
    caps = ["CapInh", "CapPrm", "CapEff", "CapAmb"] + (["CapBnd"] if os.geteuid() == 0 else [])
    unprivileged = all(int(fields.get(c, ["1"])[0], 16) == 0 for c in caps)
    ok = len(uids) == 1 and "0" not in uids and unprivileged and fields.get("NoNewPrivs") == ["1"]
    detail = (
        f"pid {pid}, uid {'/'.join(sorted(uids)) or '?'}, "
        + " ".join(f"{c}={fields.get(c, ['?'])[0]}" for c in caps)
        + f" NoNewPrivs={fields.get('NoNewPrivs', ['?'])[0]}"
    )
    return Check("spawner", ok, detail, "the spawner kept privileges: report a bug")


async def check_languages(settings: Settings) -> list[Check]:
    """The runtime's languages, and a Python interpreter started in a real sandbox."""
    from sandbox_runtime.interpreters.kernel import SandboxedKernel
    from sandbox_runtime.interpreters.runtime import load_runtime

    path = settings.runtime_path()
    runtime = load_runtime(path)
    fix = "srt-mcp-server runtime install (./scripts/serve does it on first use)"
    if runtime is None:
        return [Check("languages", False, f"no runtime at {path}: run_code is off", fix, False)]
    manifest = runtime.manifest
    described = ", ".join(
        f"{name} ({manifest.get('python')})"
        if name == "python"
        else f"{name} (deno {manifest.get('deno')})"
        if runtime.kernels[name].kernel == "deno"
        else name
        for name in runtime.languages
    )
    checks = [Check("languages", True, f"{described}; runtime at {path}")]
    if "python" not in runtime.kernels:
        return checks
    with tempfile.TemporaryDirectory(prefix="srt-doctor-") as tmp:
        os.chmod(tmp, 0o711)
        backend = _backend(settings, Path(tmp), "srt-doctor-kernel", runtime_dir=path)
        kernel = SandboxedKernel(
            backend,
            runtime.kernels["python"],
            backend.create_workspace("doctor"),
            settings.limits(),
            Path(tmp) / "kernels",
        )
        outputs: list[str] = []
        try:
            started = time.monotonic()
            await kernel.start()
            ready = time.monotonic() - started
            await kernel.execute(
                "print(6 * 7)", lambda kind, content: outputs.append(str(content.get("text")))
            )
            ok = "".join(outputs).strip() == "42"
            detail = f"a Python interpreter started in {ready * 1e3:.0f} ms and ran code"
        except Exception as exc:  # any failure is the finding
            ok, detail = False, f"a Python interpreter failed: {exc}"
        finally:
            await kernel.stop()
            await backend.aclose()
    checks.append(Check("interpreter", ok, detail, "see the sandbox checks above", False))
    return checks


# A request no policy can allow (.invalid is reserved): the relay and the proxy answer it
# without any network, which is what this check needs to see.
EGRESS_PROBE = (
    "import socket; s = socket.create_connection(('127.0.0.1', 3128), 5); "
    "s.sendall(b'CONNECT doctor-probe.invalid:443 HTTP/1.1\\r\\n\\r\\n'); "
    "print(s.recv(200).split(b'\\r\\n')[0].decode())"
)


async def check_egress(settings: Settings) -> list[Check]:
    """The egress policy, and (when it allows anything) a sandbox's request through its relay
    and the proxy, refused as it must be."""
    policy = settings.egress_policy()
    if not policy.enabled:
        return [Check("egress", True, "off: sandboxes have no network (SANDBOX_EGRESS_ALLOW)")]
    described = policy.describe()
    summary = f"allow {','.join(described['allow']) or '-'}"
    if described["allow_cidrs"]:
        summary += f" cidrs {','.join(described['allow_cidrs'])}"
    if described["deny"]:
        summary += f" deny {','.join(described['deny'])}"
    with tempfile.TemporaryDirectory(prefix="srt-doctor-") as tmp:
        os.chmod(tmp, 0o711)
        backend = _backend(settings, Path(tmp), "srt-doctor")
        if backend.unavailable_reason is not None or backend.private_dir is None:
            return [Check("egress", False, str(backend.unavailable_reason), "see above")]
        egress = EgressProxy(
            settings.egress_settings(),
            backend.private_dir / "egress",
            backend.sandbox_uid,
            backend.sandbox_gid,
        )
        await egress.start()
        backend.egress = egress
        try:
            if egress.problem is not None:
                return [Check("egress proxy", False, egress.problem, "see the server's log")]
            proxy_status = read(f"/proc/{egress.pid}/status") or ""
            uid_line = next((ln for ln in proxy_status.splitlines() if ln.startswith("Uid:")), "")
            proc = await backend.spawn(
                SandboxSpec(
                    argv=["/usr/bin/python3", "-c", EGRESS_PROBE],
                    workspace=backend.create_workspace("doctor"),
                    limits=settings.limits(),
                    timeout=20,
                    egress=policy,
                )
            )
            out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            await proc.wait()
            await proc.aclose()
        except SandboxRuntimeError as exc:
            return [Check("egress", False, str(exc), "see the checks above")]
        finally:
            await backend.aclose()
            await egress.aclose()
    answer = out.decode("utf-8", "replace").strip()
    ok = answer.startswith("HTTP/1.1 403")
    uid = uid_line.split()[1] if len(uid_line.split()) > 1 else "?"
    return [
        Check("egress policy", True, summary),
        Check(
            "egress proxy",
            ok,
            f"a sandbox's request went through its relay to the proxy (uid {uid}) and was "
            "refused as it must be"
            if ok
            else f"no answer through the relay: {answer or err.decode(errors='replace')[-300:]}",
            "see the server's log",
        ),
    ]
