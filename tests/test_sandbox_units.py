"""The pure parts of the sandbox layer, in-process (no bwrap, no cgroup hierarchy, no root):
bwrap's command line from a spec, the command a sandbox started ahead is handed, the checks
of what a caller asks for, the cgroup limit arithmetic and the parsing of what /proc says."""

from __future__ import annotations

import os
import resource
from dataclasses import replace
from pathlib import Path

import pytest

from sandbox_runtime.domain.limits import MIB, SandboxLimits
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.sandbox import argv
from sandbox_runtime.sandbox.cgroup_fs import (
    keyed,
    parse_mount_options,
    parse_mounts,
    parse_own_paths,
)
from sandbox_runtime.sandbox.cgroup_instances import (
    INSTANCE_NAME,
    instance_name,
    owner_gone,
    pid_namespace,
    start_time_of,
)
from sandbox_runtime.sandbox.cgroup_limits import (
    CPU_PERIOD_US,
    CgroupStats,
    limit_values,
    limit_writes,
)
from sandbox_runtime.sandbox.cgroups import CgroupLayout
from sandbox_runtime.sandbox.egress_port import RELAY_PORT, SOCKET_DIR, SOCKET_NAME
from sandbox_runtime.sandbox.execution_cgroup import ExecutionCgroup
from sandbox_runtime.sandbox.host import (
    KERNEL_DIR,
    PRCTL_SYSCALL,
    RELAY_PATH,
    RUNTIME,
    WORKSPACE,
)
from sandbox_runtime.sandbox.pipes import sandbox_fds, write_at_once
from sandbox_runtime.sandbox.reaping import is_zombie_bwrap
from sandbox_runtime.sandbox.spec import (
    MAX_COMMAND_BYTES,
    MAX_ENV_VARS,
    SandboxSpec,
    sandbox_cwd,
    shell_argv,
    validate_command,
    validate_env,
)

pytestmark = pytest.mark.unit

ROOT = Path("/private/root")
DEV = Path("/private/root/dev")


class Lease:
    """An egress lease as the backend sees one (egress_port.EgressLease)."""

    def __init__(self, host_dir: Path, trust_bundle: Path | None = None) -> None:
        self.host_dir = host_dir
        self.trust_bundle = trust_bundle


def spec(**kw: object) -> SandboxSpec:
    base: dict[str, object] = {
        "argv": ["/usr/bin/python3", "-c", "print(1)"],
        "workspace": Path("/srv/ws/a"),
        "limits": SandboxLimits(),
    }
    return SandboxSpec(**{**base, **kw})  # type: ignore[arg-type]


def pairs(args: list[str], option: str) -> list[tuple[str, ...]]:
    """The operands of every `option` in `args` (--setenv takes two, the others we ask of
    take one or two as bwrap does)."""
    width = {"--setenv": 2, "--bind": 2, "--ro-bind": 2, "--dev-bind": 2, "--tmpfs": 1,
             "--size": 1, "--chdir": 1, "--dev": 1, "--remount-ro": 1}[option]  # fmt: skip
    return [tuple(args[i + 1 : i + 1 + width]) for i, a in enumerate(args) if a == option]


def env_of(args: list[str]) -> dict[str, str]:
    return dict(pairs(args, "--setenv"))  # type: ignore[arg-type]


def build(
    s: SandboxSpec, dev: Path | None = DEV, lease: Lease | None = None, runtime: Path | None = None
) -> tuple[list[str], list[str]]:
    fixed = argv.fixed_args(ROOT, runtime, ["lib", "lib64"])
    return argv.bwrap_args(s, fixed, dev, runtime, lease)


# -- bwrap's command line -----------------------------------------------------------------------


def test_the_fixed_options_isolate_every_namespace_and_bind_a_read_only_root() -> None:
    fixed = argv.fixed_args(ROOT, None, ["lib"])
    flags = ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
             "--unshare-cgroup-try", "--die-with-parent", "--new-session"]  # fmt: skip
    assert set(flags) <= set(fixed)
    assert ("--uid", "1000") == tuple(fixed[fixed.index("--uid") : fixed.index("--uid") + 2])
    assert pairs(fixed, "--ro-bind") == [(str(ROOT), "/"), ("/usr", "/usr"), ("/lib", "/lib")]
    assert fixed[-2:] == ["--proc", "/proc"]
    assert "--disable-userns" not in fixed  # (the seccomp filter refuses new user namespaces)


