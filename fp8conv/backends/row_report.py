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


def int8_row_sums_(planes: torch.Tensor, scale: torch.Tensor, work: torch.Tensor, out: torch.Tensor) -> None:
    """planes [2, rows, K] float32: y, then q (y rounded to integers, already written out); both overwritten
    (their squared errors, their squares), summed together. scale [rows] float32; work a float32 [rows, K]
    temporary; out [rows, ROW_SUMS] float64 receives the sums."""
    y, q = planes[0], planes[1]
    assert y.shape[1] < 2**24, "row counts are float32 sums of ones"
    # counted as float32 sums of ones and zeros: exact in any order below 2^24 (count_nonzero per row: ~7x slower)
    flushed = torch.ne(y, 0, out=work).sum(dim=1) - torch.ne(q, 0, out=work).sum(dim=1)
    q.sub_(y).square_()  # an exact difference: q is y's nearest integer (or +-127), squared
    y.square_()
    norm2, err2 = pairwise_sum_(planes, 2)  # both planes' rows at once: the same adds as one by one
    squares = torch.square(scale.to(torch.float64))
    out[:, 0] = err2.to(torch.float64) * squares
    out[:, 1] = norm2.to(torch.float64) * squares
    out[:, 2] = flushed.to(torch.float64)
