"""Power-of-two (UE8M0) block scales: the definition every backend runs (plain torch, any device).

A block's scale is 2^e, stored as the E8M0 byte e + 127. From float values (bf16 masters): e is the
smallest exponent with 448 * 2^e >= max(amax, 1e-4), the scale DeepGEMM's per_block_cast_to_fp8
(use_ue8m0=True) aims at, computed exactly from the bits (frexp) rather than through a rounded
log2(amax / 448), so no value saturates. From values that were FP8 already (a second rounding): that
exponent and the few below it are tried, and each block takes the one whose squared error against
the float32 values is least (saturation at 448 counted), ties going to the larger exponent. The
errors are summed in float64 from exact squares, in a fixed pairwise order: the choice never depends
on the device or its vector unit.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # DeepGEMM's: an all-zero block still gets a finite scale
E8M0_BIAS = 127
SEARCH_BELOW = 3  # exponents tried below the ceiling one when requantizing FP8 values
FLOAT32_BIAS = 127  # float32's exponent bias (the E8M0 byte uses the same)
FLOAT32_EXPONENT_SHIFT = 23


def ceil_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 e, smallest with 448 * 2^e >= max(amax, 1e-4). 448 = 0.875 * 2^9, so with amax = m * 2^E
    (m in [0.5, 1)) e is E - 9, plus one when m > 0.875: exact, no rounded division or logarithm."""
    mantissa, exponent = torch.frexp(torch.clamp(amax, min=AMAX_FLOOR))
    return exponent.to(torch.int32) - 9 + (mantissa > 0.875).to(torch.int32)


def powers_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """2^e as float32, built from its bits (e in [-126, 127]: every exponent used here)."""
    return ((exponents.to(torch.int32) + FLOAT32_BIAS) << FLOAT32_EXPONENT_SHIFT).view(torch.float32)


def quantize_at(blocks: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """blocks [G, bn, gk, bk] float32 over scales 2^exponents [G, gk]: clamp(x / 2^e), one cast to e4m3."""
    scale = powers_of_two(exponents)[:, None, :, None]
    return (blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def block_squared_errors(blocks: torch.Tensor, q: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """[G, gk] float64: sum over each block of (q * 2^e - x)^2. The difference is exact in float32 (q * 2^e
    is x rounded to a coarser grid, or clamped, or zero) and its square exact in float64; the sum runs
    pairwise over the block's values in a fixed order of element-wise adds."""
    diff = (q.to(torch.float32) * powers_of_two(exponents)[:, None, :, None]).sub_(blocks)
    squares = diff.to(torch.float64)
    squares.mul_(squares)
    return pairwise_sum(pairwise_sum(squares, 3), 1)


def pairwise_sum(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` by halving: the same adds in the same order on every device."""
    while values.shape[dim] > 1:
        n = values.shape[dim]
        half = n // 2
        summed = values.narrow(dim, 0, half) + values.narrow(dim, half, half)
        if n % 2:
            summed.narrow(dim, 0, 1).add_(values.narrow(dim, n - 1, 1))
        values = summed
    return values.squeeze(dim)


def choose_exponents(blocks: torch.Tensor, amax: torch.Tensor, search: bool) -> torch.Tensor:
    """int32 [G, gk]: the ceiling exponent, or (search) the one of it and SEARCH_BELOW below it whose block
    squared error is least (the first, i.e. the largest, on a tie)."""
    ceiling = ceil_exponents(amax)
    if not search:
        return ceiling
    candidates = torch.stack([ceiling - i for i in range(SEARCH_BELOW + 1)])
    errors = torch.stack([block_squared_errors(blocks, quantize_at(blocks, e), e) for e in candidates])
    best = torch.argmin(errors, dim=0)  # the first minimum: the largest exponent among equals
    return torch.gather(candidates, 0, best[None])[0]


def quantize_pow2_chunk(blocks: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [G, bn, gk, bk] e4m3, E8M0 bytes [G, gk] uint8) for float32 blocks (zero-padded to whole blocks)."""
    amax = blocks.abs().amax(dim=(1, 3))
    exponents = choose_exponents(blocks, amax, search)
    return quantize_at(blocks, exponents), (exponents + E8M0_BIAS).to(torch.uint8)
