"""verify's reading granularity: each tensor in row bands of whole block rows (3-D expert stacks expert by
expert), each band a small job of its own that verify checks exactly as it would the whole tensor.

The bands are verify's own, read by offset from the input and output files: nothing here uses the convert
path's banding, scheduler or writer. A band holds whole input and output blocks (and whole parts of a
padded fused [gate; up]), so its scales, rounding and bounds are those of the whole tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..dtypes import torch_dtype
from ..model.classify import PACKED, Kind
from ..plan.conversion import Action, Job
from ..rewrite.dequant import scale_grid, stored_scale
from ..source.index import CheckpointIndex
from ..storage.safetensors_file import (
    ShardHeader,
    TensorEntry,
    as_writable_memoryview,
    pread_into,
    read_tensor,
    tensor_buffer,
)

# A band holds ~Tuning.verify_band_elements float32 elements (options.py says why that many).
ROW_UNIT = 128  # bands are whole 128-row blocks (and whole input and output block rows)

Reader = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class Piece:
    """Output rows [out_rows) of matrix `expert` (of the [M, N, K] the tensor is), made from input rows
    [in_rows) (fewer when the output is zero-padded along its rows)."""

    expert: int
    out_rows: tuple[int, int]
    in_rows: tuple[int, int]
    parts: int  # the band's own pad_parts: the job's when its rows are not padded, else 1


def in_shape(job: Job, index: CheckpointIndex) -> tuple[int, ...]:
    """The input weight as [..., N, K]: packed 4-bit weights unpacked."""
    if job.fmt is not None and job.fmt.kind in PACKED:
        assert job.fmt.shape is not None
        return job.fmt.shape
    return index.entry(job.source).shape


def transposed(job: Job) -> bool:
    """gpt-oss's experts are written [E, K, N]: checked an expert at a time, never in row bands."""
    return job.fmt is not None and job.fmt.kind is Kind.MXFP4_GPT_OSS


def _row_blocks(job: Job, shape: tuple[int, ...]) -> tuple[int, int]:
    """Rows per input scale and per output scale."""
    quantized = job.fmt is not None and job.fmt.kind not in PACKED
    bn_in = job.fmt.math_block(shape)[0] if quantized and job.fmt is not None else 1
    if job.action in (Action.QUANTIZE, Action.QUANTIZE_POW2):
        return bn_in, (job.out_block or (1, 1))[0]
    return bn_in, bn_in if job.action is Action.KEEP_BLOCKS else 1


