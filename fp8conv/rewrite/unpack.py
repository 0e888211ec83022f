"""Packed 4-bit weights (MXFP4, NVFP4, INT4) -> their float32 values, on a backend.

Each value is code value * group scale (exact: E2M1 has 2 significant bits, INT4 at most 3, the
scales are powers of two, e4m3 or bf16), then for NVFP4 one float32 rounding by the global scale:
compressed-tensors divides by weight_global_scale, ModelOpt multiplies by weight_scale_2.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..backends import Backend
from ..formats import Kind, WeightFormat
from .scales import scale_to_float32

# E2M1 code c: (-1)^(c >> 3) * [0, 0.5, 1, 1.5, 2, 3, 4, 6][c & 7]; INT4 (compressed-tensors): c - 8
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
INT4_VALUES = tuple(float(c - 8) for c in range(16))


def code_values(kind: Kind) -> torch.Tensor:
    return torch.tensor(INT4_VALUES if kind is Kind.INT4 else E2M1_VALUES, dtype=torch.float32)


def unpack_to_float32(
    read: Callable[[str], torch.Tensor], fmt: WeightFormat, backend: Backend, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight's float32 values rounded once to `dtype`, shaped fmt.shape ([..., N, K], before gpt-oss's
    transpose). Without a global scale the backend writes `dtype` directly; with one, float32 first."""
    assert fmt.shape is not None and fmt.scale is not None and fmt.group is not None
    shape = fmt.shape
    n, k = shape[-2], shape[-1]
    m = math.prod(shape[:-2])
    # int8 / uint8 / int32 containers: the bytes, viewed (little-endian: an int32's nibbles in order)
    codes = read(fmt.weight).contiguous().view(torch.uint8).reshape(m, n, k // 2)
    scale = scale_to_float32(read(fmt.scale)).reshape(m, n, k // fmt.group)
    direct = fmt.global_scale is None
    out = torch.empty((m, n, k), dtype=dtype if direct else torch.float32)
    if out.numel():
        backend.decode_4bit(codes, code_values(fmt.kind), scale, fmt.group, out)
    if fmt.global_scale is not None:
        g = read(fmt.global_scale).to(torch.float32).reshape(())
        if fmt.kind is Kind.NVFP4:
            out.div_(g)
        else:
            out.mul_(g)
    return out.view(shape) if out.dtype == dtype else out.view(shape).to(dtype)


def to_output_layout(w: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """gpt-oss's bf16 experts are [E, K, N] (transformers' GptOssExperts): transpose the last two dims."""
    if fmt.kind is Kind.MXFP4_GPT_OSS:
        return w.transpose(-1, -2).contiguous()
    return w


def block_exactness(w32: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    """(exact, total) output blocks: a block is exact when float32(q) * scale gives back every value."""
    n, k = w32.shape[-2], w32.shape[-1]
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    w3, q3 = w32.reshape(-1, n, k), q.reshape(-1, n, k)
    s3 = scale.reshape(-1, gn, gk)
    lossy = torch.zeros(w3.shape[0], gn * bn, gk * bk, dtype=torch.bool)
    expanded = s3.repeat_interleave(bn, dim=1)[:, :n].repeat_interleave(bk, dim=2)[:, :, :k]
    lossy[:, :n, :k] = (q3.to(torch.float32) * expanded) != w3
    per_block = lossy.view(-1, gn, bn, gk, bk).any(dim=4).any(dim=2)
    total = per_block.numel()
    return total - int(per_block.sum()), total
