"""Applying a tar layer to a root safely: what an imported image (oci.py) or a fetched
environment (sharing.py) may put in a root, and what it may not.

An entry may be a regular file, a directory, a symlink (any target: it is resolved inside
the sandbox's root, never by us on the host), or a hardlink to a regular file of the same
tree. Refused and skipped, each counted in the result: names with `..` or that reach the
tree through a symlink (a layer cannot write through a link it or an earlier layer made),
hardlinks to anything outside the tree or to non-files, device nodes, fifos and sockets.
Setuid and setgid bits are cleared (sandboxes mount roots nosuid and run no_new_privs
besides). Owners outside 0-65535 become root. Size and entry count are bounded while
extracting: a tar bomb stops at the limit, it is never written whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
import tarfile
from collections import Counter
from pathlib import Path
from typing import IO

from sandbox_runtime.environments.store import EnvironmentsError, remove_tree

MAX_ENTRIES = 2_000_000
ENTRY_OVERHEAD = 512
CHUNK = 1024 * 1024
OPAQUE = ".wh..wh..opq"
WHITEOUT = ".wh."
MAX_ID = 65535
CAPABILITY = "security.capability"
LONG_HEADERS = (
    tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK,
)  # fmt: skip


class LayerTooLargeError(EnvironmentsError):
    """The layers hold more than the size limit allows."""


class LayerError(EnvironmentsError):
    """A layer is not a tar we can read."""


MAX_HEADER = 1024 * 1024  # a pax or GNU long-name header: tarfile reads one whole


class BoundedInfo(tarfile.TarInfo):
    """tarfile's member, refusing a pax or GNU long-name header past MAX_HEADER before
    tarfile reads it whole into memory (a gzip of a few MiB holds a header of GiBs, and the
    size budget counts files, not headers)."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in LONG_HEADERS and self.size > MAX_HEADER:
            raise LayerError(
                f"a layer has a {self.size // 2**20} MiB header (at most {MAX_HEADER // 2**20} "
                "MiB): not an image this server imports"
            )
        return super()._proc_member(tar)  # type: ignore[misc]


