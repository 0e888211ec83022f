"""Read safetensors headers (no tensor bytes) and single tensors by offset; validate as we go.

The format: 8-byte little-endian header length, a JSON object header, then the raw bytes of every
tensor, contiguous, at the offsets the header names (relative to the end of the header).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .dtypes import ELEMENT_BYTES, torch_dtype
from .errors import CheckpointError

if TYPE_CHECKING:
    import torch

# A real header is a few MB at most (DeepSeek-V3: ~100 KB per shard); refuse absurd ones before reading.
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    file_size: int
    data_start: int
    tensors: dict[str, TensorEntry]  # in file order
    metadata: dict[str, str]


def read_header(path: Path, display_name: str | None = None) -> ShardHeader:
    """Parse and validate one shard's header. Reads only the header bytes."""
    shard = display_name or path.name
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError("file is too short to be safetensors", shard=shard, fix="re-download this shard")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise CheckpointError(
                    f"header length {header_len} is impossible for a {file_size}-byte file",
                    shard=shard,
                    fix="the file is truncated or not safetensors; re-download it",
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror}", shard=shard) from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"header is not valid JSON ({exc})", shard=shard, fix="re-download this shard") from exc
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object", shard=shard, fix="re-download this shard")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError("__metadata__ is not an object", shard=shard)
    entries = [_parse_entry(name, spec, shard, data_start) for name, spec in header.items()]
    entries.sort(key=lambda e: e.start)
    _check_layout(entries, shard, data_start, file_size)
    return ShardHeader(
        path=path,
        file_size=file_size,
        data_start=data_start,
        tensors={e.name: e for e in entries},
        metadata={str(k): str(v) for k, v in metadata.items()},
    )


def _parse_entry(name: str, spec: object, shard: str, data_start: int) -> TensorEntry:
    if not isinstance(spec, dict):
        raise CheckpointError("header entry is not an object", tensor=name, shard=shard)
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in ELEMENT_BYTES:
        raise CheckpointError(
            f"dtype {dtype!r} is not one fp8conv knows",
            tensor=name,
            shard=shard,
            fix="this tensor's format is unsupported",
        )
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"shape {shape!r} is not a list of sizes", tensor=name, shard=shard)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise CheckpointError(f"data_offsets {offsets!r} are invalid", tensor=name, shard=shard)
    nbytes = math.prod(shape) * ELEMENT_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"data_offsets span {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {nbytes}",
            tensor=name,
            shard=shard,
            fix="the shard is corrupt; re-download it",
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _check_layout(entries: list[TensorEntry], shard: str, data_start: int, file_size: int) -> None:
    cursor = data_start
    for e in entries:
        if e.start < cursor:
            raise CheckpointError(
                "its bytes overlap the previous tensor's", tensor=e.name, shard=shard, fix="re-download it"
            )
        cursor = e.start + e.nbytes
    if cursor > file_size:
        last = entries[-1].name
        raise CheckpointError(
            f"data runs to byte {cursor} but the file has {file_size} (truncated)",
            tensor=last,
            shard=shard,
            fix="re-download this shard",
        )


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
