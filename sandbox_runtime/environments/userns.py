"""Run a command as root of a new user namespace whose ids 0-65535 are the host's 0-65535.

`python -m sandbox_runtime.environments.userns COMMAND...`: what a RUN step of a build runs
under (environments/run.py puts bubblewrap after it). Package managers need more than one
uid (dpkg gives files to other owners, apt drops to `_apt`): one mapped uid is not enough,
and `unshare --map-users` asks newuidmap, which wants /etc/subuid entries for root. The
caller is the host's root (builds need it), so the maps are written directly. The
namespace's root holds capabilities over the namespace's own mounts and processes only;
bubblewrap then gives it nothing of the host's filesystem but the tree being built.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWUSER = 0x10000000
COUNT = 65536


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: userns COMMAND...", file=sys.stderr)
        return 2
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER) != 0:
            os.write(2, f"unshare: {os.strerror(ctypes.get_errno())}\n".encode())
            os._exit(126)
        os.write(ready_w, b"r")
        if os.read(go_r, 1) != b"g":
            os._exit(126)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        try:
            os.execvp(argv[0], argv)  # noqa: S606  (the build step's bwrap)
        except OSError as exc:
            os.write(2, f"{argv[0]}: {exc}\n".encode())
            os._exit(127)
    os.close(ready_w)
    os.close(go_r)
    ok = os.read(ready_r, 1) == b"r"
    if ok:
        for kind in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{kind}", "w") as f:
                f.write(f"0 0 {COUNT}\n")
        os.write(go_w, b"g")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
