"""The exact float32 value of every logical tensor of a checkpoint, read in row bands.

A checkpoint's logical tensors are what its classification names: each quantized weight (decoded with its
scales exactly as fp8conv decodes an input) and each plain tensor. The audit reads both the source and
the other tool's output through this one module, so the two sides are decoded by the same definitions.
Every reader works on the tensor as [M, N, K] (M: the product of leading dimensions) and returns rows
[r0, r1) of matrix m; packed 4-bit weights are decoded one matrix (expert) at a time, and
layouts that cannot be read by rows (scale rows in another unit, pre-sharded chunks) whole, once.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ...backends.cpu import CpuBackend
from ...backends.scales import scale_to_float32
from ...backends.scratch import scratch
from ...backends.torch_device import TorchDeviceBackend
from ...dtypes import FP8_E4M3, torch_dtype
from ...model.classify import CONVERTIBLE, PACKED, Classification, Kind, WeightFormat
from ...rewrite.dequant import dequantize, scale_grid, stored_scale
from ...rewrite.unpack import band_decoder
from ...source.index import CheckpointIndex
from ...storage.safetensors_file import TensorEntry, as_writable_memoryview, pread_into, read_tensor, tensor_buffer

REFERENCE = TorchDeviceBackend("cpu")  # the reference arithmetic: one float32 product, bit for bit
DECODE = CpuBackend()  # the same bits (the backend parity tests hold it to the reference), 3-4x faster
FLOAT_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Band:
    """Rows of one matrix: their values, the stored elements' bits (None when decoded from several
    tensors) and the per-element scale an FP8 value was stored at (None for a float tensor), made only
    when asked: the output's is, the source's never is."""

    values: torch.Tensor  # float32 [rows, K]
    bits: torch.Tensor | None = None
    scale_of: Callable[[], torch.Tensor] | None = None

    @functools.cached_property
    def scale(self) -> torch.Tensor | None:
        return None if self.scale_of is None else self.scale_of()


class Files:
    """Open file descriptors of one checkpoint's shards, closed together, and the band buffers its reads
    reuse (a fresh 16 MiB buffer per band costs more in page faults than the comparison itself)."""

    def __init__(self, index: CheckpointIndex, label: str):
        self.index = index
        self.label = label  # "source" or "other": the two sides never share a buffer
        self._fds: dict[str, int] = {}
        self._hinted: set[str] = set()

    def hint(self, name: str) -> None:
        """Ask the kernel for the tensor's bytes now (once): it fetches them while earlier bands compute."""
        if name in self._hinted or not hasattr(os, "posix_fadvise"):
            return
        self._hinted.add(name)
        fd, entry, _ = self.fd(name)
        os.posix_fadvise(fd, entry.start, entry.nbytes, os.POSIX_FADV_WILLNEED)

    def buffer(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This side's buffer `slot`, valid until the next read into the same slot."""
        return scratch(f"audit {self.label} {slot}", shape, dtype)

    def fd(self, name: str) -> tuple[int, TensorEntry, str]:
        shard = self.index.shard_of(name).name
        if shard not in self._fds:
            self._fds[shard] = os.open(self.index.root / shard, os.O_RDONLY)
        return self._fds[shard], self.index.entry(name), shard

    def whole(self, name: str) -> torch.Tensor:
        return read_tensor(*self.fd(name))

    def rows(self, name: str, first: int, count: int, row_elements: int, slot: str | None = None) -> torch.Tensor:
        """`count` rows of `row_elements` elements from row `first` of the tensor flattened to 2-D (into
        buffer `slot`, or a fresh one)."""
        fd, entry, shard = self.fd(name)
        self.hint(name)
        dtype = torch_dtype(entry.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        nbytes = count * row_elements * size
        raw = tensor_buffer(nbytes) if slot is None else self.buffer(slot, (nbytes,), torch.uint8)
        pread_into(fd, as_writable_memoryview(raw), entry.start + first * row_elements * size, entry, shard)
        return raw.view(dtype).reshape(count, row_elements)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class Values:
    """One logical tensor: its name, logical shape, how it is stored, and a reader of its rows."""

    name: str
    shape: tuple[int, ...]
    stored: str  # e.g. "bfloat16", "float8_e4m3fn block (128, 128), float32 scales"
    row_unit: int  # bands start at multiples of this many rows
    read: Callable[[int, int, int], Band]  # (matrix m, r0, r1) -> rows [r0, r1) of matrix m
    fp8: bool = False  # values are FP8 (or INT8) codes times a scale
    unreadable: str | None = None  # why an engine cannot read it as stored (then `read` gives raw codes)
    fmt: WeightFormat | None = field(default=None, repr=False)
    release: Callable[[], None] = field(default=lambda: None, repr=False)  # drops what a reader keeps decoded
    int8: bool = False  # the codes are INT8 (int8_rows.py), judged at INT8's rounding

    def values_of(self, m: int, r0: int, r1: int) -> torch.Tensor:
        """Float32 rows [r0, r1) of matrix m, whatever the row unit its reads start on."""
        start = r0 // self.row_unit * self.row_unit
        return self.read(m, start, r1).values[r0 - start :]

    @property
    def stored_tensors(self) -> tuple[str, ...]:
        """The checkpoint tensors its values are read from."""
        if self.fmt is None:
            return (self.name,)
        return tuple(n for n in (self.fmt.weight, self.fmt.scale) if n is not None)

    @property
    def matrices(self) -> int:
        return math.prod(self.shape[:-2]) if len(self.shape) >= 2 else 1

    @property
    def rows(self) -> int:
        return matrix_shape(self.shape)[0]

    @property
    def cols(self) -> int:
        return matrix_shape(self.shape)[1]

    @property
    def float_dtype(self) -> torch.dtype | None:
        """The float dtype the values are stored in (None: FP8 at a scale, or decoded from codes)."""
        return FLOAT_NAMES.get(self.stored)


def logical_values(index: CheckpointIndex, classification: Classification, files: Files) -> dict[str, Values]:
    """Every logical tensor of a classified checkpoint by the name it plays (a packed weight by the name
    it unpacks to), refused weights included as `unreadable` raw codes."""
    found: dict[str, Values] = {}
    for name in classification.plain:
        found[name] = plain_values(name, index.entry(name), files)
    for fmt in classification.weights.values():
        values = weight_values(fmt, index, files)
        found[values.name] = values
    return found


def plain_values(name: str, entry: TensorEntry, files: Files) -> Values:
    """A tensor read as stored (a vector or a scalar as one row); FP8 bytes without a scale are unreadable."""
    n, k = matrix_shape(entry.shape)
    unreadable = (
        "float8 codes with no scale: an engine reads the codes as the values" if entry.dtype == FP8_E4M3 else None
    )

    def read(m: int, r0: int, r1: int) -> Band:
        raw = files.rows(name, m * n + r0, r1 - r0, k, slot="raw")
        return Band(files.buffer("values", tuple(raw.shape), torch.float32).copy_(raw), raw)

    stored = str(torch_dtype(entry.dtype)).removeprefix("torch.")
    return Values(name, tuple(entry.shape), stored, 1, read, False, unreadable)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(N, K) of a tensor read as [M, N, K]: a vector is one row, a scalar one element."""
    if len(shape) >= 2:
        return shape[-2], shape[-1]
    return 1, (shape[0] if shape else 1)


def weight_values(fmt: WeightFormat, index: CheckpointIndex, files: Files) -> Values:
    entry = index.entry(fmt.weight)
    name = fmt.out_name or fmt.weight
    if fmt.kind is Kind.UNQUANTIZED:  # a float weight beside a stray scale: the scale is structure's finding
        return plain_values(fmt.weight, entry, files)
    if fmt.kind in (Kind.UNVERIFIED, Kind.UNSUPPORTED) or fmt.scale is None:
        values = plain_values(fmt.weight, entry, files)
        values.name, values.fmt = name, fmt
        values.unreadable = f"{fmt.kind}: {fmt.reason}" if fmt.reason else str(fmt.kind)
        return values
    if fmt.kind in CONVERTIBLE and fmt.row_scales is None and fmt.chunked is None and len(entry.shape) >= 2:
        return scaled_fp8_values(fmt, entry, index, files)
    if fmt.kind in PACKED:
        return packed_values(fmt, files)
    return whole_values(fmt, entry, files)


def describe(fmt: WeightFormat, scale_entry: TensorEntry | None) -> str:
    scale = f", {torch_dtype(scale_entry.dtype)} scales".replace("torch.", "") if scale_entry else ""
    block = f" {tuple(fmt.block)}" if fmt.block and fmt.kind in (Kind.BLOCK, Kind.MXFP8) else ""
    return f"float8_e4m3fn {fmt.kind}{block}{scale}"


ScaleDecode = Callable[[torch.Tensor], torch.Tensor]


def scaled_fp8_values(
    fmt: WeightFormat,
    entry: TensorEntry,
    index: CheckpointIndex,
    files: Files,
    *,
    block: tuple[int, int] | None = None,
    decode_scale: ScaleDecode = scale_to_float32,
) -> Values:
    """Block, channel, per-tensor or MXFP8 FP8, rows decoded with their scale rows. `block` and
    `decode_scale` replace the checkpoint's own reading (the audit's hypotheses of what went wrong)."""
    assert fmt.scale is not None
    shape = entry.shape
    n, k = shape[-2], shape[-1]
    m_count = math.prod(shape[:-2])
    bn, bk = block or fmt.math_block(shape)
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    scale_entry = index.entry(fmt.scale)
    by_rows = scale_entry.numel == m_count * gn * gk and scale_entry.numel > m_count
    whole_scale: list[torch.Tensor] = []

    def grid(m: int, r0: int, r1: int) -> torch.Tensor:
        g0, g1 = r0 // bn, math.ceil(r1 / bn)
        if by_rows:
            return decode_scale(files.rows(fmt.scale, m * gn + g0, g1 - g0, gk)).reshape(1, g1 - g0, gk)
        if not whole_scale:
            stored = decode_scale(files.whole(fmt.scale))
            whole_scale.append(scale_grid(stored.reshape(-1), fmt, shape).reshape(m_count, gn, gk))
        return whole_scale[0][m : m + 1, g0:g1]

    def read(m: int, r0: int, r1: int) -> Band:
        rows = r1 - r0
        codes = files.rows(fmt.weight, m * n + r0, rows, k, slot="codes")
        scales = grid(m, r0, r1)
        values = files.buffer("values", (1, rows, k), torch.float32)
        DECODE.dequantize_blocks(codes.reshape(1, rows, k), scales, (bn, bk), values)
        return Band(values[0], codes, lambda: _per_element(files, scales[0], (bn, bk), rows, k))

    return Values(fmt.out_name or fmt.weight, shape, describe(fmt, scale_entry), bn, read, True, fmt=fmt)


def _per_element(files: Files, grid: torch.Tensor, block: tuple[int, int], rows: int, k: int) -> torch.Tensor:
    """[rows, K] the scale each element was stored at, from the grid rows of the band."""
    bn, bk = block
    row_scales = grid.repeat_interleave(bn, 0)[:rows]  # [rows, gk]
    out = files.buffer("scales", (rows, k), torch.float32)
    full_k = k // bk * bk
    if full_k:
        out[:, :full_k].view(rows, full_k // bk, bk).copy_(row_scales[:, : full_k // bk, None].expand(-1, -1, bk))
    if full_k < k:
        out[:, full_k:].copy_(row_scales[:, -1:].expand(-1, k - full_k))
    return out


def packed_values(fmt: WeightFormat, files: Files) -> Values:
    """Packed 4-bit: one matrix at a time (an expert of a fused tensor) decoded when first read and kept
    while its rows are read (until release); gpt-oss's experts as transformers holds them, transposed to
    [E, K, N]."""
    assert fmt.shape is not None and fmt.scale is not None and fmt.group is not None
    shape = tuple(fmt.shape)
    n, k = shape[-2], shape[-1]
    transpose = fmt.kind is Kind.MXFP4_GPT_OSS
    container = torch.empty((), dtype=torch_dtype(files.index.entry(fmt.weight).dtype)).element_size()
    global_scale = files.whole(fmt.global_scale) if fmt.global_scale is not None else None
    one = replace(fmt, shape=(n, k))
    kept: dict[int, torch.Tensor] = {}

    def matrix(m: int) -> torch.Tensor:
        if m not in kept:
            kept.clear()
            codes = files.rows(fmt.weight, m * n, n, k // 2 // container).view(torch.uint8).reshape(1, n, k // 2)
            scale = files.rows(fmt.scale, m * n, n, k // fmt.group)
            out = torch.empty((1, n, k), dtype=torch.float32)
            band_decoder(one, scale, global_scale, REFERENCE)(codes, 0, out)
            kept[m] = out[0].T.contiguous() if transpose else out[0]
        return kept[m]

    def read(m: int, r0: int, r1: int) -> Band:
        return Band(matrix(m)[r0:r1])

    logical = (*shape[:-2], k, n) if transpose else shape
    scale_entry = files.index.entry(fmt.scale)
    name = fmt.out_name or fmt.weight
    return Values(name, logical, describe(fmt, scale_entry), 1, read, False, fmt=fmt, release=kept.clear)


def whole_values(fmt: WeightFormat, entry: TensorEntry, files: Files) -> Values:
    """A layout read whole (scale rows in another unit, chunked rows): decoded once, when first read, and
    kept while the tensor is judged (until release)."""
    cache: list[torch.Tensor] = []
    shape = entry.shape
    n, k = shape[-2], shape[-1]

    def decoded() -> torch.Tensor:
        if not cache:
            weight = files.whole(fmt.weight)
            scale = stored_scale(files.whole, fmt)
            cache.append(dequantize(weight, scale, fmt, torch.float32, REFERENCE).reshape(-1, k))
        return cache[0]

    def read(m: int, r0: int, r1: int) -> Band:
        return Band(decoded()[m * n + r0 : m * n + r1])

    scale_entry = files.index.entry(fmt.scale) if fmt.scale else None
    name = fmt.out_name or fmt.weight
    return Values(name, shape, describe(fmt, scale_entry), n, read, False, fmt=fmt, release=cache.clear)
