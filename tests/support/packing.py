"""The tests' own 4-bit packing and a plain decoding, written from the format definitions (not fp8conv's).

E2M1 code c: (-1)^(c >> 3) * [0, 0.5, 1, 1.5, 2, 3, 4, 6][c & 7]; INT4: c - 8. Two codes per byte, the
low nibble first; eight per int32, element 8g+j in bits [4j, 4j+4). E8M0 byte b: 2^(b - 127).
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def random_codes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 -> [..., K/2] uint8, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/8] int32, element 8g+j in bits [4j, 4j+4), by integer arithmetic."""
    words = torch.zeros((*codes.shape[:-1], codes.shape[-1] // 8), dtype=torch.int64)
    for j in range(8):
        words |= codes[..., j::8].to(torch.int64) << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of E2M1 codes, by the definition."""
    out = torch.zeros(codes.shape, dtype=torch.float64)
    for c in range(16):
        out[codes == c] = (-1.0) ** (c >> 3) * E2M1_MAGNITUDES[c & 7]
    return out


def e8m0_value(b: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, b.view(torch.uint8).to(torch.float64) - 127)


def group_scaled(values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """values [..., K] (float64) * scale [..., K/group] (float64) -> float64, exact for these formats."""
    return values * scale.repeat_interleave(group, dim=-1)


def random_e8m0(shape: tuple[int, ...], seed: int, low: int = 118, high: int = 130) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=gen, dtype=torch.uint8)


def random_e4m3_scales(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
