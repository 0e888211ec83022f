"""A large 2-D FP8 weight rewritten band by band of rows (the plan's BANDED strategy): the arithmetic
of one band, the same as rewriting the tensor whole, into a reused output buffer."""

from __future__ import annotations

import torch

from ..backends import Backend
from ..dtypes import ELEMENT_BYTES, torch_dtype
from ..plan import Action, Job
from .dequant import scale_grid


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
