"""bubblewrap's command line for a sandbox, built from its spec: the options every sandbox
shares, each sandbox's own, the environment it starts with, its rlimits, and the command
handed to a sandbox started ahead of need. Nothing here starts, opens or changes anything
(`root_tops` and `rlimits` only look at the host's directories and descriptor limit)."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from sandbox_runtime.domain.limits import MIB, SandboxLimits
from sandbox_runtime.sandbox.egress_port import (
    RELAY_PORT,
    SOCKET_DIR,
    SOCKET_NAME,
    TRUST_BUNDLE,
    EgressLease,
)
from sandbox_runtime.sandbox.host import (
    BRIDGE_DIR,
    KERNEL_DIR,
    PRCTL_SYSCALL,
    RELAY_PATH,
    ROOT_TOPS,
    RUNTIME,
    SANDBOX_UID,
    SERVER_DIR,
    STUB_PERL,
    WORKSPACE,
)
from sandbox_runtime.sandbox.spec import HOST_DIR, ImageLayout, SandboxSpec

# How a sandbox starts: the spawner (spawner.py, already the unprivileged sandbox uid with
# no capabilities and no_new_privs) starts bwrap with fds the server made; bwrap first waits
# for its options (--args: host paths, the caller's environment and code never show in a
# command line). Meanwhile the spawner lowers bwrap's rlimits and moves it into the
# execution's cgroups (through cgroup.procs files the server opened), and only then writes
# the options: everything bwrap starts inherits the limits and the cgroups. One turn of the
# spawner, no round trip through the server before bwrap may go on.
# Fds of bwrap as the spawner sets them up: 0-2 stdio, then these.
SECCOMP_FD, STATUS_FD, ARGS_FD = 3, 4, 5
# A shell command is run by /bin/sh like `sh -c CMD`, but CMD comes in __srt_cmd, which is
# gone from the environment before it runs (and CMD never shows in a command line).
SHELL_SCRIPT = '__srt_c=$__srt_cmd; unset __srt_cmd; eval "$__srt_c"'

# A sandbox started ahead of need (sandbox/pool.py) runs this stub, Perl's (perl-base is
# essential on Debian and Ubuntu: every host has it, and it starts in ~1 ms): it waits on fd
# COMMAND_FD for its command, then does what bwrap would have done with it (stdin from
# /dev/null unless interactive, chdir, the caller's variables, PWD set to the directory after
# them as bwrap sets it, execvp) with bwrap's own errors and exit code. The command comes as
# NUL-terminated fields: the directory, "i" or "n" (interactive), the number of variables,
# the number of argv items, then each name and value, then the argv; anything but exactly
# that (a command cut short) runs nothing (exit 125). Nothing else runs in the sandbox before
# it has the command; fd COMMAND_FD is closed before the exec.
COMMAND_FD = 6
STUB_PROGRAM = (
    'open(my $c, "<&=", 6) or exit 125; local $/; my $d = <$c>; close $c;'
    " defined $d and length $d or exit 125; my @f = split /\\0/, $d, -1; pop @f;"
    " my ($cwd, $in, $n, $m) = splice @f, 0, 4;"
    " defined $m and $m > 0 and @f == 2 * $n + $m or exit 125;"
    ' if ($in ne "i") { open(STDIN, "<", "/dev/null") or exit 125 }'
    ' chdir $cwd or do { print STDERR "bwrap: Can\\x27t chdir to $cwd: $!\\n"; exit 1 };'
    " for (1 .. $n) { my $k = shift @f; $ENV{$k} = shift @f } $ENV{PWD} = $cwd;"
    ' exec { $f[0] } @f; print STDERR "bwrap: execvp $f[0]: $!\\n"; exit 1;'
)

_PROXY_URL = f"http://127.0.0.1:{RELAY_PORT}"
# What programs read to find a proxy: curl, wget, pip, git, requests, Deno, npm, Node (24+).
EGRESS_ENV = {
    **{name: _PROXY_URL for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
                                     "https_proxy", "all_proxy", "npm_config_proxy",
                                     "npm_config_https_proxy")},
    "NO_PROXY": "localhost,127.0.0.1,::1",
    "no_proxy": "localhost,127.0.0.1,::1",
    "NODE_USE_ENV_PROXY": "1",
}  # fmt: skip
# Where programs look for CAs, when the proxy may terminate TLS (secret rules): the bundle
# bound at TRUST_BUNDLE has the host's CAs and the deployment's (certifi, Node and pip carry
# their own lists otherwise).
TRUST_ENV = {
    name: TRUST_BUNDLE
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
                 "PIP_CERT", "GIT_SSL_CAINFO", "DENO_CERT", "AWS_CA_BUNDLE")
}  # fmt: skip

# What a program inside finds in its environment before the caller's variables.
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKSPACE,
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    "SHELL": "/bin/sh",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "TERM": "dumb",
    "PYTHONUNBUFFERED": "1",
}


def command_of(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """What bwrap execs for `argv`, and the variables it needs: a shell command's text goes in
    __srt_cmd (never in a command line)."""
    if len(argv) == 3 and argv[:2] == ["/bin/sh", "-c"]:
        return ["/bin/sh", "-c", SHELL_SCRIPT], {"__srt_cmd": argv[2]}
    return list(argv), {}


def root_tops() -> list[str]:
    """The host's top-level directories bound into every sandbox (those that exist here)."""
    return [top for top in ROOT_TOPS if os.path.isdir(f"/{top}") and not os.path.islink(f"/{top}")]


