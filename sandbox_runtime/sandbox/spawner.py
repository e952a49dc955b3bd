"""The spawner: a small long-lived process, already the unprivileged sandbox uid, that starts bwrap.

Why a process of its own: starting bwrap from the server meant forking a large process and
then exec'ing `setpriv` to drop to the sandbox uid, ~2.5 ms per sandbox. This process drops
its privileges once (no capabilities in any set, no_new_privs, the sandbox uid and gid, no
supplementary groups) and then starts each bwrap with posix_spawn (vfork + exec).

Run by the server as `python -I -S -B spawner.py FD UID GID PARENT_PID`, with FD one end of a
SOCK_SEQPACKET socketpair. Standard library only, and everything imported before the drop:
afterwards this process may not be able to read the server's installation.

Protocol, one message each way per event, JSON; the server's requests carry fds (SCM_RIGHTS),
the spawner's answers never do (fds in flight count against the sender's uid, which the
sandboxes share: they could make such a send fail):
- server -> spawner `{"spawn": N, "rlimits": [[RESOURCE, SOFT, HARD], ...], "argv_bytes": A,
  "child_fds": C}` + fds [memfd, stdin, stdout, stderr, seccomp, status, options_r,
  (command_r,) options_w, cgroup.procs...]: the memfd holds bwrap's argv (its first A bytes,
  NUL-separated) and then bwrap's options; the next C fds (6, or 7 for a sandbox started ahead
  of need, whose fd 6 is the pipe its command comes on) become fds 0..C-1 of the new bwrap (its
  argv names 3-5); options_w is the other end of fd 5; then up to MAX_CGROUPS cgroup.procs
  files the server opened (as root)
  for the execution's cgroups. bwrap first waits for its options on fd 5 (--args, read to
  EOF). Meanwhile the spawner lowers its rlimits (prlimit: same uid, no privilege needed) and
  moves it into the cgroups (the kernel checks a cgroup.procs write against the credentials
  the file was opened with); only then does it write the options. Everything in the sandbox
  inherits the limits and the cgroups; if any step fails, bwrap is killed before it has any.
- spawner -> server `{"spawned": N, "pid": P}` or `{"spawned": N, "error": E}`.
- spawner -> server `{"exited": P, "status": S}` (a wait status) when bwrap P has ended.
- first message `{"ready": true}` or `{"ready": false, "error": E}`.
The spawner exits when the server's end closes; its bwraps die with it (--die-with-parent).
It is a child subreaper: bwrap's reparented in-sandbox inits are reaped here.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import json
import os
import resource
import selectors
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
CHILD_FDS = 6  # stdin, stdout, stderr, seccomp, status, options -> fds 0..5 of bwrap
MAX_CHILD_FDS = 7  # (+ the command pipe of a sandbox started ahead of need, fd 6)
MAX_CGROUPS = 8  # cgroup.procs files: one per hierarchy
MAX_FDS = 1 + MAX_CHILD_FDS + 1 + MAX_CGROUPS  # the memfd, bwrap's, options_w, cgroups
# rlimits are bounded so a bad value is refused here, not by an OverflowError in prlimit.
MAX_RLIMIT = 2**62
RLIMITS = frozenset(
    {resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE, resource.RLIMIT_CORE}
    | {resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_DATA, resource.RLIMIT_STACK}
)
RESERVED_FDS = 16  # the spawner keeps fds 0..15 occupied so received fds never collide
LAUNCH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
# Signals Python ignores at start-up; ignored signals survive exec, so bwrap (and the command
# it runs) would inherit them: a command over its file size limit must die of SIGXFSZ.
RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _prctl(libc: ctypes.CDLL, option: int, arg: int = 0, arg3: int = 0) -> None:
    if libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(arg3), 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {arg}): {os.strerror(errno)}")


def _status_fields() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return {key: value.strip() for key, _, value in (line.partition(":") for line in f) if key}


def drop_privileges(libc: ctypes.CDLL, uid: int, gid: int) -> None:
    """Become uid/gid with no capabilities, no_new_privs and a parent-death signal.

    Raises OSError (a step failed) or RuntimeError (the result is not what it must be).
    """
    _prctl(libc, PR_SET_CHILD_SUBREAPER, 1)
    was_root = os.geteuid() == 0
    if was_root:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
        for cap in range(last_cap + 1):
            _prctl(libc, PR_CAPBSET_DROP, cap)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    # Leaving root cleared the permitted and effective sets; clear inheritable and ambient too.
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"capset: {os.strerror(errno)}")
    _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)
    _prctl(libc, PR_SET_DUMPABLE, 0)
    fields = _status_fields()
    expected_ids = f"{uid}\t{uid}\t{uid}\t{uid}", f"{gid}\t{gid}\t{gid}\t{gid}"
    if (fields.get("Uid"), fields.get("Gid")) != expected_ids:
        raise RuntimeError(f"ids after the drop: uid {fields.get('Uid')} gid {fields.get('Gid')}")
    if was_root and fields.get("Groups", "") != "":
        raise RuntimeError(f"supplementary groups left after the drop: {fields.get('Groups')}")
    for name in ("CapInh", "CapPrm", "CapEff", "CapAmb") + (("CapBnd",) if was_root else ()):
        if int(fields.get(name, "0"), 16) != 0:
            raise RuntimeError(f"capabilities left after the drop: {name} {fields.get(name)}")
    if fields.get("NoNewPrivs") != "1":
        raise RuntimeError("no_new_privs is not set")


class Spawner:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.children: set[int] = set()

    def send(self, doc: dict[str, object]) -> None:
        self.sock.send(json.dumps(doc).encode())

    def handle_request(self) -> bool:
        """Serve one message; False when the server's end is closed."""
        try:
            data, ancdata, flags, _ = self.sock.recvmsg(
                4096, socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
            )
        except InterruptedError:
            return True
        except OSError:  # the server's end is gone (reset when it died)
            return False
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds += array.array("i", payload[:usable]).tolist()
        try:
            if not data:
                return False
            try:
                request = json.loads(data)
                number = request.get("spawn")
                child_fds = request.get("child_fds", CHILD_FDS)
            except (ValueError, AttributeError):
                return True  # not from our server: nothing to answer
            if (
                flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC)
                or child_fds not in (CHILD_FDS, MAX_CHILD_FDS)
                or len(fds) < 1 + child_fds + 1
            ):
                self.send({"spawned": number, "error": "malformed spawn request"})
                return True
            try:
                pid = self.spawn(fds, request, child_fds)
            except Exception as exc:  # one bad request never ends the spawner
                self.send({"spawned": number, "error": f"could not start bwrap: {exc}"})
                return True
            self.send({"spawned": number, "pid": pid})
            return True
        finally:
            for fd in fds:
                os.close(fd)

    def spawn(self, fds: list[int], request: dict[str, object], count: int) -> int:
        """Start bwrap with `count` fds, lower its rlimits, move it into its cgroups, hand it
        its options; its pid. Raises OSError, ValueError (bwrap killed: it never got its
        options)."""
        memfd, *child_fds = fds[: 1 + count]
        options_w, cgroup_procs = fds[1 + count], fds[1 + count + 1 :]
        if len(cgroup_procs) > MAX_CGROUPS:
            raise ValueError(f"{len(cgroup_procs)} cgroup files; at most {MAX_CGROUPS}")
        rlimits = [tuple(item) for item in request["rlimits"]]  # type: ignore[attr-defined]
        for which, soft, hard in rlimits:
            if which not in RLIMITS or not 0 <= soft <= hard <= MAX_RLIMIT:
                raise ValueError(f"bad rlimit {which} {soft} {hard}")
        blob = os.pread(memfd, os.fstat(memfd).st_size, 0)
        argv_bytes = request["argv_bytes"]
        if not isinstance(argv_bytes, int) or not 0 < argv_bytes <= len(blob):
            raise ValueError(f"bad argv size {argv_bytes!r}")
        argv = [os.fsdecode(a) for a in blob[:argv_bytes].split(b"\0")[:-1]]
        options = memoryview(blob)[argv_bytes:]
        if not argv:
            raise ValueError("empty argv")
        actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(child_fds)]
        pid = os.posix_spawn(
            argv[0],
            argv,
            LAUNCH_ENV,
            file_actions=actions,
            setsid=True,
            setsigdef=RESET_SIGNALS,
            setsigmask=(),
        )
        self.children.add(pid)
        try:
            for which, soft, hard in rlimits:
                resource.prlimit(pid, which, (soft, hard))
            try:
                for procs in cgroup_procs:
                    os.write(procs, str(pid).encode())
            except OSError as exc:
                raise OSError(exc.errno, f"could not move it into its cgroup: {exc}") from exc
            # The server sized the pipe to hold them all: a write that would block is an error.
            os.set_blocking(options_w, False)
            while options:
                options = options[os.write(options_w, options) :]
        except BaseException:
            os.kill(pid, signal.SIGKILL)  # never let it run unlimited or outside its cgroups
            self.children.discard(pid)  # reaped, not reported: the server hears of an error
            raise
        return pid

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.children:  # an orphaned in-sandbox init is only reaped
                self.children.discard(pid)
                try:
                    self.send({"exited": pid, "status": status})
                except OSError:
                    return  # the server is gone; the main loop sees its end closed


