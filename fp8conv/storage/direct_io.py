"""Direct I/O (O_DIRECT): file bytes move between the disk and our own buffers, not through the page cache.

On this kind of machine the page cache is what a disk-speed conversion pays for most: the kernel's
copies, page allocation and reclaim cost more CPU than the arithmetic (measured, 4 GiB read + 4.3 GiB
written, no arithmetic: buffered 16.3-20.7 s wall with 13.7-18.4 s of system CPU; O_DIRECT 5.7-6.0 s
with 0.5-0.7 s), and the CPU is what the arithmetic needs. Direct I/O wants the file offset, the length
and the buffer's address aligned; filesystems without it (tmpfs, some network filesystems) refuse the
open, and the callers then use the page cache.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ALIGN = 4096  # covers every common logical block size (512 B and 4 KiB)


def round_down(n: int) -> int:
    return n - n % ALIGN


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor whose first byte is ALIGN-aligned."""
    import torch  # here, not at the top: reading headers and planning never load torch

    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + nbytes]


def open_direct(path: Path, flags: int) -> int | None:
    """`path` opened with O_DIRECT, or None where the platform or filesystem does not offer it."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # the filesystem has no direct I/O
            return None
        raise


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """One pread into `view`: direct_transfer's op for reads."""
    return os.preadv(fd, [view], offset)


def direct_transfer(
    op: Callable[[int, memoryview, int], int], fd: int, view: memoryview, offset: int
) -> tuple[int, bool]:
    """The one direct-I/O loop: all of `view` (whole ALIGN units) moved by `op` (read_into, or os.pwrite)
    between it and the O_DIRECT descriptor `fd` at the aligned `offset`. It stops early at a transfer of 0
    or of part of an ALIGN unit: for a read the end of the file (the caller says whether that is an
    error), for a write the rest goes through the page cache. Returns (bytes moved, direct I/O still
    usable): False when the filesystem turned it down (EINVAL: it wants more alignment), and the caller
    then sends this and every later transfer through the page cache."""
    done = 0
    try:
        while done < len(view):
            n = op(fd, view[done:], offset + done)
            done += n
            if n == 0 or n % ALIGN:
                break
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return done, False
    return done, True