def test_a_runtime_tree_is_bound_read_only_and_first_on_path() -> None:
    runtime = Path("/opt/rt")
    assert (str(runtime), RUNTIME) in pairs(argv.fixed_args(ROOT, runtime, []), "--ro-bind")
    options, _ = build(spec(), runtime=runtime)
    assert env_of(options)["PATH"] == f"{RUNTIME}/bin:{argv.BASE_ENV['PATH']}"
    assert env_of(build(spec())[0])["PATH"] == argv.BASE_ENV["PATH"]


def test_root_tops_are_the_host_directories_that_exist() -> None:
    for top in argv.root_tops():
        assert os.path.isdir(f"/{top}") and not os.path.islink(f"/{top}")


def test_a_plain_sandbox_gets_its_workspace_tmp_and_prebuilt_dev() -> None:
    limits = SandboxLimits(tmp_size_mb=32)
    options, command = build(spec(limits=limits, cwd="/workspace/sub"))
    tmp = str(32 * MIB)
    assert pairs(options, "--dev-bind") == [(str(DEV), "/dev")]
    assert "--dev" not in options
    i = options.index("--tmpfs")
    assert options[i - 2 : i + 2] == ["--size", tmp, "--tmpfs", "/tmp"]
    assert ("/srv/ws/a", WORKSPACE) in pairs(options, "--bind")
    assert pairs(options, "--chdir") == [("/workspace/sub",)]
    assert "--clearenv" in options and "--as-pid-1" not in options
    assert options[-4:] == ["--seccomp", str(argv.SECCOMP_FD), "--json-status-fd",
                            str(argv.STATUS_FD)]  # fmt: skip
    assert command == ["/usr/bin/python3", "-c", "print(1)"]


def test_without_a_prebuilt_dev_bwraps_dev_is_small_read_only_and_hides_its_ptys() -> None:
    options, _ = build(spec(limits=SandboxLimits(tmp_size_mb=8)), dev=None)
    assert pairs(options, "--dev") == [("/dev",)]
    assert ("/dev/shm",) in pairs(options, "--tmpfs") and ("/dev/pts",) in pairs(options, "--tmpfs")
    assert pairs(options, "--remount-ro") == [("/dev",), ("/dev/pts",)]
    i = options.index("/dev/shm")
    assert options[i - 3 : i - 1] == ["--size", str(8 * MIB)]


def test_pseudo_terminals_get_bwraps_dev_with_its_devpts_even_with_a_prebuilt_one() -> None:
    options, _ = build(spec(limits=SandboxLimits(pseudo_terminals=True)))
    assert "--dev-bind" not in options and pairs(options, "--dev") == [("/dev",)]
    assert ("/dev/pts",) not in pairs(options, "--tmpfs")


def test_the_callers_variables_come_after_the_base_environment() -> None:
    options, _ = build(spec(env={"A": "1", "PATH": "/mine"}))
    names = [k for k, _ in pairs(options, "--setenv")]
    assert names[: len(argv.BASE_ENV)] == list(argv.BASE_ENV)
    assert env_of(options)["A"] == "1" and env_of(options)["PATH"] == "/mine"  # (last wins)


def test_a_shell_command_travels_in_the_environment_not_the_command_line() -> None:
    options, command = build(spec(argv=shell_argv("echo secret")))
    assert command == ["/bin/sh", "-c", argv.SHELL_SCRIPT]
    assert env_of(options)["__srt_cmd"] == "echo secret"
    assert not any("secret" in part for part in command)
    assert argv.command_of(["/bin/sh", "-c", "x", "y"]) == (["/bin/sh", "-c", "x", "y"], {})


def test_an_interpreters_kernel_dir_is_bound_read_write() -> None:
    options, _ = build(spec(kernel_dir=Path("/run/k1")))
    assert ("/run/k1", KERNEL_DIR) in pairs(options, "--bind")


