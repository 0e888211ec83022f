"""One weight to FP8 with power-of-two (E8M0) scales: block FP8 for DeepGEMM (--to block --scale-fmt
ue8m0, 128x128 blocks) or MXFP8 (--to mxfp8, 1x32 groups along K), with its error report.

From float weights: one rounding at the ceiling exponent. From FP8 (or packed 4-bit) weights: their
float32 values requantized once, each block at its least-squared-error exponent; except that an output
block lying inside one input block whose scale already is a power of two keeps the weight's bytes and
takes that exponent (exact: nothing moves). Block by block, so a band of rows gives the bits the whole
tensor does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..backends import Backend
from ..backends.pow2 import (
    E8M0_BIAS,
    blocks_of,
    chunk_report,
    fresh_buffers,
    powers_of_two,
    saturated_values,
    sum64,
)
from ..backends.pow2_codes import requantize_codes_pow2
from ..backends.pow2_tables import power_of_two_scales
from ..dtypes import torch_dtype
from ..model.classify import CONVERTIBLE, PACKED, WeightFormat
from ..output.requant_report import TensorError, exact
from ..plan.bands import REPORT_ROWS
from ..plan.conversion import Job
from .chunks import in_chunks, in_chunks_shape, per_chunk_grid
from .dequant import dequantize, scale_grid, stored_scale, unit_scale_decoder
from .pad import pad_to
from .unpack import unpack_to_float32


def run_pow2_job(
    job: Job, read: Callable[[str], torch.Tensor], backend: Backend
) -> tuple[list[torch.Tensor], TensorError]:
    """[weight, E8M0 scale] as planned (the scale's dtype: F8_E8M0 or U8, the same bytes), and the report.
    Rows in chunks (job.out_chunks) are quantized chunk by chunk, each on its own grid."""
    tensors, error = _pow2_tensors(job, read, backend)
    q, exponents = tensors
    return [q.reshape(job.spec.shape), stored_exponents(exponents.reshape(job.outputs[1].shape), job)], error


def stored_exponents(exponents: torch.Tensor, job: Job) -> torch.Tensor:
    """E8M0 bytes as the job stores its scale: the same bytes (F8_E8M0 / U8), or the float32 power of two
    they mean (2^(b - 127), exact)."""
    dtype = job.outputs[1].dtype
    if dtype == "F32":
        return powers_of_two(exponents.view(torch.uint8).to(torch.int32) - E8M0_BIAS)
    return exponents.view(torch_dtype(dtype))


def _pow2_tensors(
    job: Job, read: Callable[[str], torch.Tensor], backend: Backend
) -> tuple[tuple[torch.Tensor, torch.Tensor], TensorError]:
    """(q, E8M0 bytes) in the job's chunks ([C, N/C, K] and [C, gn, gk] for rows in chunks), the report."""
    assert job.out_block is not None
    chunks = job.out_chunks
    if job.fmt is None:
        w32, search = read(job.source).to(torch.float32), False
    elif job.fmt.kind in PACKED:
        w32, search = unpack_to_float32(read, job.fmt, backend), True
    else:
        assert job.fmt.scale is not None
        weight, scale, fmt = read(job.source), read(job.fmt.scale), job.fmt
        if chunks > 1 and fmt.block and per_chunk_grid(tuple(scale.shape), tuple(weight.shape), chunks, fmt.block):
            # each chunk alone is plain block FP8: its bytes can be kept where its scales are powers of two
            weight, scale = in_chunks(weight, chunks), scale.reshape(chunks, -1, scale.shape[-1])
            fmt = replace(fmt, row_scales=None, chunked=None)
        elif fmt.row_scales is not None:
            scale = stored_scale(read, fmt)
        chunked_view = weight.dim() > len(job.spec.shape)
        unpadded = tuple(weight.shape) == (in_chunks_shape(job.spec.shape, chunks) if chunked_view else job.spec.shape)
        kept = kept_exponents(scale, fmt, tuple(weight.shape), job.out_block) if unpadded else None
        if kept is not None and bool(kept[1].all()):  # every block stays: no arithmetic at all
            return (weight, kept[0]), exact(weight.numel())
        codes = unpadded and not chunked_view and weight.dtype == torch.float8_e4m3fn
        if codes and from_codes(fmt, tuple(weight.shape), job.out_block):
            done = _pow2_from_codes(weight, scale, fmt, job.out_block)
            if done is not None:
                return done
        w32, search = dequantize(weight, scale, fmt, torch.float32, backend), True
        if kept is not None and bool(kept[1].any()):
            q, exponents = quantize_pow2(w32, job.out_block, search, backend)
            q, exponents = _with_kept_blocks(q, exponents, weight, kept, job.out_block)
            return (q, exponents), tensor_error(w32, q, exponents, job.out_block, backend)  # as written
        if chunked_view:  # back to its rows: quantized in chunks below, as every other input is
            w32 = w32.reshape(-1, w32.shape[-1])
    w32 = in_chunks(pad_to(w32, job.spec.shape, parts=job.pad_parts), chunks)
    q, exponents, parts = quantize_pow2_reported(w32, job.out_block, search, backend)
    return (q, exponents), tensor_error_of(parts, w32.numel())


def from_codes(fmt: WeightFormat, shape: tuple[int, ...], out_block: tuple[int, int]) -> bool:
    """Whether an FP8 weight [..., N, K] of this format may be requantized from its codes
    (requantize_codes_pow2): a plain scale grid whose blocks each hold whole output blocks."""
    if fmt.kind not in CONVERTIBLE or fmt.row_scales is not None:
        return False
    in_block = fmt.math_block(shape)
    n, k = shape[-2], shape[-1]
    return (
        _inner_index(n, out_block[0], in_block[0]) is not None
        and _inner_index(k, out_block[1], in_block[1]) is not None
    )


def _pow2_from_codes(
    weight: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat, out_block: tuple[int, int]
) -> tuple[tuple[torch.Tensor, torch.Tensor], TensorError] | None:
    """(q, E8M0 bytes) and the report of a whole FP8 weight [..., N, K] requantized from its codes, matrix by
    matrix (from_codes holds); None where its values need the definition (requantize_codes_pow2)."""
    shape = tuple(weight.shape)
    n, k = shape[-2], shape[-1]
    in_block = fmt.math_block(shape)
    grid = scale_grid(scale, fmt, shape)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn)
    out_grid = (math.ceil(n / out_block[0]), math.ceil(k / out_block[1]))
    exponents = torch.empty((grid.shape[0], *out_grid), dtype=torch.uint8)
    parts: list[ReportPart] = []
    for m, (codes, out) in enumerate(zip(weight.reshape(-1, n, k), q.view(-1, n, k), strict=True)):
        done = requantize_codes_pow2(codes, grid[m], in_block, out_block, REPORT_ROWS, out)
        if done is None:
            return None
        exponents[m] = done[0]
        parts += [ReportPart(*sums) for sums in done[1]]
    return (q, exponents.reshape(*shape[:-2], *exponents.shape[1:])), tensor_error_of(parts, weight.numel())


