"""Backends do the arithmetic; everything else is device-independent. Picked by name from a registry.

Every backend must produce the reference's bits: float32 product and one rounding for dequantizing;
amax, scale and division in float32, clamp, then one cast for quantizing.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Protocol

from ..errors import OptionsError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "reference", "cuda", "hpu")


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

    def requantize_blocks(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        in_block: tuple[int, int],
        out_block: tuple[int, int],
        fp8_max: float,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
        row_sums: torch.Tensor | None = None,
    ) -> None:
        """quantize_blocks(dequantize_blocks(weight, scale, in_block) as float32, out_block, ...): the
        same bits, without necessarily holding the float32 weight."""
        ...

    def quantize_blocks(
        self,
        weight: torch.Tensor,
        block: tuple[int, int],
        fp8_max: float,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
        row_sums: torch.Tensor | None = None,
    ) -> None:
        """Quantize float32 weight [M, N, K] to q_out's codes, float8_e4m3fn or int8, in blocks of `block`
        (channel: (1, K)).

        Per block, over the block zero-padded to full size: scale = amax / fp8_max in float32 (1.0 for
        an all-zero block, so it stays zero, never NaN); q = clamp(w / scale, -fp8_max, fp8_max) cast
        to float8_e4m3fn (round to nearest even), or for int8 (fp8_max 127) rounded half to even, then
        cast. scale_out: [M, ceil(N/bn), ceil(K/bk)] float32. row_sums (INT8 rows only, block (1, K)):
        [M, N, row_report.ROW_SUMS] float64, each row's error report sums (row_report.int8_row_sums_).
        """
        ...

    def quantize_pow2_blocks(
        self,
        weight: torch.Tensor,
        block: tuple[int, int],
        search: bool,
        q_out: torch.Tensor,
        exponents_out: torch.Tensor,
        report_rows: int,
    ) -> list[tuple[float, float, int, int]]:
        """Quantize float32 weight [M, N, K] to float8_e4m3fn blocks whose scales are powers of two
        (fp8conv.backends.pow2 defines the exponent: the ceiling one, or with `search` the least squared
        error of it and a few below). exponents_out: [M, ceil(N/bn), ceil(K/bk)] uint8 E8M0 bytes. Returns
        the error report's sums of each `report_rows`-row chunk of each matrix, in order
        (pow2.quantize_pow2_rows; the planner's bands are whole chunks: plan.bands.REPORT_ROWS)."""
        ...

    def decode_4bit(
        self,
        codes: torch.Tensor,
        values: torch.Tensor,
        scale: torch.Tensor,
        group: int,
        out: torch.Tensor,
        global_scale: torch.Tensor | None = None,
        divide_global: bool = False,
    ) -> None:
        """out[m, r, c] = round_to(out.dtype)(values[nibble c of codes[m, r]] * scale[m, r, c // group]),
        with a global scale: round_to(out.dtype)((that float32 product) / g or * g, rounded to float32).

        codes: [M, N, K/2] uint8, two 4-bit codes per byte, the low nibble first; values: the 16 float32
        values of the codes (E2M1, or INT4 as nibble - 8); scale: [M, N, K/group] float32, uint8 E8M0
        exponents b meaning 2^(b-127) (MXFP4: the bytes as stored, never cast), or float8_e4m3fn (NVFP4);
        global_scale: one float32 (NVFP4: compressed-tensors' weight_global_scale, divide_global=True;
        ModelOpt's weight_scale_2, multiplied); out: [M, N, K] float32 or bf16. The float32 product is
        exact for E2M1 and INT4 times power-of-two, e4m3 or bf16 scales; the global scale rounds it once
        in float32; then one rounding to out's dtype.
        """
        ...


def available_devices() -> list[str]:
    import torch  # here: only choosing a device needs torch

    found = ["cpu", "reference"]
    if torch.cuda.is_available():
        found.append("cuda")
    if hpu_available():
        found.append("hpu")
    return found


def hpu_available() -> bool:
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    import habana_frameworks.torch.core  # noqa: F401  registers the "hpu" device with torch
    import torch

    return bool(getattr(torch, "hpu", None) and torch.hpu.is_available())


def get_backend(device: str) -> Backend:
    """`auto` is the CPU: the GPU path has not been measured faster for a disk-bound job here."""
    import torch

    from .cpu import CpuBackend
    from .torch_device import TorchDeviceBackend

    if device in ("auto", "cpu"):
        return CpuBackend()
    if device == "reference":
        return TorchDeviceBackend("cpu", name="reference")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise OptionsError("--device cuda: no CUDA device is available", fix="use --device cpu")
        return TorchDeviceBackend("cuda", name="cuda")
    if device == "hpu":
        if not hpu_available():
            raise OptionsError(
                "--device hpu: no Intel Gaudi device (habana_frameworks) is available", fix="use --device cpu"
            )
        from .hpu import HpuBackend

        return HpuBackend()
    raise OptionsError(f"device {device!r} is not available", fix=f"use one of {', '.join(DEVICES)}")
