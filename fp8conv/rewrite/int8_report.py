"""--to int8's error report per tensor, from the rows' sums the backend took as it quantized
(backends.row_report): float64 sums in row order, so the same digits whole or in bands, on every host."""

from __future__ import annotations

import math

import torch

from ..backends.pow2 import sum64
from ..backends.row_report import ROW_SUMS
from ..output.requant_report import TensorError


def row_sums_for(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The report's row sums of a weight [..., N, K] quantized to `dtype`: [M, N, ROW_SUMS] float64 (M: the
    product of the leading axes, 1 for 2-D) for INT8 rows, None for FP8 (no per-row report)."""
    if dtype != torch.int8:
        return None
    return torch.zeros(math.prod(shape[:-2]), shape[-2], ROW_SUMS, dtype=torch.float64)


def int8_tensor_error(row_sums: torch.Tensor, elements: int) -> TensorError:
    """||written - input|| / ||input|| over the whole tensor (none saturate: each row's largest value is 127
    steps; values written as 0 are not counted, see backends.row_report)."""
    rows = row_sums.reshape(-1, ROW_SUMS)
    err2, norm2 = sum64(rows[:, 0]), sum64(rows[:, 1])
    relative = math.sqrt(err2 / norm2) if norm2 > 0 else 0.0
    return TensorError(relative, 0, None, elements)
