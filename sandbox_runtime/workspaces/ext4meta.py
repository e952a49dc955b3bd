"""Where a workspace image's ext4 keeps its metadata: what a thin image may still need host
blocks for once it is mounted, with no data written.

mkfs (images.mkfs_argv) writes the superblocks and group descriptors and leaves the rest of
the metadata to be written lazily: the journal as it first goes round, an inode table block
when a file in it is first made, a group's bitmaps when the group is first used. Until then
those blocks are holes in the image and cost the host nothing; the watchdog
(workspaces/diskguard.py) allocates them when it stops a workspace, so that no metadata write
meets a full host. Read from the image's superblock and group descriptors (pure: no tools).
"""

from __future__ import annotations

import os
from pathlib import Path

# The journal: its smallest size (1024 blocks); 4 MiB holds transactions of 1 MiB of
# metadata, plenty for one workspace.
JOURNAL_MB = 4
INODE_SIZE = 256
BLOCK = 4096
EXT4_MAGIC = 0xEF53
EXTENT_MAGIC = 0xF30A
INCOMPAT_64BIT = 0x80
INCOMPAT_RECOVER = 0x4  # the journal holds transactions to replay
JBD2_MAGIC = bytes.fromhex("c03b3998")


def _u32(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 4], "little")


def _u16(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 2], "little")


def metadata_bytes(size_mb: int, inodes: int) -> int:
    """The most of an image's ext4 metadata that may still need host blocks once it is
    mounted: its journal, inode tables and bitmaps (the descriptors are written by mkfs)."""
    groups = -(-size_mb // 128)  # (32768 blocks of 4 KiB a group)
    return JOURNAL_MB * 1024 * 1024 + inodes * INODE_SIZE + (2 * groups + 16) * BLOCK


def metadata_ranges(image: Path) -> list[tuple[int, int]]:
    """Where in `image` its ext4 keeps its metadata (superblock, descriptors, bitmaps, inode
    tables) and its journal, as (offset, length) in bytes, read from its superblock and
    group descriptors: what a thin image may still need host blocks for with no data
    written ([]: not an ext4 image of ours). Raises OSError."""
    with open(image, "rb") as f:
        sb = os.pread(f.fileno(), 1024, 1024)
        if len(sb) < 1024 or int.from_bytes(sb[0x38:0x3A], "little") != EXT4_MAGIC:
            return []
        if 1024 << _u32(sb, 0x18) != BLOCK:
            return []
        blocks = _u32(sb, 0x4) | (_u32(sb, 0x150) << 32)
        groups = -(-blocks // _u32(sb, 0x20))
        wide = bool(_u32(sb, 0x60) & INCOMPAT_64BIT)
        size = _u16(sb, 0xFE) if wide else 32
        table = -(-_u32(sb, 0x28) * _u16(sb, 0x58) // BLOCK)
        gdt = os.pread(f.fileno(), groups * size, BLOCK)
    spans = [(0, 1 + -(-groups * size // BLOCK))]
    for g in range(groups):
        d = gdt[g * size : (g + 1) * size]
        for at, count in ((0x0, 1), (0x4, 1), (0x8, table)):  # bitmaps, inode table
            high = _u32(d, at + 0x20) << 32 if wide else 0
            spans.append((_u32(d, at) | high, count))
    spans += _journal_extents(sb)
    merged: list[list[int]] = []
    for start, count in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + count)
        else:
            merged.append([start, start + count])
    return [(a * BLOCK, (b - a) * BLOCK) for a, b in merged]


def _journal_extents(sb: bytes) -> list[tuple[int, int]]:
    """The journal's extents (first block, blocks) in logical order, from the superblock's
    copy of the journal inode's extent tree (its root: a journal of ours has one level)."""
    jnl = sb[0x10C : 0x10C + 60]
    found: list[tuple[int, int]] = []
    if _u16(jnl, 0) == EXTENT_MAGIC and _u16(jnl, 6) == 0:
        for i in range(_u16(jnl, 2)):
            e = jnl[12 + 12 * i : 24 + 12 * i]
            found.append(((_u16(e, 6) << 32) | _u32(e, 8), _u16(e, 4)))
    return found


def journal_body(image: Path) -> list[tuple[int, int]]:
    """Where in `image` its journal's blocks are, but the first (the journal's superblock), as
    (offset, length) in bytes, if the journal is empty ([]: it is not, or this is not an ext4
    image of ours: transactions a failed or killed mount left are for e2fsck to replay).
    Raises OSError."""
    with open(image, "rb") as f:
        sb = os.pread(f.fileno(), 1024, 1024)
        if len(sb) < 1024 or _u16(sb, 0x38) != EXT4_MAGIC or 1024 << _u32(sb, 0x18) != BLOCK:
            return []
        extents = _journal_extents(sb)
        if not extents or _u32(sb, 0x60) & INCOMPAT_RECOVER:
            return []
        jsb = os.pread(f.fileno(), 32, extents[0][0] * BLOCK)
    if len(jsb) < 32 or jsb[:4] != JBD2_MAGIC or int.from_bytes(jsb[28:32], "big") != 0:
        return []  # (s_start: where the journal's log starts; 0 when it is empty)
    (first, count), rest = extents[0], extents[1:]
    spans = [(first + 1, count - 1), *rest]
    return [(start * BLOCK, n * BLOCK) for start, n in spans if n > 0]
