"""Checking a workspace image whose filesystem failed: repaired by e2fsck, or set aside.

A workspace's filesystem can fail under it (an I/O error of the host's disk; a journal the
kernel aborted). Its image is never mounted again as it is: e2fsck -p (the automatic repair,
which only makes changes that cannot lose more than the damage did) runs first. Beyond what
that may fix, the image is moved to `.quarantine/` beside the workspaces (a name no workspace
can have: nothing sweeps it) for the operator, and the session starts afresh.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

QUARANTINE = ".quarantine"
EXT4_MAGIC = 0xEF53
EXT4_ERROR_FS = 0x0002  # s_state: the kernel found an error in this filesystem
FSCK_TIMEOUT = 600.0


def has_recorded_error(image: Path) -> bool:
    """Whether the ext4 superblock of `image` records an error the kernel found (s_state)."""
    with contextlib.suppress(OSError), open(image, "rb") as f:
        block = os.pread(f.fileno(), 1024, 1024)
        if len(block) == 1024 and int.from_bytes(block[0x38:0x3A], "little") == EXT4_MAGIC:
            return bool(int.from_bytes(block[0x3A:0x3C], "little") & EXT4_ERROR_FS)
    return False


def loop_attached(image: Path) -> bool:
    """Whether a loop device is backed by `image` (a mount of it lives on somewhere)."""
    wanted = str(image)
    with contextlib.suppress(OSError), os.scandir("/sys/block") as entries:
        for entry in entries:
            if not entry.name.startswith("loop"):
                continue
            with contextlib.suppress(OSError), open(f"{entry.path}/loop/backing_file") as f:
                if f.read().rstrip("\n") == wanted:
                    return True
    return False


@dataclass(frozen=True)
class CheckOutcome:
    result: Literal["clean", "repaired", "quarantined"]
    exit_code: int
    output: str  # e2fsck's last words
    seconds: float
    kept: Path | None = None  # where a quarantined image is


def check_image(image: Path, name: str) -> CheckOutcome:
    """Check and repair the (unmounted) image of workspace `name`; set it aside in the
    quarantine directory beside it if e2fsck -p cannot repair it. Raises OSError,
    SubprocessError."""
    started = time.monotonic()
    done = subprocess.run(
        ["e2fsck", "-f", "-p", str(image)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=FSCK_TIMEOUT,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"},
    )
    took = time.monotonic() - started
    output = (done.stdout + done.stderr).decode(errors="replace").strip()[-500:]
    if done.returncode == 0:
        return CheckOutcome("clean", 0, output, took)
    if done.returncode in (1, 2):  # errors corrected
        return CheckOutcome("repaired", done.returncode, output, took)
    aside = image.parent / QUARANTINE
    aside.mkdir(mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    kept = aside / f"{name}-{stamp}{image.suffix}"
    os.rename(image, kept)
    return CheckOutcome("quarantined", done.returncode, output, took, kept)