def main(argv: list[str]) -> int:
    fd, uid, gid, parent = (int(a) for a in argv[1:5])
    libc = ctypes.CDLL(None, use_errno=True)
    # Occupy the low fds: received fds then never equal a dup2 target (posix_spawn's dup2 of
    # an fd onto itself would keep its close-on-exec flag).
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, RESERVED_FDS)
    os.close(fd)
    null = os.open("/dev/null", os.O_RDWR)
    for target in range(RESERVED_FDS):
        try:
            os.fstat(target)
        except OSError:
            os.dup2(null, target, inheritable=False)
    sock = socket.socket(fileno=high)
    spawner = Spawner(sock)
    os.chdir("/")
    try:
        drop_privileges(libc, uid, gid)
        _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the server died before the death signal was armed
            return 1
    except (OSError, RuntimeError, ValueError) as exc:
        spawner.send({"ready": False, "error": f"dropping privileges failed: {exc}"})
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    spawner.send({"ready": True})
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                try:
                    while wake_r.recv(512):
                        pass
                except BlockingIOError:
                    pass
                spawner.reap()
            elif not spawner.handle_request():
                return 0
        spawner.reap()  # a SIGCHLD that arrived between the drain and the reap


if __name__ == "__main__":
    sys.exit(main(sys.argv))
