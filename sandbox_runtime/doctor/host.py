"""The doctor's checks of the host itself, without starting anything: bubblewrap, user
namespaces, the sandbox user, seccomp, sandboxes started ahead, cgroups."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandbox_runtime.config import Settings
from sandbox_runtime.errors import SandboxRuntimeError
from sandbox_runtime.sandbox.cgroups import CgroupLayout
from sandbox_runtime.sandbox.host import DEFAULT_SANDBOX_USER, STUB_PERL, stub_problem
from sandbox_runtime.sandbox.seccomp import compile_filter

APPARMOR_FIX = (
    "Ubuntu 23.10+/24.04 restrict unprivileged user namespaces through AppArmor: allow bwrap "
    "with an AppArmor profile (/etc/apparmor.d/bwrap: `abi <abi/4.0>, include <tunables/global> "
    "profile bwrap /usr/bin/bwrap flags=(unconfined) { userns, }`, then "
    "`systemctl reload apparmor`), or `sysctl kernel.apparmor_restrict_unprivileged_userns=0`"
)


@dataclass
class Check:
    layer: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    @property
    def label(self) -> str:
        if self.ok:
            return "OK"
        return "FAIL" if self.required else "WARN"


def read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def in_container() -> bool:
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    cgroup = read("/proc/1/cgroup") or ""
    return any(word in cgroup for word in ("docker", "kubepods", "containerd", "libpod"))


def check_static(settings: Settings) -> list[Check]:
    checks: list[Check] = []
    bwrap = settings.bwrap_path or shutil.which("bwrap")
    if bwrap and os.access(bwrap, os.X_OK):
        version = subprocess.run(
            [bwrap, "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
        checks.append(Check("bubblewrap", True, f"{bwrap} ({version or 'unknown version'})"))
    else:
        missing = f"{bwrap or 'bwrap'} not found"
        checks.append(Check("bubblewrap", False, missing, "apt-get install bubblewrap"))

    userns_problems = []
    if read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        userns_problems.append(
            ("kernel.unprivileged_userns_clone=0", "sysctl kernel.unprivileged_userns_clone=1")
        )
    if read("/proc/sys/user/max_user_namespaces") == "0":
        userns_problems.append(
            ("user.max_user_namespaces=0", "sysctl user.max_user_namespaces=15000")
        )
    if read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        userns_problems.append(("AppArmor restricts unprivileged user namespaces", APPARMOR_FIX))
    if userns_problems:
        checks.append(
            Check(
                "user namespaces",
                False,
                "; ".join(p for p, _ in userns_problems),
                "; ".join(f for _, f in userns_problems),
            )
        )
    else:
        checks.append(Check("user namespaces", True, "unprivileged user namespaces enabled"))

    checks.append(_sandbox_user_check(settings))

    try:
        size = len(compile_filter())
        checks.append(Check("seccomp", True, f"filter compiled ({size // 8} BPF instructions)"))
    except SandboxRuntimeError as exc:
        checks.append(Check("seccomp", False, str(exc), "apt-get install libseccomp2"))

    problem = stub_problem() if settings.pool_size else None
    checks.append(
        Check(
            "sandboxes started ahead",
            problem is None,
            problem
            or (
                f"up to {settings.pool_size} per replica, their stub is {STUB_PERL}"
                if settings.pool_size
                else "off (SANDBOX_POOL_SIZE=0)"
            ),
            "apt-get install perl-base (or SANDBOX_POOL_SIZE=0): without it every sandbox "
            "is started for its call",
            required=False,
        )
    )

    layout = CgroupLayout.setup("srt-doctor", favordynmods=False)
    ok = layout.version != "none"
    checks.append(
        Check(
            "cgroups",
            ok,
            layout.describe() + ("" if ok else f" ({'; '.join(layout.problems)})"),
            "run as root on a host with cgroup v2 (memory, pids, cpu delegated) or v1 "
            "memory+pids controllers; without them only rlimits bound an execution",
            required=False,
        )
    )
    if ok:
        checks.append(
            Check(
                "cgroup migrations",
                layout.favordynmods == "on",
                f"favordynmods {layout.favordynmods.split(' ')[0]}",
                "without it every sandbox start waits an RCU grace period (~7 ms); the server "
                "turns it on at start when root (SANDBOX_CGROUP_FAVORDYNMODS=true, the default)",
                required=False,
            )
        )
    layout.close()
    return checks


def sandbox_user(settings: Settings) -> tuple[str, bool]:
    """The user sandboxes run as, and whether the server makes it at start."""
    if settings.sandbox_user:
        return settings.sandbox_user, False
    if os.geteuid() == 0:
        return DEFAULT_SANDBOX_USER, True
    return pwd.getpwuid(os.geteuid()).pw_name, False


def _sandbox_user_check(settings: Settings) -> Check:
    user, made = sandbox_user(settings)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        if made:
            return Check("sandbox user", True, f"{user} (a system user, created at start)")
        return Check(
            "sandbox user",
            False,
            f"user {user!r} does not exist",
            "useradd --system --user-group --no-create-home srt-sandbox, or unset "
            "SANDBOX_SANDBOX_USER (a root server then makes srt-sandbox itself)",
        )
    if entry.pw_uid == 0:
        return Check("sandbox user", False, "the sandbox user is root", "SANDBOX_SANDBOX_USER")
    if os.geteuid() not in (0, entry.pw_uid):
        return Check(
            "sandbox user",
            False,
            f"server runs as uid {os.geteuid()} and cannot become {user}",
            "run as root, or set SANDBOX_SANDBOX_USER to the server's own user",
        )
    shared = (
        " (shared with other daemons: prefer the default srt-sandbox)" if user == "nobody" else ""
    )
    return Check("sandbox user", True, f"{user} (uid {entry.pw_uid}){shared}")
