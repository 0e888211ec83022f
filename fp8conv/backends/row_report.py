"""The INT8 error report's sums, row by row (--to int8): the definition every backend runs.

A row's values over its scale, y = clamp(x / s) in float32, are written as the integers q = round(y), half to
even. Per row: (q - y)^2 and y^2 summed in float32 by the same pairwise halvings on every device
(pow2.pairwise_sum_: element-wise adds in a fixed order, so neither the vector unit nor the row chunks a
backend takes move a digit), each times s^2 in float64. The tensor's report sums those rows in float64 in
row order (rewrite.int8_report).

Values written as 0 are not counted: INT8 per row writes every value under half its row's step as 0 (about
1% of a Gaussian row: the format's, not a fault), their loss is in the squared error, and counting them
(a compare and a sum over y, again over q) cost 0.14x of --to channel's whole run (bench, 1 GiB).
"""

from __future__ import annotations

import torch

from .pow2 import pairwise_sum_

ROW_SUMS = 2  # per row: squared error, squared values (float64, times s^2)


def int8_row_sums_(planes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """planes [2, rows, K] float32: y, then q (y rounded to integers, already written out); both overwritten
    (their squared errors, their squares), summed together. scale [rows] float32; out [rows, ROW_SUMS]
    float64 receives the sums."""
    planes[1].sub_(planes[0])  # an exact difference: q is y's nearest integer (or +-127)
    torch.mul(planes, planes, out=planes)  # both squared in one pass
    norm2, err2 = pairwise_sum_(planes, 2)  # both planes' rows at once: the same adds as one by one
    squares = torch.square(scale.to(torch.float64))
    out[:, 0] = err2.to(torch.float64) * squares
    out[:, 1] = norm2.to(torch.float64) * squares
