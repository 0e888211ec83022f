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


def get_backend(device: str) -> Backend:
    from .cpu import CpuBackend

    if device in ("auto", "cpu"):
        return CpuBackend()
    raise OptionsError(
        f"device {device!r} is not available in this version of fp8conv", fix="use --device cpu"
    )
