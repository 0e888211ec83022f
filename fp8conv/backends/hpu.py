"""Intel Gaudi through torch's "hpu" device; imported only when habana_frameworks is present.

The arithmetic is the reference's, on the HPU. Gaudi specifics live here: Gaudi2's FP8 range is
240 (e4m3fnuz-like), Gaudi3's 448; callers pick the range with --fp8-max / --target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..dtypes import FP8_MAX_GAUDI2, FP8_MAX_STANDARD
from .pow2 import ReportSums
from .torch_device import TorchDeviceBackend

if TYPE_CHECKING:
    import torch

GAUDI2_FP8_MAX = FP8_MAX_GAUDI2
GAUDI3_FP8_MAX = FP8_MAX_STANDARD


class HpuBackend(TorchDeviceBackend):
    def __init__(self) -> None:
        super().__init__("hpu", name="hpu")

    def quantize_pow2_blocks(
        self,
        weight: torch.Tensor,
        block: tuple[int, int],
        search: bool,
        q_out: torch.Tensor,
        exponents_out: torch.Tensor,
        report_rows: int,
    ) -> list[ReportSums]:
        """On the host: the exponent search sums squared errors in float64, which the HPU does not have."""
        host = TorchDeviceBackend("cpu")
        return host.quantize_pow2_blocks(weight, block, search, q_out, exponents_out, report_rows)