def pow2_band(
    w32: torch.Tensor,
    weight: torch.Tensor | None,
    kept: tuple[torch.Tensor, torch.Tensor] | None,
    block: tuple[int, int],
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor, list[ReportPart], bool]:
    """Rows of whole output blocks, starting at a multiple of REPORT_ROWS: (q, E8M0 bytes, the report's
    parts) from their float32 values w32 [1, rows, K]. `weight` and `kept` (an FP8 input's bytes of those
    rows, and kept_exponents' answer for their output blocks): blocks whose input scale is a power of two
    keep the input's bytes and exponent, as the whole tensor's would (the last value: every block kept).
    Only FP8 and packed weights stream in bands: each block's exponent is searched."""
    if weight is not None and kept is not None and bool(kept[1].all()):  # every block stays: no arithmetic;
        # its parts (all error 0) count for the tensor's norm, unless every band of the tensor is kept
        return weight, kept[0], report_parts(w32, weight, kept[0], block, backend), True
    q, exponents, parts = quantize_pow2_reported(w32, block, True, backend)
    if weight is not None and kept is not None and bool(kept[1].any()):  # the report as written
        q, exponents = _with_kept_blocks(q, exponents, weight, kept, block)
        parts = report_parts(w32, q, exponents, block, backend)
    return q, exponents, parts, False