def fixed_args(
    root_dir: Path, runtime_dir: Path | None, tops: list[str], image: ImageLayout | None = None
) -> list[str]:
    """The options every sandbox shares: `root_dir` is the root built at start, `runtime_dir`
    the runtime tree (if any), `tops` what `root_tops()` found; on an environment, `image`
    (its root and binds) in place of all three."""
    args = [
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        # No --disable-userns: the seccomp filter already refuses every way to a new
        # user namespace (unshare, clone with CLONE_NEWUSER, clone3), and the nested
        # namespace bwrap would make for it costs ~0.35 ms per start.
        "--die-with-parent",
        "--new-session",
        "--uid", str(SANDBOX_UID),
        "--gid", str(SANDBOX_UID),
        "--hostname", "sandbox",
        # The root is a read-only bind of a directory built at start: /etc, the merged-usr
        # symlinks and the mount points, in one mount (each mount costs bwrap ~0.1-0.3 ms
        # per sandbox; a read-only root needs no remount).
    ]  # fmt: skip
    if image is not None:  # (bwrap's binds are all nosuid and nodev)
        args += ["--ro-bind", str(image.root_dir), "/"]
        for source, inside in image.binds:
            args += ["--ro-bind", source, inside]
        # The host's /usr and the runtime, out of the way, for what runs on the host's Python
        # in every environment: the egress relay, the kernels' pipe (image_root.py).
        args += ["--ro-bind", "/usr", f"{HOST_DIR}/usr"]
        if runtime_dir is not None:
            args += ["--ro-bind", str(runtime_dir), RUNTIME]
        return [*args, "--proc", "/proc"]
    args += ["--ro-bind", str(root_dir), "/", "--ro-bind", "/usr", "/usr"]
    if runtime_dir is not None:
        args += ["--ro-bind", str(runtime_dir), RUNTIME]
    for top in tops:
        host = f"/{top}"
        args += ["--ro-bind", host, host]
    args += ["--proc", "/proc"]
    return args


