"""Backends do the arithmetic; everything else is device-independent. Picked by name from a registry."""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import OptionsError


class Backend(Protocol):
    name: str

    def dequantize_blocks(
        self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor
    ) -> None:
        """out[m, r, c] = round_to(out.dtype)(float32(weight[m, r, c]) * float32(scale[m, r // bn, c // bk])).

        weight: [M, N, K] float8_e4m3fn; scale: [M, ceil(N/bn), ceil(K/bk)]; out: [M, N, K], any float
        dtype. One float32 product, one rounding: the definition every backend must match bit for bit.
        """
        ...

    def quantize_blocks(
        self,
        weight: torch.Tensor,
        block: tuple[int, int],
        fp8_max: float,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
    ) -> None:
        """Quantize float32 weight [M, N, K] to float8_e4m3fn blocks of `block` (channel: (1, K)).

        Per block, over the block zero-padded to full size: scale = amax / fp8_max in float32 (1.0 for
        an all-zero block, so it stays zero, never NaN); q = clamp(w / scale, -fp8_max, fp8_max) cast
        to float8_e4m3fn (round to nearest even). scale_out: [M, ceil(N/bn), ceil(K/bk)] float32.
        """
        ...


def get_backend(device: str) -> Backend:
    from .cpu import CpuBackend

    if device in ("auto", "cpu"):
        return CpuBackend()
    raise OptionsError(
        f"device {device!r} is not available in this version of fp8conv", fix="use --device cpu"
    )
