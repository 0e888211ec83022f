"""A large 2-D FP8 or packed 4-bit weight rewritten band by band of rows (the plan's BANDED strategy):
the arithmetic of one band, the same as rewriting the tensor whole, into a reused output buffer."""

from __future__ import annotations

import math

import torch

from ..backends import Backend
from ..backends.pow2 import E8M0_BIAS
from ..backends.pow2_codes import requantize_codes_pow2
from ..backends.scratch import scratch
from ..dtypes import ELEMENT_BYTES, torch_dtype
from ..model.classify import PACKED
from ..output.requant_report import TensorError, exact
from ..plan.bands import REPORT_ROWS
from ..plan.conversion import Action, RunJob
from .dequant import scale_grid
from .exact_pow2 import exact_pow2_for, prefer_exact_pow2
from .int8_report import int8_tensor_error, row_sums_for
from .pow2 import ReportPart, from_codes, kept_exponents, pow2_band, tensor_error_of
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
        self.pow2 = job.action is Action.QUANTIZE_POW2  # E8M0 scales (pow2.pow2_band), with the error report
        self.out_block = job.out_block or (1, k)
        packed = job.fmt.kind in PACKED
        decodes = packed and not self.quantize  # to bf16, or to float32 for pow2_band
        self._decode = band_decoder(job.fmt, scale, global_scale, backend) if decodes else None
        # a block target from power-of-two scales: blocks a power of two holds exactly take it (exact_pow2)
        self._exact_pow2 = exact_pow2_for(job, scale, global_scale)
        self._requant = (
            band_quantizer(
                job.fmt, scale, global_scale, backend, self.out_block, fp8_max, chunk_elements, self._exact_pow2
            )
            if packed and self.quantize
            else None
        )
        self.grid = scale if packed else scale_grid(scale, job.fmt, (n, k))[0]
        self.in_block = job.fmt.math_block((n, k))
        self.out_dtype = torch_dtype(job.spec.dtype)
        self.out_size = ELEMENT_BYTES[job.spec.dtype]
        # pow2: rows dequantized and requantized at once, whole report chunks and input and output blocks
        self.pow2_chunk_rows = math.lcm(REPORT_ROWS, self.in_block[0], self.out_block[0])
        # pow2 from FP8: per output block, the input's exponent and whether it keeps its bytes (the input's
        # scale a power of two); None where none can, or output blocks straddle input blocks
        self._kept = None
        if self.pow2 and not packed and job.fmt.row_scales is None:
            kept = kept_exponents(self.grid[None], job.fmt, (1, n, k), self.out_block)
            self._kept = kept if kept is not None and bool(kept[1].any()) else None
        # pow2 from FP8 codes by tables where the input's blocks hold the output's (rewrite.pow2.from_codes)
        self._codes = self.pow2 and not packed and from_codes(job.fmt, (n, k), self.out_block)
        if self.pow2:  # E8M0 bytes, stored as the job says once every band is in (pow2.stored_exponents)
            self.new_scale = torch.full(job.outputs[1].shape, E8M0_BIAS, dtype=torch.uint8)
        else:
            self.new_scale = torch.ones(job.outputs[1].shape, dtype=torch.float32) if self.quantize else None
        # INT8 rows: each row's report sums, filled in by the bands (rows of their own) as the new scale is
        self.row_sums = row_sums_for((n, k), self.out_dtype) if self.quantize else None
        self.counts: list[tuple[int, int]] = []  # packed to FP8: exact and all output blocks, per band
        self.parts: dict[int, list[ReportPart]] = {}  # pow2: the error report's parts, by first row
        self.kept: dict[int, bool] = {}  # pow2: whether a band kept all its input's bytes, by first row

    def compute(self, read: torch.Tensor, r0: int, band: torch.Tensor) -> None:
        """Rewrite input rows [r0, r0 + rows) (`read`: their bytes as read) into `band` ([1, rows, K])."""
        w = read.view(1, band.shape[1], -1)  # [1, rows, bytes per row]
        fp8 = w.view(torch.float8_e4m3fn)  # packed: the bytes, read by the decoder
        g0, g1 = r0 // self.in_block[0], -(-(r0 + w.shape[1]) // self.in_block[0])
        if self.pow2:
            self._pow2(w, fp8, r0, g0, g1, band)
            return
        if self.new_scale is None:
            if self._decode is not None:
                self._decode(w, r0, band)
            else:
                self.backend.dequantize_blocks(fp8, self.grid[g0:g1][None], self.in_block, band)
            return
        ob = self.out_block
        o0, o1 = r0 // ob[0], -(-(r0 + w.shape[1]) // ob[0])
        band_scale = torch.empty((1, o1 - o0, self.new_scale.shape[-1]), dtype=torch.float32)
        sums = None if self.row_sums is None else self.row_sums[:, r0 : r0 + w.shape[1]]
        if self._requant is not None:
            self.counts.append(self._requant(w, r0, band, band_scale, sums))
        else:
            self.backend.requantize_blocks(
                fp8, self.grid[g0:g1][None], self.in_block, ob, self.fp8_max, band, band_scale, sums
            )
            if self._exact_pow2:  # the band's values again, to find the blocks a power of two holds exactly
                w32 = scratch("exact w32", tuple(band.shape), torch.float32)  # reused band after band
                self.backend.dequantize_blocks(fp8, self.grid[g0:g1][None], self.in_block, w32)
                self.counts.append(prefer_exact_pow2(w32, band, band_scale, ob, self.backend))
        self.new_scale.view(-1, self.new_scale.shape[-1])[o0:o1] = band_scale[0]  # rows of its own

    def _pow2(self, w: torch.Tensor, fp8: torch.Tensor, r0: int, g0: int, g1: int, band: torch.Tensor) -> None:
        """An E8M0 band, a chunk of whole report chunks and input blocks at a time (the float32 values stay a
        few MiB, in cache, never the band): the input's values (decoded, or dequantized), requantized by
        pow2_band (the input's bytes kept where its scales already are powers of two), the exponents into
        their rows of the new scale, the report's parts kept by first row."""
        if self._codes and band.is_contiguous() and self._pow2_from_codes(fp8[0], r0, g0, g1, band[0]):
            return
        rows, k = band.shape[1], band.shape[2]
        step = min(rows, self.pow2_chunk_rows)
        w32 = scratch("pow2 w32", (1, step, k), torch.float32)  # this thread's, reused band after band
        kept, parts = True, []
        for c0 in range(0, rows, step):
            c1 = min(rows, c0 + step)
            values = w32[:, : c1 - c0]
            o0, o1 = (r0 + c0) // self.out_block[0], -(-(r0 + c1) // self.out_block[0])
            if self._decode is not None:
                self._decode(w[:, c0:c1], r0 + c0, values)
                weight, kept_blocks = None, None
            else:
                b0, b1 = (r0 + c0) // self.in_block[0], -(-(r0 + c1) // self.in_block[0])
                weight = fp8[:, c0:c1]
                self.backend.dequantize_blocks(weight, self.grid[b0:b1][None], self.in_block, values)
                kept_blocks = None if self._kept is None else (self._kept[0][:, o0:o1], self._kept[1][:, o0:o1])
            q, exponents, chunk_parts, chunk_kept = pow2_band(values, weight, kept_blocks, self.out_block, self.backend)
            band[:, c0:c1].copy_(q)
            self.new_scale.view(-1, self.new_scale.shape[-1])[o0 : o0 + exponents.shape[-2]] = exponents[0]
            kept, parts = kept and chunk_kept, parts + chunk_parts
        self.kept[r0] = kept  # (bands are computed side by side: one key each, never a shared flag)
        self.parts[r0] = parts

    def _pow2_from_codes(self, codes: torch.Tensor, r0: int, g0: int, g1: int, out: torch.Tensor) -> bool:
        """The band requantized from its codes (backends.pow2_codes), as _pow2 would: False, nothing written,
        where its values need the definition."""
        done = requantize_codes_pow2(codes, self.grid[g0:g1], self.in_block, self.out_block, REPORT_ROWS, out)
        if done is None:
            return False
        exponents, parts, kept = done
        o0 = r0 // self.out_block[0]
        self.new_scale.view(-1, self.new_scale.shape[-1])[o0 : o0 + exponents.shape[0]] = exponents
        self.kept[r0], self.parts[r0] = kept, [ReportPart(*sums) for sums in parts]
        return True

    @property
    def reports(self) -> bool:
        """Whether the job has an error report: power-of-two scales, or INT8 rows."""
        return self.pow2 or self.row_sums is not None

    def report(self) -> TensorError:
        """Once every band is computed: the tensor's error report, its parts in row order; exact when every
        band kept the input's bytes (the whole tensor's verdict too). INT8: from its rows' sums."""
        elements = self.shape[0] * self.shape[1]
        if self.row_sums is not None:
            return int8_tensor_error(self.row_sums, elements)
        if all(self.kept.values()):
            return exact(elements)
        return tensor_error_of([p for r0 in sorted(self.parts) for p in self.parts[r0]], elements)

    def add_exactness(self, exactness: list[int]) -> None:
        """Once every band is computed: packed to FP8, the exact and all output blocks, added in."""
        exactness[0] += sum(e for e, _ in self.counts)
        exactness[1] += sum(t for _, t in self.counts)