def test_with_egress_the_relay_is_init_and_the_command_goes_to_it_on_its_fd() -> None:
    lease = Lease(Path("/private/egress/s1"))
    s = spec(env={"LD_PRELOAD": "/x.so"})
    options, command = build(s, lease=lease)
    assert ("/private/egress/s1", SOCKET_DIR) in pairs(options, "--ro-bind")
    assert options[options.index(SOCKET_DIR) + 1] == "--as-pid-1"
    env = env_of(options)
    assert "LD_PRELOAD" not in env  # (never loaded into the relay)
    for key, value in argv.EGRESS_ENV.items():
        assert env[key] == value
    assert env["HTTPS_PROXY"] == f"http://127.0.0.1:{RELAY_PORT}"
    assert command == ["/usr/bin/perl", RELAY_PATH, f"{SOCKET_DIR}/{SOCKET_NAME}",
                       str(RELAY_PORT), str(PRCTL_SYSCALL)]  # fmt: skip
    # The command and the caller's variables reach only the command, through the relay's fd.
    fields = argv.stub_command(s).split(b"\0")
    assert fields[:4] == [WORKSPACE.encode(), b"n", b"2", b"3"]
    assert fields[4:8] == [b"LANG", b"C.UTF-8", b"LD_PRELOAD", b"/x.so"]  # (LANG: held too)
    assert fields[8:11] == [b"/usr/bin/python3", b"-c", b"print(1)"]
    assert "LANG" not in env
    assert "SSL_CERT_FILE" not in env  # (no secret rules: the host's trust store as it is)


def test_perls_loaders_and_locales_variables_of_an_environment_go_to_the_command_only() -> None:
    """PERL5OPT or LD_PRELOAD of an environment's would load into the relay or the stub (the
    host's Perl), its LANG make that Perl warn: the command gets them with the caller's."""
    held = argv.relay_held({"PATH": "/bin", "PERL5OPT": "-Mx", "PERL5LIB": "/l", "LANG": "x",
                            "LD_PRELOAD": "/p.so", "LC_ALL": "y", "HOME": "/h"})  # fmt: skip
    assert held == {"PERL5OPT": "-Mx", "PERL5LIB": "/l", "LANG": "x", "LD_PRELOAD": "/p.so",
                    "LC_ALL": "y"}  # fmt: skip


def test_with_secret_rules_the_trust_bundle_is_the_system_store() -> None:
    lease = Lease(Path("/private/egress/s1"), Path("/private/egress-trust/ca-certificates.crt"))
    options, _ = build(spec(), lease=lease)
    bundle = "/etc/ssl/certs/ca-certificates.crt"
    assert ("/private/egress-trust/ca-certificates.crt", bundle) in pairs(options, "--ro-bind")
    env = env_of(options)
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
                 "PIP_CERT", "GIT_SSL_CAINFO"):  # fmt: skip
        assert env[name] == bundle, name


def test_bwrap_reads_its_options_from_a_descriptor() -> None:
    assert argv.bwrap_command("/usr/bin/bwrap", ["/bin/true"]) == [
        "/usr/bin/bwrap", "--args", str(argv.ARGS_FD), "--", "/bin/true"]  # fmt: skip
    assert argv.nul_terminated(["a", "é", ""]) == b"a\0\xc3\xa9\0\0"


def parse_stub_command(data: bytes) -> tuple[str, bool, dict[str, str], list[str]]:
    """What argv.STUB_PROGRAM makes of its command (as its Perl does)."""
    fields = data.decode().split("\0")
    assert fields.pop() == ""
    cwd, interactive, n, m = fields[:4]
    rest = fields[4:]
    assert len(rest) == 2 * int(n) + int(m)
    env = dict(zip(rest[0 : 2 * int(n) : 2], rest[1 : 2 * int(n) : 2], strict=True))
    return cwd, interactive == "i", env, rest[2 * int(n) :]