class Budget:
    """Bytes and entries left across every layer of one import."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self.entries = 0

    def take(self, n: int) -> None:
        self.used += n
        self.entries += 1
        if self.used > self.max_bytes or self.entries > MAX_ENTRIES:
            raise LayerTooLargeError(
                f"the image holds more than {self.max_bytes // 2**20} MiB (or "
                f"{MAX_ENTRIES} entries), past SANDBOX_ENVIRONMENT_MAX_MB"
            )


def extract_layer(
    source: Path | IO[bytes],
    tree: Path,
    max_bytes: int,
    whiteouts: bool = True,
    budget: Budget | None = None,
) -> Counter[str]:
    """Apply the tar at `source` (a path or a readable stream; gzip or plain) to `tree`.
    Returns counts of what was refused, by reason. Raises LayerError, LayerTooLargeError."""
    budget = budget or Budget(max_bytes)
    refused: Counter[str] = Counter()
    try:
        if isinstance(source, Path):
            tar = tarfile.open(source, mode="r|*", tarinfo=BoundedInfo)
        else:
            tar = tarfile.open(fileobj=source, mode="r|*", tarinfo=BoundedInfo)
    except (tarfile.TarError, OSError) as exc:
        raise LayerError(f"a layer is not a tar (plain or gzip): {exc}") from None
    with tar:
        try:
            for member in tar:
                _apply(tar, member, tree, budget, refused, whiteouts)
        except (tarfile.TarError, EOFError) as exc:
            raise LayerError(f"a layer is damaged: {exc}") from None
    return refused


def _apply(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    tree: Path,
    budget: Budget,
    refused: Counter[str],
    whiteouts: bool,
) -> None:
    rel = _clean(member.name)
    if rel is None:
        if member.name.strip("./") != "":
            refused["path escapes"] += 1
        return
    parent_rel, base = posixpath.split(rel)
    parent = _safe_parent(tree, parent_rel)
    if parent is None:
        refused["through a symlink"] += 1
        return
    budget.take(member.size if member.isreg() else ENTRY_OVERHEAD)
    if whiteouts and base == OPAQUE:
        for child in os.listdir(parent):
            _remove(parent / child)
        return
    if whiteouts and base.startswith(WHITEOUT):
        # (`.wh...` names `..`: the parent's parent, outside the tree at the top; `.wh.`
        # and `.wh..` name the parent itself)
        gone = base[len(WHITEOUT) :]
        if gone in ("", ".", ".."):
            refused["path escapes"] += 1
            return
        _remove(parent / gone)
        return
    target = parent / base
    if member.isdir():
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            _remove(target)
        target.mkdir(exist_ok=True)
        _own(target, member)
        return
    if not (member.isreg() or member.issym() or member.islnk()):
        refused["device, fifo or socket"] += 1
        return
    if member.islnk():
        link_rel = _clean(member.linkname)
        link_parent = _safe_parent(tree, posixpath.dirname(link_rel)) if link_rel else None
        source = link_parent / posixpath.basename(link_rel) if link_parent and link_rel else None
        if source is None or not source.is_file() or source.is_symlink():
            refused["hardlink outside the tree or not to a file"] += 1
            return
        _remove(target)
        os.link(source, target, follow_symlinks=False)
        return
    _remove(target)
    if member.issym():
        os.symlink(member.linkname, target)
        _own(target, member)
        return
    stream = tar.extractfile(member)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        if stream is not None:
            shutil.copyfileobj(stream, out, CHUNK)
    _own(target, member)


def _clean(name: str) -> str | None:
    """The entry's path relative to the tree, or None when it leaves it (or is the tree)."""
    parts = []
    for part in name.replace("\\", "/").split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            return None
        parts.append(part)
    return "/".join(parts) or None


def _safe_parent(tree: Path, rel: str) -> Path | None:
    """tree/rel, made as directories where missing; None when a component is a symlink or
    not a directory (a layer never writes through a link)."""
    path = tree
    for part in [p for p in rel.split("/") if p]:
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            path.mkdir(mode=0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return None
    return path


def _remove(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        remove_tree(path)


def _own(path: Path, member: tarfile.TarInfo) -> None:
    uid = member.uid if 0 <= member.uid <= MAX_ID else 0
    gid = member.gid if 0 <= member.gid <= MAX_ID else 0
    with contextlib.suppress(OSError):
        os.chown(path, uid, gid, follow_symlinks=False)
    if not member.issym():
        os.chmod(path, stat.S_IMODE(member.mode) & ~(stat.S_ISUID | stat.S_ISGID))


def neutralize(tree: Path) -> Counter[str]:
    """Make a built tree hold only what an environment may: setuid/setgid bits and file
    capabilities cleared, device nodes, fifos and sockets removed. Returns counts of what
    changed.

    File capabilities matter as setuid does: a RUN step is root of a user namespace whose
    root is the host's, so the `setcap` it runs (or a package's postinst) writes a capability
    the host honours. Sandboxes mount roots nosuid, which ignores both; a root left on the
    host's disk with one is a privilege any host user reaching the store could exec."""
    changed: Counter[str] = Counter()
    for parent, dirs, files in os.walk(tree):
        for name in dirs + files:
            path = os.path.join(parent, name)
            st = os.lstat(path)
            mode = st.st_mode
            if stat.S_ISLNK(mode):
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                os.unlink(path)
                changed["device, fifo or socket removed"] += 1
            else:
                if mode & (stat.S_ISUID | stat.S_ISGID):
                    os.chmod(path, stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID))
                    changed["setuid/setgid cleared"] += 1
                if stat.S_ISREG(mode) and _drop_capability(path):
                    changed["file capabilities removed"] += 1
    return changed


def _drop_capability(path: str) -> bool:
    try:
        os.removexattr(path, CAPABILITY, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise
    return True
