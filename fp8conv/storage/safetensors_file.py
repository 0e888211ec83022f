"""Read safetensors headers (no tensor bytes) and single tensors by offset; validate as we go.

The format: 8-byte little-endian header length, a JSON object header, then the raw bytes of every
tensor, contiguous, at the offsets the header names (relative to the end of the header).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING

from ..dtypes import torch_dtype
from ..errors import CheckpointError

if TYPE_CHECKING:
    import torch

# A real header is a few MB at most (DeepSeek-V3: ~100 KB per shard); refuse absurd ones before reading.
# safetensors' own cap (MAX_HEADER_SIZE in safetensors/src/tensor.rs).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True, slots=True)  # slots: a release holds 200k, 40 bytes less each than with a __dict__
class TensorEntry:
    """Where one tensor lives: its dtype, shape and absolute byte range in its shard."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# each field's slot, written by its descriptor (what the frozen __init__'s object.__setattr__ ends in)
_SLOT_WRITERS = tuple(getattr(TensorEntry, f.name).__set__ for f in dataclasses.fields(TensorEntry))


def tensor_entries(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    starts: Sequence[int],
    nbytes: Sequence[int],
) -> list[TensorEntry]:
    """TensorEntry(name, dtype, shape, start, nbytes) for each position, equal to what the constructor
    makes, made a field at a time: the frozen __init__ is a Python call of five object.__setattr__ per
    entry (0.2 s over a release's 200k entries); here each field's slot is filled by map() in C."""
    columns = (names, dtypes, shapes, starts, nbytes)
    if len(set(map(len, columns))) != 1:
        raise ValueError("tensor_entries needs as many of each field")
    entries = list(map(object.__new__, repeat(TensorEntry, len(names))))
    for write, values in zip(_SLOT_WRITERS, columns, strict=True):
        deque(map(write, entries, values), maxlen=0)  # deque: runs the map, keeps nothing
    return entries


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    file_size: int
    data_start: int
    tensors: dict[str, TensorEntry]  # in file order
    metadata: dict[str, str]
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file read; None: read remotely


def tensor_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 tensor to read into."""
    import torch  # here, not at the top: reading headers never loads torch

    return torch.empty(nbytes, dtype=torch.uint8)


def as_writable_memoryview(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (torch has no buffer protocol)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor must be contiguous and on the CPU")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def pread_into(fd: int, view: memoryview, offset: int, entry: TensorEntry, shard: str) -> None:
    """Fill `view` from `offset`; a file that ends first is the shard's fault, named as such."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise file_ended(entry, shard)
        done += n


def file_ended(entry: TensorEntry, shard: str) -> CheckpointError:
    """The error for a shard that ends before `entry`'s bytes do."""
    return CheckpointError(
        "file ended before this tensor's bytes", tensor=entry.name, shard=shard, fix="re-download the shard"
    )


def read_tensor(fd: int, entry: TensorEntry, shard: str) -> torch.Tensor:
    """Read one tensor's bytes with pread and view them as its dtype and shape."""
    raw = tensor_buffer(entry.nbytes)
    pread_into(fd, as_writable_memoryview(raw), entry.start, entry, shard)
    return raw.view(torch_dtype(entry.dtype)).reshape(entry.shape)
