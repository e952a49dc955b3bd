"""A sandbox's root on an environment (DESIGN §21): the environment's tree bound read-only in
place of the host's /usr, under a small root the backend builds once per environment.

The environment's directories are bound, never copied: every sandbox on an environment shares
one tree on disk. What is built per environment (once per server, in the backend's private
directory) is the root those binds land on: the mount points of the sandbox's own mounts,
/etc (a copy of the environment's world-readable entries with our account, host and resolver
files over them) and the top-level links of a merged-usr tree. Every bind bwrap makes is
nosuid and nodev, so a setuid file or a device node in an environment gives nothing; its links
resolve inside the sandbox, never on the host: a top-level link is recreated as a link (bwrap
would follow it on the host), never bound.

The egress relay (and the stub of sandboxes started ahead) are Perl programs, the kernels'
pipe a Python one: an environment may have neither, or ones too old for them. The host's /usr
is bound read-only at HOST_DIR/usr (and the runtime at /opt/srt-runtime) and they run on the
host's Perl and Python through the host's own dynamic loader (the environment's loader and
libc may differ from the ones the host's programs were built for). That is what the default
root shows every sandbox anyway, out of the way here: nothing on the environment's PATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import os
import re
import shutil
import stat
from pathlib import Path

from sandbox_runtime.errors import SandboxUnavailableError
from sandbox_runtime.sandbox import argv
from sandbox_runtime.sandbox.egress_port import SOCKET_DIR, EgressLease
from sandbox_runtime.sandbox.host import (
    BRIDGE_DIR,
    DENO_CONFIG,
    ETC_GENERATED,
    KERNEL_DIR,
    RELAY_PATH,
    RELAY_PROGRAM,
    RUNTIME,
    SANDBOX_UID,
    SERVER_DIR,
    STUB_PERL,
    WORKSPACE,
)
from sandbox_runtime.sandbox.spec import HOST_DIR, ImageLayout, ImageRoot, SandboxSpec

RELAY_PYTHON = "/usr/bin/python3"  # the host's, for the kernels' pipe on an environment

# The environment's top-level directories bound into the sandbox (those it has as real
# directories; its links among them are recreated). /opt is bound entry by entry, beside our
# own mount points there; /etc is copied; /run, /tmp, /home, /dev and /proc are the sandbox's.
BIND_TOPS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "var", "srv")
OWN_OPT = {Path(RUNTIME).name, Path(SERVER_DIR).name}
MAX_ETC_FILE = 1024 * 1024  # an /etc entry bigger than this is left out of the copy
MAX_ETC_FILES = 5000
MAX_OPT_ENTRIES = 64
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def user_name(image: ImageRoot) -> str:
    """The name the sandbox's uid has on `image`: its USER when that is a plain user name
    (never root: USER maps to the sandbox uid, whatever it says), else `sandbox`."""
    user = image.user
    if USER_NAME.fullmatch(user) and user != "root":
        return user
    return "sandbox"


def start_dir(image: ImageRoot) -> str:
    """The directory a sandbox on `image` starts in when the caller names none: its WORKDIR
    when that lies in /workspace or /tmp (the only writable places), else /workspace."""
    workdir = os.path.normpath(image.workdir or "/")
    for place in (WORKSPACE, "/tmp"):
        if workdir == place or workdir.startswith(place + "/"):
            return workdir
    return WORKSPACE


def build_image_root(dest: Path, image: ImageRoot) -> ImageLayout:
    """Build the root for sandboxes on `image` at `dest` (which must not exist) and say how
    they mount it. Raises OSError (the environment's tree unreadable)."""
    tree = image.root
    st = os.lstat(tree)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"the environment {image.name}'s root {tree} is not a directory")
    dest.mkdir(mode=0o755)
    points = ["/proc", "/dev", "/tmp", WORKSPACE, KERNEL_DIR, SOCKET_DIR, BRIDGE_DIR,
              "/node_modules", RUNTIME, SERVER_DIR, f"{HOST_DIR}/usr"]  # fmt: skip
    for point in points:
        (dest / point.lstrip("/")).mkdir(mode=0o755, parents=True, exist_ok=True)
    (dest / "home").mkdir(mode=0o755)
    (dest / "home" / "user").symlink_to(WORKSPACE)
    shutil.copyfile(RELAY_PROGRAM, dest / RELAY_PATH.lstrip("/"))
    os.chmod(dest / RELAY_PATH.lstrip("/"), 0o644)
    (dest / "deno.json").write_text(DENO_CONFIG)
    os.chmod(dest / "deno.json", 0o644)
    binds: list[tuple[str, str]] = []
    for top in BIND_TOPS:
        binds += _place(tree / top, dest / top, f"/{top}")
    opt = tree / "opt"
    if _is_dir(opt):
        entries = sorted(os.listdir(opt))
        if len(entries) > MAX_OPT_ENTRIES:  # (each is a mount in every sandbox on it)
            raise OSError(f"its /opt has {len(entries)} entries, at most {MAX_OPT_ENTRIES}: "
                          "put them under fewer directories")  # fmt: skip
        for entry in entries:
            if entry not in OWN_OPT:
                binds += _place(opt / entry, dest / "opt" / entry, f"/opt/{entry}")
    _copy_etc(tree / "etc", dest / "etc", user_name(image))
    for root, dirs, _ in os.walk(dest):
        for d in dirs:
            path = os.path.join(root, d)
            if not os.path.islink(path):
                os.chmod(path, 0o755)
    user = user_name(image)
    env = {"USER": user, "LOGNAME": user, **dict(image.env)}
    return ImageLayout(dest, tuple(binds), tuple(env.items()), start_dir(image))


