"""Quantize a weight to FP8 (or INT8) with one scale per row (channel) or per block: from float32, or straight
from another FP8 format (dequantized on the way, exactly as --to float32 would)."""

from __future__ import annotations

import math

import torch

from ..backends import Backend
from ..model.classify import WeightFormat
from .dequant import scale_grid


def quantize(
    w32: torch.Tensor,
    block: tuple[int, int] | None,
    fp8_max: float,
    backend: Backend,
    dtype: torch.dtype = torch.float8_e4m3fn,
    row_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): q like w32, float8_e4m3fn (or int8, fp8_max 127); scale [..., N, 1] for channel (block
    None) or the block grid. row_sums: INT8 rows' report sums (int8_report.row_sums_for), filled in."""
    out_block, q, scale, q3, scale3 = _outputs(tuple(w32.shape), block, dtype)
    if q.numel():
        backend.quantize_blocks(w32.reshape(q3.shape), out_block, fp8_max, q3, scale3, row_sums)
    return q, scale


def requantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    fmt: WeightFormat,
    block: tuple[int, int] | None,
    fp8_max: float,
    backend: Backend,
    dtype: torch.dtype = torch.float8_e4m3fn,
    row_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize(dequantize(weight, scale, fmt, float32), block, ...) without a float32 copy of the weight."""
    shape = tuple(weight.shape)
    out_block, q, new_scale, q3, scale3 = _outputs(shape, block, dtype)
    if q.numel():
        backend.requantize_blocks(
            weight.reshape(q3.shape),
            scale_grid(scale, fmt, shape),
            fmt.math_block(shape),
            out_block,
            fp8_max,
            q3,
            scale3,
            row_sums,
        )
    return q, new_scale


def _outputs(
    shape: tuple[int, ...], block: tuple[int, int] | None, dtype: torch.dtype
) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output block ((1, K) for channel), q and its scale (1.0 until written), and both as the
    [M, N, K] / [M, gn, gk] views the backends take."""
    n, k = shape[-2], shape[-1]
    out_block = block or (1, max(k, 1))
    grid = (*shape[:-2], math.ceil(n / out_block[0]), math.ceil(k / out_block[1]))
    q = torch.empty(shape, dtype=dtype)
    scale = torch.ones(grid, dtype=torch.float32)
    m = math.prod(shape[:-2])  # not view(-1, ...): a weight with no rows leaves -1 ambiguous
    return out_block, q, scale, q.view(m, n, k), scale.view(m, grid[-2], grid[-1])
