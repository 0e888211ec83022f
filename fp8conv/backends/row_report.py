"""The INT8 error report's sums, row by row (--to int8): the definition every backend runs.

A row's values over its scale, y = clamp(x / s) in float32, are written as the integers q = round(y), half to
even. Per row: (q - y)^2 and y^2 summed in float32 by the same pairwise halvings on every device
(pow2.pairwise_sum_: element-wise adds in a fixed order, so neither the vector unit nor the row chunks a
backend takes move a digit), each times s^2 in float64; and how many nonzero values became 0. The tensor's
report sums those rows in float64 in row order (rewrite.int8_report).
"""

from __future__ import annotations

import torch

from .pow2 import pairwise_sum_

ROW_SUMS = 3  # per row: squared error, squared values (float64, times s^2), values flushed to zero


def int8_row_sums_(
    y: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, work: torch.Tensor, out: torch.Tensor
) -> None:
    """y [rows, K] float32 and q, the same values rounded (float32 integers, already written out): both are
    overwritten (their squares, their squared errors). scale [rows] float32; work a float32 [rows, K]
    temporary; out [rows, ROW_SUMS] float64 receives the sums."""
    assert y.shape[1] < 2**24, "row counts are float32 sums of ones"
    # counted as float32 sums of ones and zeros: exact in any order below 2^24 (count_nonzero per row: ~7x slower)
    flushed = torch.ne(y, 0, out=work).sum(dim=1) - torch.ne(q, 0, out=work).sum(dim=1)
    err2 = pairwise_sum_(q.sub_(y).square_(), 1)  # an exact difference: q is y's nearest integer (or +-127)
    norm2 = pairwise_sum_(y.square_(), 1)
    squares = torch.square(scale.to(torch.float64))
    out[:, 0] = err2.to(torch.float64) * squares
    out[:, 1] = norm2.to(torch.float64) * squares
    out[:, 2] = flushed.to(torch.float64)
