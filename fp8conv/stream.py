"""Row-band streaming of large 2-D FP8 weights: a band of rows is read, rewritten and written while the
next band is read and the previous ones are written (the scheduler runs the stages). Memory per job is
a few bands, not a tensor, and the band buffers are reused, so there are no page faults for fresh
allocations. Here: the sizes, which jobs stream, and one band's arithmetic."""

from __future__ import annotations

import math

import torch

from .backends import Backend
from .dtypes import ELEMENT_BYTES, torch_dtype
from .formats import CONVERTIBLE
from .plan import Action, Job
from .rewrite.dequant import scale_grid
from .safetensors_file import TensorEntry

BAND_ELEMENTS = 1 << 22  # ~4M elements per band: 4 MB of FP8 in, 8 MB of bf16 out
OUT_SLOTS = 3  # bands that may wait for the writer
READ_AHEAD = 3  # band reads in flight ahead of the arithmetic, across tensors
BAND_WORKERS = 2  # bands computed at once, one torch thread each (a pool the pipeline sizes to the cores)
IN_SLOTS = READ_AHEAD + BAND_WORKERS  # input bands held: those read ahead and those being computed
# Bytes held per band element at once: IN_SLOTS input bands (1 B) and OUT_SLOTS output bands (up to
# 4 B); the float32 work happens in the backend's cache-sized chunks, counted in BASE_BYTES.
BYTES_PER_BAND_ELEMENT = IN_SLOTS * 1 + OUT_SLOTS * 4
# What a run holds besides the bands: Python, torch, the backend's cache-sized scratch (measured:
# VmHWM 255 MB converting a checkpoint too small to stream; ~290 MB with the default bands).
BASE_BYTES = 256 * 2**20
MIN_BAND_BYTES = 16 * 2**20


def band_elements_for(max_memory: int | None) -> int:
    """Elements per band under a memory cap (the default when there is none)."""
    if max_memory is None:
        return BAND_ELEMENTS
    return max(1, min(BAND_ELEMENTS, (max_memory - BASE_BYTES) // BYTES_PER_BAND_ELEMENT))


def whole_tensor_bytes(job: Job, entry: TensorEntry) -> int:
    """What rewriting a tensor whole holds at once: its input, its outputs and a float32 copy."""
    return entry.nbytes + job.nbytes + 4 * math.prod(job.spec.shape)


def streamable(job: Job, entry: TensorEntry, band_elements: int | None = None) -> bool:
    """A 2-D FP8 weight, rewritten without padding, over one band: rewritten band by band."""
    band_elements = BAND_ELEMENTS if band_elements is None else band_elements
    return (
        job.action in (Action.DEQUANTIZE, Action.QUANTIZE)
        and job.fmt is not None
        and job.fmt.kind in CONVERTIBLE
        and len(entry.shape) == 2
        and job.spec.shape == entry.shape
        and entry.numel > band_elements
    )


def band_rows(job: Job, shape: tuple[int, ...], band_elements: int) -> int:
    """Rows per band: whole input blocks (and whole output blocks when quantizing), ~band_elements."""
    assert job.fmt is not None
    n, k = shape
    out_rows_block = (job.out_block or (1, k))[0] if job.action is Action.QUANTIZE else 1
    unit = math.lcm(job.fmt.math_block((n, k))[0], out_rows_block)
    return max(unit, (band_elements // max(k, 1)) // unit * unit)


class BandedJob:
    """One streamed job's arithmetic, band by band: each band of input rows (read by the caller) is
    rewritten into an output band; a QUANTIZE job's new scale fills in row by row (rows of its own per
    band, so bands may be computed side by side)."""

    def __init__(self, job: Job, shape: tuple[int, int], scale: torch.Tensor, backend: Backend, fp8_max: float):
        assert job.fmt is not None and job.band_rows > 0
        self.job, self.backend, self.fp8_max = job, backend, fp8_max
        n, k = shape
        self.shape = shape
        self.grid = scale_grid(scale, job.fmt, (n, k))[0]
        self.in_block = job.fmt.math_block((n, k))
        self.out_dtype = torch_dtype(job.spec.dtype)
        self.out_size = ELEMENT_BYTES[job.spec.dtype]
        quantize = job.action is Action.QUANTIZE
        self.new_scale = torch.ones(job.outputs[1].shape, dtype=torch.float32) if quantize else None

    @property
    def starts(self) -> range:
        """The first row of every band."""
        return range(0, self.shape[0], self.job.band_rows)

    def rows(self, r0: int) -> int:
        return min(self.job.band_rows, self.shape[0] - r0)

    def compute(self, w: torch.Tensor, r0: int, band: torch.Tensor) -> None:
        """Rewrite input rows [r0, r0 + w.shape[1]) (`w`: [1, rows, K] float8) into `band` ([1, rows, K])."""
        g0, g1 = r0 // self.in_block[0], -(-(r0 + w.shape[1]) // self.in_block[0])
        if self.new_scale is None:
            self.backend.dequantize_blocks(w, self.grid[g0:g1][None], self.in_block, band)
            return
        k = self.shape[1]
        ob = self.job.out_block or (1, k)
        o0, o1 = r0 // ob[0], -(-(r0 + w.shape[1]) // ob[0])
        band_scale = torch.empty((1, o1 - o0, self.new_scale.shape[-1]), dtype=torch.float32)
        self.backend.requantize_blocks(w, self.grid[g0:g1][None], self.in_block, ob, self.fp8_max, band, band_scale)
        self.new_scale.view(-1, self.new_scale.shape[-1])[o0:o1] = band_scale[0]  # rows of its own
