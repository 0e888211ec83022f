"""A large 2-D FP8 or packed 4-bit weight rewritten band by band of rows (the plan's BANDED strategy):
the arithmetic of one band, the same as rewriting the tensor whole, into a reused output buffer."""

from __future__ import annotations

import torch

from ..backends import Backend
from ..dtypes import ELEMENT_BYTES, torch_dtype
from ..model.classify import PACKED
from ..plan.conversion import Action, RunJob
from .dequant import scale_grid
from .unpack import band_decoder, band_quantizer


class BandedJob:
    """One streamed job's arithmetic, band by band: each band of input rows (read by the caller, as
    bytes) is rewritten into an output band; a QUANTIZE job's new scale fills in row by row (rows of
    its own per band, so bands may be computed side by side). global_scale: a packed NVFP4 weight's."""

    def __init__(
        self,
        job: RunJob,
        scale: torch.Tensor,
        global_scale: torch.Tensor | None,
        backend: Backend,
        fp8_max: float,
        chunk_elements: int,  # packed weights quantized to FP8: float32 values decoded at once
    ) -> None:
        assert job.fmt is not None and job.band_rows > 0
        self.job, self.backend, self.fp8_max = job, backend, fp8_max
        n, k = job.spec.shape
        self.shape = (n, k)
        self.row_elements = k  # elements per output row (bands: fp8conv.plan.bands.bands)
        self.quantize = job.action is Action.QUANTIZE
        self.out_block = job.out_block or (1, k)
        packed = job.fmt.kind in PACKED
        self._decode = band_decoder(job.fmt, scale, global_scale, backend) if packed and not self.quantize else None
        self._requant = (
            band_quantizer(job.fmt, scale, global_scale, backend, self.out_block, fp8_max, chunk_elements)
            if packed and self.quantize
            else None
        )
        self.grid = scale if packed else scale_grid(scale, job.fmt, (n, k))[0]
        self.in_block = job.fmt.math_block((n, k))
        self.out_dtype = torch_dtype(job.spec.dtype)
        self.out_size = ELEMENT_BYTES[job.spec.dtype]
        self.new_scale = torch.ones(job.outputs[1].shape, dtype=torch.float32) if self.quantize else None
        self.counts: list[tuple[int, int]] = []  # packed to FP8: exact and all output blocks, per band

    def compute(self, read: torch.Tensor, r0: int, band: torch.Tensor) -> None:
        """Rewrite input rows [r0, r0 + rows) (`read`: their bytes as read) into `band` ([1, rows, K])."""
        w = read.view(1, band.shape[1], -1)  # [1, rows, bytes per row]
        fp8 = w.view(torch.float8_e4m3fn)  # packed: the bytes, read by the decoder
        g0, g1 = r0 // self.in_block[0], -(-(r0 + w.shape[1]) // self.in_block[0])
        if self.new_scale is None:
            if self._decode is not None:
                self._decode(w, r0, band)
            else:
                self.backend.dequantize_blocks(fp8, self.grid[g0:g1][None], self.in_block, band)
            return
        ob = self.out_block
        o0, o1 = r0 // ob[0], -(-(r0 + w.shape[1]) // ob[0])
        band_scale = torch.empty((1, o1 - o0, self.new_scale.shape[-1]), dtype=torch.float32)
        if self._requant is not None:
            self.counts.append(self._requant(w, r0, band, band_scale))
        else:
            self.backend.requantize_blocks(
                fp8, self.grid[g0:g1][None], self.in_block, ob, self.fp8_max, band, band_scale
            )
        self.new_scale.view(-1, self.new_scale.shape[-1])[o0:o1] = band_scale[0]  # rows of its own

    def add_exactness(self, exactness: list[int]) -> None:
        """Once every band is computed: packed to FP8, the exact and all output blocks, added in."""
        exactness[0] += sum(e for e, _ in self.counts)
        exactness[1] += sum(t for _, t in self.counts)