def bwrap_args(
    spec: SandboxSpec,
    fixed: list[str],
    dev_dir: Path | None,
    runtime_dir: Path | None,
    lease: EgressLease | None = None,
    image: ImageLayout | None = None,
    relay_perl: list[str] | None = None,
) -> tuple[list[str], list[str]]:
    """bubblewrap's options for `spec` and the command it runs: `fixed` (fixed_args) first,
    `dev_dir` the /dev built at start (None: bwrap builds one), through the egress relay when
    `lease` is this sandbox's socket on the proxy: then the command is the relay's, and
    `spec`'s own (its argv, the caller's variables) goes to it on fd COMMAND_FD
    (`relay_command`). On an environment (`image`, whose `fixed` these are) the relay runs as
    `relay_perl` (the host's Perl through the host's loader, ImageRoots.stub_perl)."""
    tmp_size = str(spec.limits.tmp_size_mb * MIB)
    args = fixed.copy()
    if dev_dir is not None and not spec.limits.pseudo_terminals:
        # A /dev built at start (root-owned: the sandbox user cannot change it; the only
        # device nodes on it are ours; /dev/shm links to /tmp): one bind, where --dev
        # costs bwrap a tmpfs, six binds and a devpts, ~1.5 ms of CPU per sandbox.
        args += ["--dev-bind", str(dev_dir), "/dev"]
    else:
        # --dev's tmpfs (and /dev/shm in it) is writable and as big as half the RAM:
        # bound /dev/shm like /tmp and make the rest of /dev read-only.
        args += ["--dev", "/dev", "--size", tmp_size, "--tmpfs", "/dev/shm"]
        args += ["--remount-ro", "/dev"]
        if not spec.limits.pseudo_terminals:  # (a server that could not prebuild /dev)
            # An empty read-only tmpfs hides --dev's devpts: /dev/ptmx leads nowhere.
            args += ["--size", "4096", "--tmpfs", "/dev/pts", "--remount-ro", "/dev/pts"]
    args += [
        "--size", tmp_size, "--tmpfs", "/tmp",
        "--bind", str(spec.workspace), WORKSPACE,
    ]  # fmt: skip
    if spec.kernel_dir is not None:
        args += ["--bind", str(spec.kernel_dir), KERNEL_DIR]
    if spec.server_dir is not None:
        args += ["--ro-bind", str(spec.server_dir), SERVER_DIR]
    if spec.bridge_dir is not None:  # (and its JavaScript package where imports find it)
        args += ["--ro-bind", str(spec.bridge_dir), BRIDGE_DIR]
        args += ["--ro-bind", str(spec.bridge_dir / "node_modules"), "/node_modules"]
    if lease is not None:
        # Read-only: the socket is connectable (a socket's permission is not the mount's)
        # but the sandbox cannot put another in its place. The relay is init: no bwrap
        # init above it, so the relay is what the command cannot signal.
        args += ["--ro-bind", str(lease.host_dir), SOCKET_DIR, "--as-pid-1"]
        if lease.trust_bundle is not None:
            args += ["--ro-bind", str(lease.trust_bundle), TRUST_BUNDLE]
    cwd = spec.cwd
    if image is not None and cwd == WORKSPACE:
        cwd = image.cwd
    args += ["--chdir", cwd, "--clearenv"]
    start_env = base_env(runtime_dir) if image is None else {**BASE_ENV, **dict(image.env)}
    ours = lease is not None or spec.argv[-1:] == [STUB_PROGRAM]  # (the relay, the stub)
    held = relay_held(start_env) if ours else {}
    for key, value in start_env.items():
        if key not in held:
            args += ["--setenv", key, value]
    if lease is not None:
        for key, value in EGRESS_ENV.items():
            args += ["--setenv", key, value]
        if lease.trust_bundle is not None:
            for key, value in TRUST_ENV.items():
                args += ["--setenv", key, value]
    # The caller's variables act on the command only: bwrap execs nothing else, and the
    # rlimits are in place before the command starts. With egress, bwrap execs the relay:
    # the command, with the caller's variables, is handed to it on fd COMMAND_FD (an
    # LD_PRELOAD of the caller's must not load into the relay).
    if lease is not None:
        socket_path = f"{SOCKET_DIR}/{SOCKET_NAME}"
        perl = [STUB_PERL] if image is None else list(relay_perl or [STUB_PERL])
        command = [*perl, RELAY_PATH, socket_path, str(RELAY_PORT), str(PRCTL_SYSCALL or 0)]
    else:
        for key, value in spec.env.items():
            args += ["--setenv", key, value]
        command, extra = command_of(spec.argv)
        for key, value in extra.items():
            args += ["--setenv", key, value]
    args += ["--seccomp", str(SECCOMP_FD), "--json-status-fd", str(STATUS_FD)]
    return args, command