def test_the_stub_is_handed_the_directory_stdin_variables_and_argv() -> None:
    data = argv.stub_command(spec(argv=shell_argv("ls"), env={"A": "b"}, cwd="/tmp"))
    cwd, interactive, env, command = parse_stub_command(data)
    assert (cwd, interactive) == ("/tmp", False)
    assert env == {"LANG": "C.UTF-8", "A": "b", "__srt_cmd": "ls"}  # (LANG: not the stub's)
    assert command == ["/bin/sh", "-c", argv.SHELL_SCRIPT]
    _, interactive, env, command = parse_stub_command(argv.stub_command(spec(interactive=True)))
    assert interactive and env == {"LANG": "C.UTF-8"}
    assert command == ["/usr/bin/python3", "-c", "print(1)"]


def test_rlimits_follow_the_limits_and_fall_back_to_address_space_without_a_memory_cgroup() -> None:
    limits = SandboxLimits(cpu_time_seconds=7, file_size_mb=3, open_files=50, memory_mb=100)
    got = {r: (soft, hard) for r, soft, hard in argv.rlimits(limits, memory_cgroup=True)}
    assert got[resource.RLIMIT_CPU] == (7, 8)
    assert got[resource.RLIMIT_FSIZE] == (3 * MIB, 3 * MIB)
    assert got[resource.RLIMIT_NOFILE] == (50, 50)
    assert got[resource.RLIMIT_CORE] == (0, 0)
    assert resource.RLIMIT_AS not in got
    without = {r: (s, h) for r, s, h in argv.rlimits(limits, memory_cgroup=False)}
    assert without[resource.RLIMIT_AS] == (100 * MIB, 100 * MIB)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY:
        huge = replace(limits, open_files=hard + 1)
        nofile = {r: s for r, s, _ in argv.rlimits(huge, memory_cgroup=True)}
        assert nofile[resource.RLIMIT_NOFILE] == hard


# -- what a caller may ask for ------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [[], [""], ["a\x00b"], ["x" * (MAX_COMMAND_BYTES + 1)], ["x" * MAX_COMMAND_BYTES] * 5],
)
def test_commands_the_kernel_or_bwrap_would_refuse_are_refused(bad: list[str]) -> None:
    with pytest.raises(InvalidRequestError):
        validate_command(bad)


def test_a_command_up_to_the_limits_is_taken() -> None:
    validate_command(["x" * MAX_COMMAND_BYTES] * 4)


@pytest.mark.parametrize(
    "bad",
    [
        {"1A": "x"},
        {"A-B": "x"},
        {"A\n": "x"},
        {"__srt_cmd": "x"},
        {"A": "x\x00"},
        {"A": 1},
        {f"V{i}": "" for i in range(MAX_ENV_VARS + 1)},
        {"A": "x" * 70_000},
    ],
)
def test_environments_that_are_not_valid_are_refused(bad: dict[str, str]) -> None:
    with pytest.raises(InvalidRequestError):
        validate_env(bad)


def test_a_valid_environment_is_copied() -> None:
    env = {"A_1": "x", "_b": ""}
    assert validate_env(env) == env and validate_env(env) is not env
    assert validate_env(None) == {}


def test_the_working_directory_stays_in_the_workspace_or_tmp() -> None:
    assert sandbox_cwd(None) == WORKSPACE
    assert sandbox_cwd("sub/dir") == f"{WORKSPACE}/sub/dir"
    assert sandbox_cwd("/tmp/x/../y") == "/tmp/y"
    for bad in ("..", "/etc", "/workspacex", "/tmp/../etc", "a\x00"):
        with pytest.raises(InvalidRequestError):
            sandbox_cwd(bad)


# -- cgroup arithmetic ----------------------------------------------------------------------------


def test_v2_limits_cover_the_enabled_controllers() -> None:
    limits = SandboxLimits(memory_mb=64, pids=20, cpu_cores=0.5)
    assert limit_values("v2", {"memory", "pids", "cpu"}, limits) == {
        "v2/memory.max": str(64 * MIB),
        "v2/memory.swap.max?": "0",
        "v2/memory.oom.group?": "1",
        "v2/pids.max": "20",
        "v2/cpu.max": f"50000 {CPU_PERIOD_US}",
    }
    assert limit_values("v2", {"memory", "pids"}, limits).keys() == {
        "v2/memory.max", "v2/memory.swap.max?", "v2/memory.oom.group?", "v2/pids.max"}  # fmt: skip
    assert limit_values("none", {"memory"}, limits) == {}


