"""Intel Gaudi through torch's "hpu" device; imported only when habana_frameworks is present.

The arithmetic is the reference's, on the HPU. Gaudi specifics live here: Gaudi2's FP8 range is
240 (e4m3fnuz-like), Gaudi3's 448; callers pick the range with --fp8-max / --target.
"""

from __future__ import annotations

from ..dtypes import FP8_MAX_GAUDI2, FP8_MAX_STANDARD
from .torch_device import TorchDeviceBackend

GAUDI2_FP8_MAX = FP8_MAX_GAUDI2
GAUDI3_FP8_MAX = FP8_MAX_STANDARD


class HpuBackend(TorchDeviceBackend):
    def __init__(self) -> None:
        super().__init__("hpu", name="hpu")
