"""The content digest of a root filesystem tree, its size, and the kernelspecs it carries.

The digest covers, for every entry in sorted path order: its path, its type, its permission
bits, its owner ids, a regular file's bytes and a symlink's target. Timestamps are left out
(two builds of the same packages differ only there when they differ at all); so are hardlink
identities (a copy that splits hardlinks holds the same files).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK = 1024 * 1024
# Where kernelspecs live in a root (Jupyter's data path, system then local, then the
# shared runtime's when an environment carries one at /opt/srt-runtime).
KERNEL_DIRS = (
    "usr/share/jupyter/kernels",
    "usr/local/share/jupyter/kernels",
    "opt/srt-runtime/share/jupyter/kernels",
)
MAX_KERNELSPEC_BYTES = 64 * 1024


class TreeTooLargeError(Exception):
    """The tree holds more bytes than allowed (raised while walking, not after)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes, past the limit of {limit}")
        self.size, self.limit = size, limit


@dataclass(frozen=True)
class TreeSummary:
    digest: str  # "sha256:..."
    size_bytes: int  # regular files' sizes plus one block per other entry
    entries: int


def tree_size(root: Path) -> int:
    """Bytes a tree holds (regular files' sizes plus 512 per other entry), without reading."""
    total = 0
    for parent, dirs, files in os.walk(root):
        for name in files + dirs:
            try:
                st = os.lstat(os.path.join(parent, name))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 512
    return total


def summarize(root: Path, limit: int = 0) -> TreeSummary:
    """Digest and size of the tree at `root` (`limit` > 0: raise TreeTooLargeError past it)."""
    outer = hashlib.sha256()
    size = 0
    entries = 0
    for rel, st in _walk(root):
        entries += 1
        mode = st.st_mode
        line = [rel, stat.S_IFMT(mode), stat.S_IMODE(mode), st.st_uid, st.st_gid]
        if stat.S_ISREG(mode):
            size += st.st_size
            if limit and size > limit:
                raise TreeTooLargeError(size, limit)
            line.append(_file_digest(root / rel))
        elif stat.S_ISLNK(mode):
            size += 512
            line.append(os.readlink(root / rel))
        else:
            size += 512
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                line.append(st.st_rdev)
        outer.update(json.dumps(line).encode("utf-8", "surrogateescape") + b"\n")
    return TreeSummary(f"sha256:{outer.hexdigest()}", size, entries)


def _walk(root: Path) -> Any:
    stack = [""]
    while stack:
        rel = stack.pop()
        full = os.path.join(root, rel) if rel else str(root)
        with os.scandir(full) as it:
            names = sorted(entry.name for entry in it)
        for name in reversed(names):  # (stack: reversed, so they come out sorted)
            child = f"{rel}/{name}" if rel else name
            st = os.lstat(os.path.join(root, child))
            if stat.S_ISDIR(st.st_mode):
                stack.append(child)
        for name in names:
            child = f"{rel}/{name}" if rel else name
            yield child, os.lstat(os.path.join(root, child))


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def kernelspecs(root: Path) -> dict[str, dict[str, Any]]:
    """language -> {argv, display_name, language} for each kernelspec in the root's Jupyter
    data paths (first found wins per language). The root is untrusted: links are not
    followed out of it, and a spec that is not plain JSON of the expected shape is skipped."""
    found: dict[str, dict[str, Any]] = {}
    for rel in KERNEL_DIRS:
        base = root / rel
        if not _inside(root, base) or not base.is_dir():
            continue
        for spec_dir in sorted(base.iterdir()):
            spec = spec_dir / "kernel.json"
            if not _inside(root, spec) or not spec.is_file():
                continue
            try:
                if spec.stat().st_size > MAX_KERNELSPEC_BYTES:
                    continue
                data = json.loads(spec.read_text())
                argv = [str(a) for a in data["argv"]]
                language = str(data["language"]).strip().lower()
                display = str(data.get("display_name") or spec_dir.name)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if argv and language and language not in found:
                found[language] = {"argv": argv, "display_name": display, "language": language}
    return found


def _inside(root: Path, path: Path) -> bool:
    """Whether `path` resolves inside `root` (symlinks in the root resolved as on the host:
    a link to /usr/... leaves the root and is refused, which is the safe answer)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False
