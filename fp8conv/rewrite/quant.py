"""Quantize a weight to FP8 with one scale per row (channel) or per block: from float32, or straight from
another FP8 format (dequantized on the way, exactly as --to float32 would)."""

from __future__ import annotations

import math

import torch

from ..backends import Backend
from ..formats import WeightFormat
from .dequant import scale_grid


def quantize(
    w32: torch.Tensor, block: tuple[int, int] | None, fp8_max: float, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): q float8_e4m3fn like w32; scale [..., N, 1] for channel (block None) or the block grid."""
    shape = tuple(w32.shape)
    n, k = shape[-2], shape[-1]
    bn, bk = block or (1, max(k, 1))
    grid = (*shape[:-2], math.ceil(n / bn), math.ceil(k / bk))
    q = torch.empty(shape, dtype=torch.float8_e4m3fn)
    scale = torch.ones(grid, dtype=torch.float32)
    if q.numel():
        backend.quantize_blocks(
            w32.reshape(-1, n, k), (bn, bk), fp8_max, q.view(-1, n, k), scale.view(-1, grid[-2], grid[-1])
        )
    return q, scale


def requantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    fmt: WeightFormat,
    block: tuple[int, int] | None,
    fp8_max: float,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize(dequantize(weight, scale, fmt, float32), block, ...) without a float32 copy of the weight."""
    shape = tuple(weight.shape)
    n, k = shape[-2], shape[-1]
    out_block = block or (1, max(k, 1))
    grid = (*shape[:-2], math.ceil(n / out_block[0]), math.ceil(k / out_block[1]))
    q = torch.empty(shape, dtype=torch.float8_e4m3fn)
    new_scale = torch.ones(grid, dtype=torch.float32)
    if q.numel():
        backend.requantize_blocks(
            weight.reshape(-1, n, k),
            scale_grid(scale, fmt, shape),
            fmt.math_block(shape),
            out_block,
            fp8_max,
            q.view(-1, n, k),
            new_scale.view(-1, grid[-2], grid[-1]),
        )
    return q, new_scale