def _is_dir(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(os.lstat(path).st_mode)
    return False


def _place(source: Path, point: Path, inside: str) -> list[tuple[str, str]]:
    """A link in the environment is recreated at `point` (it resolves inside the sandbox); a
    directory gets a mount point and a bind; anything else is left out."""
    try:
        st = os.lstat(source)
    except OSError:
        return []
    if stat.S_ISLNK(st.st_mode):
        point.symlink_to(os.readlink(source))
        return []
    if not stat.S_ISDIR(st.st_mode):
        return []
    point.mkdir(mode=0o755, parents=True)
    return [(str(source), inside)]


def _copy_etc(source: Path, etc: Path, user: str) -> None:
    """The sandbox's /etc on an environment: its world-readable regular files (opened without
    following links) and its links as links; no device nodes, no set-id bits, nothing over
    MAX_ETC_FILE; then our generated files over them."""
    etc.mkdir(mode=0o755, exist_ok=True)
    copied = 0
    if _is_dir(source):
        for root, dirs, files in os.walk(source):
            rel = Path(root).relative_to(source)
            for name in [*dirs, *files]:
                if copied >= MAX_ETC_FILES:
                    break
                src, dst = Path(root) / name, etc / rel / name
                with contextlib.suppress(OSError):
                    copied += _copy_entry(src, dst)
            dirs[:] = [d for d in dirs if _is_dir(etc / rel / d)]
    for name, text in ETC_GENERATED.items():
        if name == "passwd":
            text = text.replace(f"sandbox:x:{SANDBOX_UID}", f"{user}:x:{SANDBOX_UID}")
        target = etc / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.is_symlink():
            target.unlink()
        target.write_text(text)
        os.chmod(target, 0o644)
    for gone in ("shadow", "gshadow"):  # (never world-readable anyway; nothing to find)
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (etc / gone).unlink()
    # The point the egress proxy's trust bundle is bound on: a file, in real directories.
    # The environment's /etc/ssl or /etc/ssl/certs may be a link (copied as one): made here
    # through it, the file would land wherever the link points on the host.
    bundle = etc / "ssl" / "certs" / "ca-certificates.crt"
    for directory in (etc / "ssl", bundle.parent):
        if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
            directory.unlink()
        directory.mkdir(exist_ok=True, mode=0o755)
    if bundle.is_symlink() or not bundle.is_file():
        bundle.unlink(missing_ok=True)
        bundle.write_bytes(b"")
        os.chmod(bundle, 0o644)


def _copy_entry(src: Path, dst: Path) -> int:
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        dst.symlink_to(os.readlink(src))
        return 1
    if stat.S_ISDIR(st.st_mode):
        dst.mkdir(mode=0o755)
        return 1
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o004 or st.st_size > MAX_ETC_FILE:
        return 0
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_ETC_FILE + 1)
    dst.write_bytes(data[:MAX_ETC_FILE])
    os.chmod(dst, 0o644)
    return 1


