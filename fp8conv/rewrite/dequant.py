"""Dequantize any convertible FP8 weight (block, channel, per-tensor) as one block computation."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..backends import Backend
from ..backends.pow2 import Decode
from ..backends.scales import scale_to_float32
from ..model.classify import WeightFormat


def stored_scale(read: Callable[[str], torch.Tensor], fmt: WeightFormat) -> torch.Tensor:
    """The scale a weight's math_block grid reads: its own, or for scale rows in another unit
    (fp8conv.model.mimo_kv) its own and its peer's stacked, one row per math block, as they were made."""
    assert fmt.scale is not None
    scale = read(fmt.scale)
    rows = fmt.row_scales
    if rows is None:
        return scale
    parts = [scale_to_float32(scale)] + ([scale_to_float32(read(rows.peer))] if rows.peer else [])
    return torch.cat(parts)[torch.tensor(rows.index, dtype=torch.long)]


def scale_grid(scale: torch.Tensor, fmt: WeightFormat, shape: tuple[int, ...]) -> torch.Tensor:
    """The scale as a [M, gn, gk] grid over the weight's math_block (M = product of leading dims)."""
    scale = scale_to_float32(scale)
    m = math.prod(shape[:-2])
    bn, bk = fmt.math_block(shape)
    gn, gk = math.ceil(shape[-2] / bn), math.ceil(shape[-1] / bk)
    if scale.numel() == 1:  # one scale for the whole tensor
        return scale.reshape(1, 1, 1).expand(m, gn, gk)
    if scale.numel() == m and gn > 1:  # one per expert of a fused [E, N, K] tensor
        return scale.reshape(m, 1, 1).expand(m, gn, gk)
    return scale.reshape(m, gn, gk)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat, out_dtype: torch.dtype, backend: Backend
) -> torch.Tensor:
    shape = tuple(weight.shape)
    n, k = shape[-2], shape[-1]
    out = torch.empty(shape, dtype=out_dtype)
    if out.numel():
        backend.dequantize_blocks(
            weight.reshape(-1, n, k),
            scale_grid(scale, fmt, shape),
            fmt.math_block(shape),
            out.view(-1, n, k),
        )
    return out


def unit_scale_decoder(backend: Backend) -> Decode:
    """e4m3 codes [gr, bn, gk, bk] into float32 laid out alike: the backend's dequantization under a unit
    scale (torch's cast's bits, at the backend's speed)."""

    def decode(codes: torch.Tensor, out: torch.Tensor) -> None:
        rows = codes.reshape(1, -1, codes.shape[2] * codes.shape[3])
        backend.dequantize_blocks(rows, torch.ones(1, 1, 1), (rows.shape[1], rows.shape[2]), out.view(rows.shape))

    return decode
