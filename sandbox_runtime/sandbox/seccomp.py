"""The sandbox's seccomp filter, compiled once to classic BPF for bubblewrap's `--seccomp FD`."""

from __future__ import annotations

import contextlib
import errno
import functools
import tempfile

from sandbox_runtime.errors import SandboxUnavailableError

# Syscalls no sandboxed program needs and that widen the kernel's attack surface or would let
# the program leave its namespaces. They fail with EPERM so programs that probe them carry on.
DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "bpf",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "perf_event_open",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "userfaultfd",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "quotactl",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "personality",
    # io_uring can open sockets and files without passing through this filter.
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "fanotify_init",
    "modify_ldt",
    "uselib",
    "kcmp",
    "pidfd_getfd",
    "mbind",
    "migrate_pages",
    "move_pages",
    "lookup_dcookie",
)

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
TIOCSETD = 0x5423  # a line discipline other than the default can autoload a module
# Every btrfs ioctl (type 0x94): an unprivileged BTRFS_IOC_SUBVOL_CREATE in a workspace that is
# a subvolume would make a tree outside its qgroup, i.e. outside the workspace's quota. FICLONE
# is type 0x94 too: `cp --reflink=auto` falls back to copying.
BTRFS_IOCTL_TYPE = 0x9400
IOCTL_TYPE_MASK = 0xFF00
# fallocate that reserves blocks (mode 0, KEEP_SIZE, ZERO_RANGE, INSERT_RANGE, UNSHARE_RANGE) is
# EOPNOTSUPP: in a thin workspace image it promises blocks the host does not hold, and writes
# into them later pass the disk watchdog's stop (it stops new allocations only) and take the
# state filesystem's floor. glibc's posix_fallocate then writes the blocks instead (counted
# like any write). Freeing modes (PUNCH_HOLE, COLLAPSE_RANGE) stay allowed.
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_COLLAPSE_RANGE = 0x08
FALLOC_FREEING = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_COLLAPSE_RANGE
# copy_file_range is EXDEV (what it said across filesystems before Linux 5.3: cp, Python and
# libuv then copy through userspace): on btrfs it shares extents (a reflink), which a qgroup
# counts once however many files hold them, so a workspace held many times its quota in files
# (and no snapshot could keep them: restored, they need that much).
AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
AF_NETLINK = 16
NETLINK_ROUTE = 0
# Namespace flags a clone() may not ask for (unshare by another door).
CLONE_NS_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


@functools.cache
def compile_filter(network: bool = False, inet: bool = False) -> bytes:
    """The filter as BPF bytes. Raises SandboxUnavailableError if libseccomp is unusable.

    Without `network`, sockets are AF_UNIX only; with `inet` also AF_INET and AF_INET6, for
    sandboxes whose own (empty) network namespace must carry loopback TCP (Jupyter kernels).
    """
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # missing module or missing libseccomp.so
        raise SandboxUnavailableError(
            f"libseccomp is not usable ({exc}); install it: apt-get install libseccomp2"
        ) from exc
    try:
        filt = sc.SyscallFilter(sc.ALLOW)
        # A binary tree over syscall numbers (libseccomp >= 2.5) instead of one long chain:
        # fewer instructions run per syscall, and each sandbox's load is cheaper (the kernel
        # walks the filter for every syscall number to cache the always-allowed ones).
        with contextlib.suppress(AttributeError, ValueError, OSError):
            filt.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
        eperm = sc.ERRNO(errno.EPERM)
        for name in DENIED_SYSCALLS:
            try:
                filt.add_rule(eperm, name)
            except (ValueError, OSError):
                continue  # not a syscall on this architecture
        filt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
        filt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCLINUX))
        filt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSETD))
        filt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, IOCTL_TYPE_MASK, BTRFS_IOCTL_TYPE))
        unsupported = sc.ERRNO(errno.EOPNOTSUPP)
        filt.add_rule(unsupported, "fallocate", sc.Arg(1, sc.MASKED_EQ, FALLOC_FREEING, 0))
        filt.add_rule(sc.ERRNO(errno.EXDEV), "copy_file_range")
        for flag in CLONE_NS_FLAGS:  # one rule per bit: MASKED_EQ needs every masked bit set
            filt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        # clone3 passes its flags in memory the filter cannot read: make libc fall back to clone.
        filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        if not network:
            refuse = sc.ERRNO(errno.EAFNOSUPPORT)
            if inet:
                # Every family but AF_UNIX, AF_INET, AF_INET6 and NETLINK_ROUTE (which
                # getifaddrs uses: libzmq asks it before binding a TCP address; without
                # CAP_NET_ADMIN, which no sandbox has, it can only read the empty namespace).
                allowed = {AF_UNIX, AF_INET, AF_INET6, AF_NETLINK}
                for family in range(AF_NETLINK):
                    if family not in allowed:
                        filt.add_rule(refuse, "socket", sc.Arg(0, sc.EQ, family))
                filt.add_rule(refuse, "socket", sc.Arg(0, sc.GT, AF_NETLINK))
                filt.add_rule(
                    refuse, "socket", sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.NE, NETLINK_ROUTE)
                )
            else:
                filt.add_rule(refuse, "socket", sc.Arg(0, sc.NE, AF_UNIX))
            filt.add_rule(refuse, "socketpair", sc.Arg(0, sc.NE, AF_UNIX))
        with tempfile.TemporaryFile() as out:
            filt.export_bpf(out)
            out.seek(0)
            program = out.read()
    except OSError as exc:
        raise SandboxUnavailableError(f"could not compile the seccomp filter: {exc}") from exc
    if not program:
        raise SandboxUnavailableError("libseccomp produced an empty seccomp program")
    return program
