"""--to int8's error report per tensor, from the rows' sums the backend took as it quantized
(backends.row_report): float64 sums in row order, so the same digits whole or in bands, on every host."""

from __future__ import annotations

import math

import torch

from ..backends.pow2 import sum64
from ..backends.row_report import ROW_SUMS
from ..output.requant_report import TensorError


def new_row_sums(shape: tuple[int, ...]) -> torch.Tensor:
    """[M, N, ROW_SUMS] float64 for a weight [..., N, K] (M: the product of the leading axes, 1 for 2-D)."""
    return torch.zeros(math.prod(shape[:-2]), shape[-2], ROW_SUMS, dtype=torch.float64)


def int8_tensor_error(row_sums: torch.Tensor, elements: int) -> TensorError:
    """||written - input|| / ||input|| over the whole tensor, and its values flushed to zero (none saturate:
    each row's largest value is 127 steps)."""
    rows = row_sums.reshape(-1, ROW_SUMS)
    err2, norm2 = sum64(rows[:, 0]), sum64(rows[:, 1])
    relative = math.sqrt(err2 / norm2) if norm2 > 0 else 0.0
    return TensorError(relative, 0, int(rows[:, 2].sum()), elements)
