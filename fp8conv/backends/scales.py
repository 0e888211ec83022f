"""Scales in any stored dtype -> float32 values, exactly."""

from __future__ import annotations

import torch

E8M0_NAN = 0xFF
SMALLEST_E8M0_BITS = 0x00400000  # 2^-127 is a float32 subnormal: it has no exponent-only encoding


def scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """float32/bf16/f16 widen exactly; UE8M0 (e8m0 or uint8 exponent b) is 2^(b-127), read from the bytes."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        # view the bytes: a numeric cast of e8m0 would turn 2^(b-127) into a different integer
        exponent = scale.view(torch.uint8).to(torch.int32)
        bits = torch.where(exponent == 0, SMALLEST_E8M0_BITS, exponent << 23)
        bits = torch.where(exponent == E8M0_NAN, 0x7FC00000, bits)
        return bits.view(torch.float32)
    return scale.to(torch.float32)


def apply_global_scale(values: torch.Tensor, global_scale: torch.Tensor | None, divide: bool) -> None:
    """NVFP4's per-tensor scale on float32 values, in place, one float32 rounding: compressed-tensors
    divides by its weight_global_scale, ModelOpt multiplies by weight_scale_2. Every backend (and the CPU
    backend's tables) applies it here, so the operation and its order are one definition."""
    if global_scale is None:
        return
    if divide:
        values.div_(global_scale)
    else:
        values.mul_(global_scale)


def all_powers_of_two(scale: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(scale.to(torch.float32))
    return bool((mantissa == 0.5).all())
