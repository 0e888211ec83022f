"""Power-of-two requantization of e4m3 block FP8 straight from its codes: the fast path of quantize_pow2_rows
(the definition) for FP8 weights whose input blocks each hold whole output blocks (DeepSeek's 128x128 blocks
into ue8m0 blocks or MXFP8 groups).

Every value of an input block is one of 256 (backends.pow2_tables), and so is what it is written as at an
exponent, and its error: a 256-entry table per (input block, exponent) gives the output codes (one gather a
chunk), and a count of each input code per table (torch.bincount) the error report; the weight is never
decoded into float32. Each table is the definition's own operations on the 256 values, so the bytes are
the definition's. Exponents: a block's largest value is its largest magnitude code's (e4m3 magnitudes order
as their bytes); the blocks ceiling_wins cannot settle are searched on the same exact squares the
definition sums, each choice proven to be the definition's (pow2_blocks._search, pow2_group_search).

Two plans: pow2_blocks.BlockTables where each input block is one output block (ue8m0 from 128x128 blocks:
counts first, every choice from them), pow2_groups.GroupTables where input blocks hold many (MXFP8's 1x32
groups: choices per (input block, largest code), counts as the codes are written). Runs on the host for
every backend: table lookups and integer counts. Measured in docs/performance.md.
"""

from __future__ import annotations

import torch

from .pow2 import ReportSums, blocks_of
from .pow2_blocks import BlockTables
from .pow2_groups import GroupTables


def requantize_codes_pow2(
    codes: torch.Tensor,
    grid: torch.Tensor,
    in_block: tuple[int, int],
    out_block: tuple[int, int],
    report_rows: int,
    q_out: torch.Tensor,
) -> tuple[torch.Tensor, list[ReportSums], bool] | None:
    """Rows of one matrix of e4m3 codes [n, K] (starting on a row that starts an input block, an output block
    and a chunk of report rows), each output block inside one input block, requantized into q_out [n, K]
    (e4m3, contiguous): (E8M0 bytes [ceil(n/bn), ceil(K/bk)], the report's sums per chunk of report rows,
    whether every block kept its bytes). grid: the scales of the input blocks from the first row. None,
    q_out untouched, where the definition must decide instead (NaN codes, non-finite values, or values from
    outside one e4m3 block's range)."""
    n, k = codes.shape
    bn, bk = out_block
    blocks = blocks_of(codes.view(torch.uint8), bn, bk)
    one_each = tuple(in_block) == tuple(out_block)
    plan = BlockTables(blocks, grid, report_rows) if one_each else GroupTables(blocks, grid, in_block, report_rows)
    if not plan.usable:
        return None
    aligned = blocks.data_ptr() == codes.data_ptr()
    written = q_out.view(torch.uint8).view(blocks.shape) if aligned else torch.empty(blocks.shape, dtype=torch.uint8)
    parts = plan.apply(written)
    if not aligned:
        q_out.view(torch.uint8).copy_(written.view(blocks.shape[0] * bn, -1)[:n, :k])
    return plan.exponents, parts, plan.kept_all