def _with_kept_blocks(
    q: torch.Tensor,
    exponents: torch.Tensor,
    weight: torch.Tensor,
    kept: tuple[torch.Tensor, torch.Tensor],
    block: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The requantized blocks, with those whose input scale is a power of two replaced by the input's bytes
    and exponent."""
    kept_bytes, mask = kept
    exponents = torch.where(mask.reshape(exponents.shape), kept_bytes.reshape(exponents.shape), exponents)
    n, k = q.shape[-2], q.shape[-1]
    rows = mask.reshape(-1, *mask.shape[-2:]).repeat_interleave(block[0], dim=1)[:, :n]
    elements = rows.repeat_interleave(block[1], dim=2)[:, :, :k].reshape(q.shape)
    q = torch.where(elements, weight.view(torch.uint8), q.view(torch.uint8)).view(torch.float8_e4m3fn)
    return q, exponents


def quantize_pow2(
    w32: torch.Tensor, block: tuple[int, int], search: bool, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn like w32, E8M0 bytes uint8 [..., ceil(N/bn), ceil(K/bk)])."""
    q, exponents, _ = quantize_pow2_reported(w32, block, search, backend)
    return q, exponents


def quantize_pow2_reported(
    w32: torch.Tensor, block: tuple[int, int], search: bool, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor, list[ReportPart]]:
    """quantize_pow2, with the error report's parts the backend summed as it went (one pass)."""
    shape = tuple(w32.shape)
    n, k = shape[-2], shape[-1]
    grid = (*shape[:-2], math.ceil(n / block[0]), math.ceil(k / block[1]))
    q = torch.empty(shape, dtype=torch.float8_e4m3fn)
    exponents = torch.full(grid, E8M0_BIAS, dtype=torch.uint8)
    sums = []
    if q.numel():
        sums = backend.quantize_pow2_blocks(
            w32.reshape(-1, n, k), block, search, q.view(-1, n, k), exponents.view(-1, grid[-2], grid[-1]), REPORT_ROWS
        )
    return q, exponents, [ReportPart(*s) for s in sums]


def kept_exponents(
    scale: torch.Tensor, fmt: WeightFormat, shape: tuple[int, ...], out_block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """When each output block lies inside one input block: per output block [M, gn, gk], the E8M0 byte of
    its input scale and whether the block can keep its bytes (that scale a positive power of two E8M0
    holds). None when output blocks straddle input blocks, or no input scale is such a power of two (amax/448
    scales: checked on the scale grid, before the gather per output block, which the main thread would pay
    for a whole tensor before its first band)."""
    if fmt.kind not in CONVERTIBLE:
        return None
    n, k = shape[-2], shape[-1]
    in_block = fmt.math_block(shape)
    rows, cols = _inner_index(n, out_block[0], in_block[0]), _inner_index(k, out_block[1], in_block[1])
    if rows is None or cols is None:
        return None
    e, keep = power_of_two_scales(scale_grid(scale, fmt, shape))
    if not bool(keep.any()):
        return None
    kept_bytes = (e.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    return kept_bytes[:, rows][:, :, cols].contiguous(), keep[:, rows][:, :, cols].contiguous()


def _inner_index(size: int, out_block: int, in_block: int) -> torch.Tensor | None:
    """For each output block along an axis, the input block holding all of it; None if one straddles two."""
    starts = torch.arange(0, size, out_block)
    ends = torch.clamp(starts + out_block, max=size) - 1
    first, last = starts // in_block, ends // in_block
    return first if bool((first == last).all()) else None


@dataclass(frozen=True)
class ReportPart:
    """The error report's sums over one REPORT_ROWS-row chunk of one matrix (float64 sums, counts)."""

    err2: float
    norm2: float
    saturated: int
    flushed: int


def report_parts(
    w32: torch.Tensor, q: torch.Tensor, exponents: torch.Tensor, block: tuple[int, int], backend: Backend
) -> list[ReportPart]:
    """The report's parts of written q and exponents (where some blocks took the input's bytes after the
    backend quantized): pow2.chunk_report over each REPORT_ROWS-row chunk of each matrix, as the backend
    sums them. w32, q: [..., n, K]; exponents: the E8M0 bytes [..., ceil(n/bn), ceil(K/bk)]."""
    n, k = w32.shape[-2], w32.shape[-1]
    x3, q3 = w32.reshape(-1, n, k), q.reshape(-1, n, k)
    e3 = exponents.reshape(x3.shape[0], -1, exponents.shape[-1]).view(torch.uint8)
    bn, bk = block
    buffers, decode = fresh_buffers(w32.device), unit_scale_decoder(backend)
    parts = []
    for m in range(x3.shape[0]):
        for r0 in range(0, n, REPORT_ROWS):
            r1 = min(n, r0 + REPORT_ROWS)
            e = e3[m, r0 // bn : -(-r1 // bn)].to(torch.int32) - E8M0_BIAS
            blocks = blocks_of(x3[m, r0:r1], bn, bk)
            y = blocks * powers_of_two(-e)[:, None, :, None]
            amax = torch.maximum(blocks.amax(dim=3).amax(dim=1), blocks.amin(dim=3).amin(dim=1).neg_())
            codes = blocks_of(q3[m, r0:r1], bn, bk)
            sums = chunk_report(blocks, y, codes, e, saturated_values(y, amax, e), decode, buffers)
            parts.append(ReportPart(*sums))
    return parts


def tensor_error_of(parts: list[ReportPart], elements: int) -> TensorError:
    """A tensor's report from its parts, in row order."""
    err2 = sum64(torch.tensor([p.err2 for p in parts], dtype=torch.float64))
    norm2 = sum64(torch.tensor([p.norm2 for p in parts], dtype=torch.float64))
    relative = math.sqrt(err2 / norm2) if norm2 > 0 else 0.0
    return TensorError(relative, sum(p.saturated for p in parts), sum(p.flushed for p in parts), elements)


def tensor_error(
    w32: torch.Tensor, q: torch.Tensor, exponents: torch.Tensor, block: tuple[int, int], backend: Backend
) -> TensorError:
    """w32, q: [..., N, K]; exponents: the E8M0 bytes [..., ceil(N/bn), ceil(K/bk)]."""
    return tensor_error_of(report_parts(w32, q, exponents, block, backend), w32.numel())