def pieces(job: Job, shape: tuple[int, ...], band_elements: int) -> list[Piece] | None:
    """The bands (of ~band_elements) verify reads `job` in; None: whole (fewer than two dimensions)."""
    out_shape = job.spec.shape
    if len(shape) < 2 or len(out_shape) != len(shape) or job.out_chunks > 1 or job.plain_rows:
        return None  # (rows in chunks, or reordered: a fused projection of a few MB, whole)
    m, n_in, n_out = math.prod(shape[:-2]), shape[-2], out_shape[-2]
    if transposed(job):
        return [Piece(e, (0, n_in), (0, n_in), 1) for e in range(m)]
    bn_in, bn_out = _row_blocks(job, shape)
    unit = math.lcm(ROW_UNIT, bn_in, bn_out)
    rows = max(unit, band_elements // max(shape[-1], out_shape[-1], 1) // unit * unit)
    p = job.pad_parts
    if n_in == n_out:  # padded along K, if at all: every band carries the job's parts
        spans, parts = [(0, n_out, 0, n_in)], p
    elif n_in % p or n_out % p or (p > 1 and ((n_out // p) % bn_out or (n_in // p) % bn_in)):
        spans, parts, rows = [(0, n_out, 0, n_in)], p, max(n_out, 1)  # blocks span the parts: whole
    else:  # rows padded: each part's input rows, then its zero rows, in bands of their own
        po, pi = n_out // p, n_in // p
        spans, parts = [(j * po, po, j * pi, pi) for j in range(p)], 1
    return [
        Piece(e, (o + r, o + min(r + rows, length)), (i + min(r, have), i + min(r + rows, have)), parts)
        for e in range(m)
        for o, length, i, have in spans
        for r in range(0, length, rows)
    ]


def read_rows(path: Path, entry: TensorEntry, shard: str, dim: int, expert: int, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of matrix `expert` of a tensor seen as [M, N, ...] (N its dimension `dim`), read by
    offset: only those rows' bytes."""
    lead, n = math.prod(entry.shape[:dim]), entry.shape[dim]
    row_bytes = entry.nbytes // max(lead * n, 1)
    raw = tensor_buffer((r1 - r0) * row_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_into(fd, as_writable_memoryview(raw), entry.start + (expert * n + r0) * row_bytes, entry, shard)
    finally:
        os.close(fd)
    return raw.view(torch_dtype(entry.dtype)).reshape(r1 - r0, *entry.shape[dim + 1 :])


class JobBands:
    """One job, band by band: for each piece, the band-shaped job, the output's band and a reader of the
    input's band, for verify's _check_job."""

    def __init__(self, job: Job, index: CheckpointIndex, out: ShardHeader, shard: str, read_in: Reader) -> None:
        self.job, self.index, self.out, self.shard, self.read_in = job, index, out, shard, read_in
        self.shape = in_shape(job, index)
        self.bn_in, self.bn_out = _row_blocks(job, self.shape)
        self._whole: dict[str, torch.Tensor] = {}  # scales and the like, small: read once
        self._out_scale: torch.Tensor | None = None

    def whole(self, name: str) -> torch.Tensor:
        if name not in self._whole:
            self._whole[name] = self.read_in(name)
        return self._whole[name]

    def bands(self, piece_list: list[Piece]) -> Iterator[tuple[Job, list[torch.Tensor], Reader]]:
        job = self.job
        grid = None
        if job.fmt is not None and job.fmt.kind not in PACKED and job.fmt.scale is not None:
            grid = scale_grid(stored_scale(self.whole, job.fmt), job.fmt, self.shape)  # [M, gn, gk] float32
        for piece in piece_list:
            yield self._band_job(piece), self._got(piece), self._reader(piece, grid)

    def _band_job(self, piece: Piece) -> Job:
        job, (r0, r1) = self.job, piece.out_rows
        fmt = job.fmt
        if fmt is not None and fmt.kind in PACKED:
            fmt = replace(fmt, shape=(piece.in_rows[1] - piece.in_rows[0], self.shape[-1]))
        elif fmt is not None:  # the band's scales arrive as a float32 grid of math blocks
            fmt = replace(fmt, kind=Kind.BLOCK, block=fmt.math_block(self.shape), row_scales=None)
        weight = job.outputs[0]
        out_rows = (r1 - r0, weight.shape[-1]) if not transposed(job) else (weight.shape[-1], weight.shape[-2])
        outputs = [replace(weight, shape=out_rows)]
        if len(job.outputs) > 1:
            scale = job.outputs[1]
            outputs.append(replace(scale, shape=(-(-r1 // self.bn_out) - r0 // self.bn_out, scale.shape[-1])))
        return replace(job, outputs=tuple(outputs), fmt=fmt, pad_parts=piece.parts)

    def _got(self, piece: Piece) -> list[torch.Tensor]:
        """The output's band: the weight's rows read by offset, its (small) scale read once and sliced."""
        entry = self.out.tensors[self.job.outputs[0].name]
        e, (r0, r1), dim = piece.expert, piece.out_rows, len(entry.shape) - 2
        if transposed(self.job):  # the expert's [K, N], seen as the [N, K] it was decoded as
            return [read_rows(self.out.path, entry, self.shard, dim, e, 0, entry.shape[-2]).T]
        got = [read_rows(self.out.path, entry, self.shard, dim, e, r0, r1)]
        if len(self.job.outputs) > 1:
            if self._out_scale is None:
                s_entry = self.out.tensors[self.job.outputs[1].name]
                fd = os.open(self.out.path, os.O_RDONLY)
                try:
                    self._out_scale = read_tensor(fd, s_entry, self.shard).reshape(-1, *s_entry.shape[-2:])
                finally:
                    os.close(fd)
            got.append(self._out_scale[e, r0 // self.bn_out : -(-r1 // self.bn_out)])
        return got

    def _reader(self, piece: Piece, grid: torch.Tensor | None) -> Reader:
        job, fmt, e, (i0, i1) = self.job, self.job.fmt, piece.expert, piece.in_rows
        packed = fmt is not None and fmt.kind in PACKED

        def read(name: str) -> torch.Tensor:
            if name == job.source:
                src = self.index.shard_of(name)
                dim = len(self.shape) - 2
                return read_rows(self.index.root / src.name, self.index.entry(name), src.name, dim, e, i0, i1)
            if fmt is not None and name == fmt.scale and grid is not None:
                return grid[e, -(-i0 // self.bn_in) : -(-i1 // self.bn_in)]  # i0: a block's start, or i1
            if packed and fmt is not None and name == fmt.scale:  # one scale per group of a row
                return self.whole(name).reshape(math.prod(self.shape[:-2]), self.shape[-2], -1)[e, i0:i1]
            return self.whole(name)

        return read