def test_v1_limits_and_a_cpu_quota_never_below_a_millisecond() -> None:
    limits = SandboxLimits(memory_mb=10, pids=5, cpu_cores=0.001)
    assert limit_values("v1", {"memory", "pids", "cpu"}, limits) == {
        "memory/memory.limit_in_bytes": str(10 * MIB),
        "memory/memory.memsw.limit_in_bytes?": str(10 * MIB),
        "pids/pids.max": "5",
        "cpu/cpu.cfs_period_us": str(CPU_PERIOD_US),
        "cpu/cpu.cfs_quota_us": "1000",
    }


def test_limit_writes_skip_what_is_so_and_raise_v1_memory_with_swap_first() -> None:
    low = limit_values("v1", {"memory", "pids"}, SandboxLimits(memory_mb=10, pids=5))
    high = limit_values("v1", {"memory", "pids"}, SandboxLimits(memory_mb=20, pids=5))
    assert [k for k, _ in limit_writes(low, {})] == list(low)
    assert limit_writes(low, dict(low)) == []
    rising = limit_writes(high, dict(low))
    assert [k for k, _ in rising] == [
        "memory/memory.memsw.limit_in_bytes?", "memory/memory.limit_in_bytes"]  # fmt: skip
    falling = limit_writes(low, dict(high))
    assert [k for k, _ in falling] == [
        "memory/memory.limit_in_bytes", "memory/memory.memsw.limit_in_bytes?"]  # fmt: skip


def test_counters_count_from_the_baseline_but_peak_memory_does_not() -> None:
    now = CgroupStats(oom_kills=3, pids_limit_hits=5, cpu_usage_ns=900, memory_peak_bytes=70)
    base = CgroupStats(oom_kills=1, pids_limit_hits=5, cpu_usage_ns=100, memory_peak_bytes=50)
    assert now.since(base) == CgroupStats(2, 0, 800, 70)


def test_an_execution_cgroup_writes_only_the_limit_files_that_change(tmp_path: Path) -> None:
    files = ["memory.max", "memory.swap.max", "pids.max", "cpu.max"]  # (no memory.oom.group)
    for name in files:
        (tmp_path / name).write_text("")
    layout = CgroupLayout(version="v2", v2_controllers=frozenset({"memory", "pids", "cpu"}))
    group = ExecutionCgroup(layout, v2_dir=tmp_path)
    group.apply(SandboxLimits(memory_mb=1, pids=7, cpu_cores=2))
    assert (tmp_path / "memory.max").read_text() == str(MIB)
    assert (tmp_path / "cpu.max").read_text() == f"200000 {CPU_PERIOD_US}"
    (tmp_path / "memory.max").write_text("untouched")
    group.apply(SandboxLimits(memory_mb=1, pids=8, cpu_cores=2))
    assert (tmp_path / "memory.max").read_text() == "untouched"
    assert (tmp_path / "pids.max").read_text() == "8"
    assert group.procs_files == [str(tmp_path / "cgroup.procs")]


# -- what /proc says ------------------------------------------------------------------------------

MOUNTINFO = [
    "29 1 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
    "30 1 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
    "31 1 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n",
    "32 1 0:29 / /proc rw - proc proc rw\n",
]


def test_mountinfo_gives_the_unified_mount_and_each_v1_controllers() -> None:
    unified, v1 = parse_mounts(MOUNTINFO)
    assert unified == Path("/sys/fs/cgroup")
    assert v1 == {
        "memory": Path("/sys/fs/cgroup/memory"),
        "cpu": Path("/sys/fs/cgroup/cpu,cpuacct"),
        "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct"),
    }
    assert parse_mounts(MOUNTINFO[3:]) == (None, {})
    assert parse_mount_options(MOUNTINFO)[0] == (Path("/sys/fs/cgroup"), "cgroup2",
                                                 ["rw", "nsdelegate"])  # fmt: skip
    assert len(parse_mount_options(MOUNTINFO)) == 3


def test_proc_cgroup_gives_the_unified_path_and_each_v1_controllers() -> None:
    lines = ["12:pids:/srv/a\n", "4:cpu,cpuacct:/srv/b\n", "1:name=systemd:/x\n", "0::/srv/u\n"]
    assert parse_own_paths(lines) == ("/srv/u", {"pids": "/srv/a", "cpu": "/srv/b",
                                                 "cpuacct": "/srv/b"})  # fmt: skip
    assert parse_own_paths(["0::/\n"]) == ("/", {})


