"""An independent, deliberately plain reference: pad to whole blocks, multiply in float32, crop."""

from __future__ import annotations

import math

import torch


def dequant_block_reference(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    n, k = q.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    assert tuple(scale.shape) == (gn, gk), (scale.shape, (gn, gk))
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = q.to(torch.float32)
    product = padded.view(gn, bn, gk, bk) * scale.to(torch.float32)[:, None, :, None]
    return product.reshape(gn * bn, gk * bk)[:n, :k].to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN-safe, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