def host_loader_argv() -> list[str]:
    """The host's dynamic loader as a sandbox on an environment runs it (under HOST_DIR, with
    the host's libraries), to start a host program there; [] when the host has none."""
    loaders = sorted(glob.glob("/usr/lib/*-linux-gnu*/ld-linux*.so.*"))
    if not loaders:
        return []
    loader = os.path.realpath(loaders[0])
    libs = os.path.dirname(loader)
    return [f"{HOST_DIR}{loader}", "--library-path", f"{HOST_DIR}{libs}"]


def host_relay_argv() -> tuple[list[str], str | None]:
    """How the host's Python is started in a sandbox on an environment (the kernels' pipe:
    through the host's loader, both under HOST_DIR), or why it cannot be."""
    python = os.path.realpath(RELAY_PYTHON)
    loader = host_loader_argv()
    if not python.startswith("/usr/") or not loader:
        return [], f"{RELAY_PYTHON} or the host's dynamic loader is missing from /usr"
    return [*loader, f"{HOST_DIR}{python}"], None


class ImageRoots:
    """The roots built for environments, one per environment (by digest) for as long as the
    backend runs, under `directory` (in its private directory), with their shared options."""

    def __init__(self, directory: Path, runtime_dir: Path | None) -> None:
        self.directory = directory
        self.runtime_dir = runtime_dir
        self._built: dict[str, tuple[ImageLayout, list[str]]] = {}
        # The kernels' pipe's interpreter (interpreters/env_kernels.py).
        self.relay_python, self.relay_problem = host_relay_argv()
        # The stub of sandboxes started ahead (argv.STUB_PROGRAM) and the egress relay
        # (egress/relay.pl) on an environment: the host's Perl through the host's loader
        # ([] when the host has none).
        perl = os.path.realpath(STUB_PERL)
        loader = host_loader_argv()
        usable = bool(loader) and perl.startswith("/usr/") and os.access(perl, os.X_OK)
        self.stub_perl = [*loader, f"{HOST_DIR}{perl}"] if usable else []

    async def ready(self, image: ImageRoot | None) -> None:
        """Build `image`'s root off the event loop, if not yet (None: the default root).
        Raises SandboxUnavailableError."""
        if image is not None and image.digest not in self._built:
            await asyncio.to_thread(self.build, image)

    def stub(self, image: ImageRoot | None) -> list[str]:
        """The interpreter of the stub of a sandbox started ahead on `image`."""
        return self.stub_perl if image is not None else [STUB_PERL]

    def build(self, image: ImageRoot) -> None:
        """Build `image`'s root (if not yet) and keep its fixed options.
        Raises SandboxUnavailableError."""
        if image.digest in self._built:
            return
        dest = self.directory / hashlib.sha256(image.digest.encode()).hexdigest()[:32]
        shutil.rmtree(dest, ignore_errors=True)  # (a build cut short)
        try:
            self.directory.mkdir(mode=0o711, exist_ok=True)
            layout = build_image_root(dest, image)
        except OSError as exc:
            shutil.rmtree(dest, ignore_errors=True)
            raise SandboxUnavailableError(
                f"the environment {image.name!r} cannot be used: {exc}; rebuild or re-import it "
                "(`srt-mcp-server env inspect NAME` shows where its root is)"
            ) from exc
        self._built[image.digest] = (layout, argv.fixed_args(dest, self.runtime_dir, [], layout))

    def bwrap_args(
        self, spec: SandboxSpec, dev_dir: Path | None, lease: EgressLease | None
    ) -> tuple[list[str], list[str]]:
        """argv.bwrap_args for a sandbox on an environment (its root built by `build`)."""
        assert spec.image is not None
        layout, fixed = self._built[spec.image.digest]
        return argv.bwrap_args(spec, fixed, dev_dir, None, lease, layout, self.stub_perl)