def test_keyed_counter_files() -> None:
    assert keyed("oom 0\noom_kill 2\nbad x\n\nmax 7") == {"oom": 0, "oom_kill": 2, "max": 7}


def test_a_start_time_is_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    fields = " ".join(str(n) for n in range(3, 30))  # state ppid ... (field 22 is "21")
    assert start_time_of(f"42 (a b) c) {fields}") == 22
    assert start_time_of("42 (x) S 1") is None
    assert start_time_of("") is None


def test_a_parent_groups_owner_is_gone_only_when_its_process_is() -> None:
    own = instance_name("srt-test")
    assert INSTANCE_NAME.fullmatch(own) and INSTANCE_NAME.fullmatch(f"{own}-server")
    assert not owner_gone(own)
    pid, start = os.getpid(), own.split(".")[2]
    ns = pid_namespace()
    assert owner_gone(f"srt-test.{pid}.{int(start) + 1}.{ns}")  # (the pid, reused)
    assert not owner_gone(f"srt-test.{pid}.{int(start) + 1}.{ns + 1}")  # another namespace's
    assert not owner_gone("srt-test")  # (an older server's: no owner in the name)
    assert not owner_gone("other.1.2.3")


def test_only_zombie_bwraps_of_the_sandbox_uid_are_orphans_to_reap() -> None:
    status = "Name:\tbwrap\nState:\tZ (zombie)\nUid:\t1001\t1001\t1001\t1001\n"
    assert is_zombie_bwrap(status, 1001)
    assert not is_zombie_bwrap(status, 1002)
    assert not is_zombie_bwrap(status.replace("Z (zombie)", "S (sleeping)"), 1001)
    assert not is_zombie_bwrap(status.replace("bwrap", "python3"), 1001)
    assert not is_zombie_bwrap("Name:\tbwrap\nState:\tZ\n", 1001)


# -- descriptors --------------------------------------------------------------------------------


def test_a_sandboxs_descriptors_are_in_bwraps_order(tmp_path: Path) -> None:
    seccomp = tmp_path / "seccomp.bpf"
    seccomp.write_bytes(b"")
    command_r, command_w = os.pipe()
    given: list[int] = []
    fds = sandbox_fds(True, seccomp, 100_000, command_r, given.append)
    try:
        assert len(fds.ours) == 4 and len(fds.theirs) == 8  # stdin..args_r, command, args_w
        assert fds.theirs[6] == command_r
        assert given == [fds.theirs[0], fds.theirs[1], fds.theirs[2]]  # the stdio pipes
        assert os.readlink(f"/proc/self/fd/{fds.theirs[3]}") == str(seccomp)
        assert os.fstat(fds.theirs[-1]).st_size == 0
    finally:
        for fd in fds.ours + fds.theirs + [command_w]:
            os.close(fd)
    plain = sandbox_fds(False, seccomp, 10, None, given.append)
    try:
        assert len(plain.ours) == 3 and len(plain.theirs) == 7
        assert os.readlink(f"/proc/self/fd/{plain.theirs[0]}") == os.devnull
    finally:
        for fd in plain.ours + plain.theirs:
            os.close(fd)


def test_a_failure_making_the_descriptors_closes_them_and_the_command_pipe(
    tmp_path: Path,
) -> None:
    command_r, command_w = os.pipe()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        sandbox_fds(False, tmp_path / "missing.bpf", 10, command_r, lambda _: None)
    assert len(os.listdir("/proc/self/fd")) == before - 1  # (command_r: consumed)
    with pytest.raises(OSError):
        os.fstat(command_r)
    os.close(command_w)


def test_a_command_bigger_than_a_pipe_is_written_at_once() -> None:
    r, w = os.pipe()
    try:
        payload = b"x" * 200_000
        write_at_once(w, payload)
        os.close(w)
        w = -1
        got = b""
        while chunk := os.read(r, 1 << 20):
            got += chunk
        assert got == payload
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