def base_env(runtime_dir: Path | None) -> dict[str, str]:
    """The environment a sandbox starts with (the runtime's bin first on PATH, if any)."""
    if runtime_dir is None:
        return BASE_ENV
    return {**BASE_ENV, "PATH": f"{RUNTIME}/bin:{BASE_ENV['PATH']}"}


def bwrap_command(bwrap: str, command: list[str]) -> list[str]:
    """bwrap's own argv: its options come on fd ARGS_FD, never in a command line."""
    return [bwrap, "--args", str(ARGS_FD), "--", *command]


def nul_terminated(items: list[str]) -> bytes:
    """`items`, each NUL-terminated, as bwrap's --args and the stub read them."""
    return b"".join(item.encode("utf-8", "surrogatepass") + b"\0" for item in items)


# What acts on a Perl (ours, the relay's or the stub's, run through the host's loader) as it
# starts: the loader's variables, Perl's, the locale's (an environment's LANG names a locale
# its root may lack: Perl then warns on the command's stderr) and glibc's others.
_HELD_PREFIXES = ("PERL", "LD_", "LC_", "MALLOC_")
_HELD_NAMES = frozenset({"LANG", "LANGUAGE", "LOCPATH", "GCONV_PATH", "GLIBC_TUNABLES", "NLSPATH",
                         "TZDIR", "HOSTALIASES", "LOCALDOMAIN", "RES_OPTIONS", "RESOLV_HOST_CONF",
                         "GETCONF_DIR", "NIS_PATH"})  # fmt: skip


def relay_held(start_env: dict[str, str]) -> dict[str, str]:
    """The variables of a sandbox's start environment (ours, or an environment's) that the
    relay and the stub of a sandbox started ahead must not start with: an environment's
    LD_PRELOAD or PERL5OPT is for its own programs, not the host's Perl. The command gets
    them with the caller's (`stub_command`)."""
    return {
        key: value
        for key, value in start_env.items()
        if key.startswith(_HELD_PREFIXES) or key in _HELD_NAMES
    }


def stub_command(spec: SandboxSpec) -> bytes:
    """What a sandbox started ahead is handed on fd COMMAND_FD to run `spec`'s command (the
    fields STUB_PROGRAM reads), as the egress relay is too, with the variables they did not
    start with (`relay_held`)."""
    command, extra = command_of(spec.argv)
    start = BASE_ENV if spec.image is None else {**BASE_ENV, **dict(spec.image.env)}
    held = relay_held(start)  # (as bwrap_args held them from the relay and the stub)
    env = {**held, **spec.env, **extra}
    fields = [spec.cwd, "i" if spec.interactive else "n", str(len(env)), str(len(command))]
    for key, value in env.items():
        fields += [key, value]
    return nul_terminated(fields + command)


def rlimits(limits: SandboxLimits, memory_cgroup: bool) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) the command runs under; the second layer under the cgroup
    (`memory_cgroup`: one limits its memory; else its address space is limited instead).

    The spawner sets them on bwrap before bwrap reads its options, so the whole sandbox
    inherits them; the sandbox user cannot raise them again.
    """
    nofile = limits.open_files
    nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if nofile_hard != resource.RLIM_INFINITY:
        nofile = min(nofile, nofile_hard)
    out = [
        (resource.RLIMIT_CPU, limits.cpu_time_seconds, limits.cpu_time_seconds + 1),
        (resource.RLIMIT_FSIZE, limits.file_size_mb * MIB, limits.file_size_mb * MIB),
        (resource.RLIMIT_NOFILE, nofile, nofile),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if not memory_cgroup:
        out.append((resource.RLIMIT_AS, limits.memory_mb * MIB, limits.memory_mb * MIB))
    return out
