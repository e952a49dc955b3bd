"""OCI images the tests assemble themselves: a hostile one (whiteouts, a setuid binary, a
device node, a fifo, links out of the root, `..` names, hardlinks outside) and a tar bomb."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import stat
import tarfile
from pathlib import Path

BUSYBOX = Path(shutil.which("busybox") or "/usr/bin/busybox")  # static: runs in any root


def _info(
    name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, **kw: object
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    for key, value in kw.items():
        setattr(info, key, value)
    return info


def _add(tar: tarfile.TarFile, info: tarfile.TarInfo, data: bytes = b"") -> None:
    if info.type == tarfile.REGTYPE:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        tar.addfile(info)


def hostile_layers(outside: Path) -> list[bytes]:
    """Two layers (tar bytes). `outside`: a host path the layers try to write or link to."""
    one = io.BytesIO()
    with tarfile.open(fileobj=one, mode="w") as tar:
        for d in ("bin", "etc", "opt", "opt/data", "usr", "usr/bin", "dev", "tmp"):
            _add(tar, _info(d, tarfile.DIRTYPE, 0o755))
        _add(tar, _info("bin/busybox", mode=0o755), BUSYBOX.read_bytes())
        _add(tar, _info("bin/sh", tarfile.SYMTYPE, 0o777, linkname="busybox"))
        _add(tar, _info("etc/keep"), b"kept\n")
        _add(tar, _info("etc/gone"), b"whited out\n")
        _add(tar, _info("opt/data/old"), b"hidden by an opaque dir\n")
        _add(tar, _info("usr/bin/suid", mode=0o4755 | 0o2000), b"#!/bin/sh\nid\n")
        _add(tar, _info("dev/evil", tarfile.CHRTYPE, 0o666, devmajor=1, devminor=1))  # /dev/mem
        _add(tar, _info("dev/disk", tarfile.BLKTYPE, 0o666, devmajor=8, devminor=0))
        _add(tar, _info("tmp/fifo", tarfile.FIFOTYPE, 0o666))
        _add(tar, _info("etc/shadowlink", tarfile.SYMTYPE, 0o777, linkname="/etc/shadow"))
        _add(tar, _info("escape", tarfile.SYMTYPE, 0o777, linkname=str(outside.parent)))
        _add(tar, _info("../../" + outside.name), b"dotdot\n")
        _add(tar, _info("etc/hardshadow", tarfile.LNKTYPE, linkname="/etc/shadow"))
        _add(tar, _info("etc/hardout", tarfile.LNKTYPE, linkname="../../../../etc/passwd"))
        _add(tar, _info("etc/hardkeep", tarfile.LNKTYPE, linkname="etc/keep"))
        _add(tar, _info("/abs"), b"absolute names land inside\n")
    two = io.BytesIO()
    with tarfile.open(fileobj=two, mode="w") as tar:
        _add(tar, _info("etc/.wh.gone"))
        _add(tar, _info("opt/data/.wh..wh..opq"))
        _add(tar, _info("opt/data/new"), b"after the opaque dir\n")
        _add(tar, _info(f"escape/{outside.name}"), b"through a link\n")  # refused
        _add(tar, _info("escape", tarfile.REGTYPE), b"")  # replaces the link, writes nothing out
    return [one.getvalue(), gzip.compress(two.getvalue())]


def bomb_layer(megabytes: int) -> bytes:
    """A gzip layer of a few KiB that holds `megabytes` MiB of zeros."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w|gz") as tar:
        info = _info("zeros")
        info.size = megabytes * 2**20
        tar.addfile(info, _Zeros(info.size))
    return raw.getvalue()


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def _blob(out: dict[str, bytes], data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    out[f"blobs/sha256/{digest}"] = data
    return f"sha256:{digest}"


def oci_layout(layers: list[bytes], config: dict[str, object]) -> dict[str, bytes]:
    """The files of an OCI layout (name -> bytes) holding `layers` and `config`."""
    files: dict[str, bytes] = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}'}
    manifest = {
        "schemaVersion": 2,
        "config": {"digest": _blob(files, json.dumps(config).encode())},
        "layers": [{"digest": _blob(files, layer)} for layer in layers],
    }
    index = {
        "schemaVersion": 2,
        "manifests": [{"digest": _blob(files, json.dumps(manifest).encode())}],
    }
    files["index.json"] = json.dumps(index).encode()
    return files


def docker_save(layers: list[bytes], config: dict[str, object]) -> dict[str, bytes]:
    """The files of a `docker save` archive (name -> bytes)."""
    files: dict[str, bytes] = {"config.json": json.dumps(config).encode()}
    names = []
    for n, layer in enumerate(layers):
        files[f"layer{n}/layer.tar"] = layer
        names.append(f"layer{n}/layer.tar")
    files["manifest.json"] = json.dumps([{"Config": "config.json", "Layers": names}]).encode()
    return files


def write_tar(files: dict[str, bytes], path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            _add(tar, _info(name), data)
    return path


def write_dir(files: dict[str, bytes], path: Path) -> Path:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


IMAGE_CONFIG: dict[str, object] = {
    "config": {
        "Env": ["PATH=/bin:/usr/bin", "GREETING=hello"],
        "WorkingDir": "/opt",
        "User": "1000",
        "Labels": {"description": "an image the tests assembled"},
    }
}


def is_setuid(path: Path) -> bool:
    return bool(path.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID))
