"""Power-of-two requantization of e4m3 block FP8 straight from its codes, by tables: the fast path of
quantize_pow2_rows (the definition) for FP8 weights whose input blocks each hold whole output blocks
(DeepSeek's 128x128 blocks into ue8m0 blocks or MXFP8 groups; a per-tensor scale holds them all).

Every value of an input block is x = float32(code) * s, s the block's scale: one of 256 values. Written at
exponent e, its output code is one of 256 too, and so are its error and its square. So for each (input
block, exponent) pair that occurs, a 256-entry table holds the output codes, and a count of each input code
(torch.bincount) gives the error report; the weight's values are never decoded into float32. Each table is
the definition's own operations on the 256 values (the float32 product, x / 2^e, the clamp, one cast), so
the bytes are the definition's; the largest value of a block is its largest magnitude code's (e4m3
magnitudes order as their bytes); the blocks ceiling_wins cannot settle are searched by choose_exponents on
their values (the definition itself, on a few percent of blocks, once per band instead of once per chunk).

Measured on one thread, 128 rows of K = 7168: ~2 ns a value against ~7.3 for dequantizing and
quantize_pow2_rows (docs/performance.md). Runs on the host for every backend: table lookups and integer
counts.

The report (ReportSums per chunk of report rows): per table, count x squared error (exact: the error is a
float32 difference, its square exact in float64), summed pairwise over the 256 codes, times 4^e, then
pairwise over the chunk's tables in order; saturated and flushed values are counts. The tables a chunk
uses, in (input block, exponent) order, are the chunk's own, so its digits do not depend on the band.
"""

from __future__ import annotations

import torch

from .pow2 import (
    E8M0_BIAS,
    FP8_MAX,
    SEARCH_BELOW,
    ReportSums,
    block_sums,
    blocks_of,
    ceil_exponents,
    ceiling_wins,
    pairwise_sum_,
    powers_of_two,
    search_exponents,
    sum64,
)
from .scratch import scratch

CODES = 256
MAGNITUDES = 128  # e4m3 codes without their sign bit: a table's second half is its first with the sign set
SIGN = 0x80
NAN_MAGNITUDE = 0x7F  # e4m3fn's NaN, either sign
EXPONENT_SPAN = 32  # tables per input block at most: e4m3 spans 2^-9..448 (under 18 binades), search 3 below
E4M3_VALUES = torch.arange(MAGNITUDES, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


class PowerOfTwoTables:
    """One band's output exponents and tables: built from the band's codes and input scales, then applied
    chunk by chunk (apply). usable False: the definition must decide (NaN codes, non-finite values, values
    from outside one e4m3 block's range).

    A block's exponent, unless searched, depends on its input block and its largest magnitude code alone, as
    do its table: both are worked out once per (input block, largest code) that occurs, then looked up per
    block (a band of MXFP8 groups has one block per 32 values: per-block arithmetic would cost more than
    the tables)."""

    def __init__(self, blocks: torch.Tensor, grid: torch.Tensor, in_block: tuple[int, int], report_rows: int) -> None:
        """blocks: the band's codes as uint8 [gn, bn, gk, bk] (blocks_of: zero-padded to whole output blocks);
        grid: [gn_in, gk_in] float32 scales of the input blocks from the band's first row."""
        gn, bn, gk, bk = blocks.shape
        self.blocks, self.report_rows = blocks, report_rows
        rows = (torch.arange(gn) * bn) // in_block[0]
        columns = (torch.arange(gk) * bk) // in_block[1]
        self.in_id = (rows[:, None] * grid.shape[1] + columns[None, :]).to(torch.int32)  # each block's input block
        grid = grid.reshape(-1).to(torch.float32)
        # the positive codes' values in each input block: the definition's float32 product
        self.values = E4M3_VALUES[None, :] * grid[:, None]
        self.top = _largest_magnitudes(blocks, report_rows) + self.in_id * MAGNITUDES  # (input block, top) keys
        present = torch.zeros(self.values.numel(), dtype=torch.bool)
        present[self.top.reshape(-1)] = True
        present = present.view(self.values.shape)
        amax = self.values.abs()  # a block's largest value, by its largest code
        self.usable = not bool(present[:, NAN_MAGNITUDE].any()) and bool(torch.isfinite(amax[present]).all())
        if self.usable:
            self.usable = self._choose(amax, present, _kept_exponents(grid))

    def _choose(self, amax: torch.Tensor, present: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Per (input block, largest code): the exponent (the input's where its scale is a power of two, else
        the ceiling), whether the search may move it, its table; then per block, and the search."""
        gn, bn, gk, bk = self.blocks.shape
        kept_exponent, keeps = kept
        ceiling = ceil_exponents(amax)
        base = torch.where(keeps[:, None], kept_exponent[:, None], ceiling)
        open_tops = ~ceiling_wins(amax, ceiling, bn * bk) & ~keeps[:, None] & present
        lowest = torch.iinfo(torch.int32).min
        self.top_exponent = torch.where(present, base, lowest).amax(dim=1)  # each input block's largest exponent
        below = self.top_exponent[:, None] - base
        below[:, 0] = 0  # an all-zero block: every table writes its zeros as they are; its exponent is its own
        if int(torch.where(present, below, 0).max()) + SEARCH_BELOW >= EXPONENT_SPAN:
            return False  # not one e4m3 block's values: the definition decides
        in_blocks = torch.arange(amax.shape[0])[:, None]
        keys = in_blocks * EXPONENT_SPAN + below
        used = torch.zeros(amax.shape[0] * EXPONENT_SPAN, dtype=torch.bool)
        used[keys[present]] = True
        for i in range(1, SEARCH_BELOW + 1):  # the exponents the search may try
            used[keys[open_tops] + i] = True
        self.table_at = (torch.cumsum(used, 0) - 1).to(torch.int32)  # dense (input block, exponent) key -> table
        self._build_tables(torch.nonzero(used)[:, 0])
        top = self.top.reshape(-1)
        self.kept_all = bool(keeps.all())
        self.exponents = (base + E8M0_BIAS).to(torch.uint8).reshape(-1)[top].view(gn, gk)
        self.table_of = self.table_at[keys.reshape(-1)][top].view(gn, gk)
        g, c = torch.nonzero(open_tops.reshape(-1)[top].view(gn, gk), as_tuple=True)
        if g.numel():
            self._search(g, c, amax.reshape(-1)[self.top[g, c]][:, None], ceiling.reshape(-1)[self.top[g, c]][:, None])
        return True

    def _search(self, g: torch.Tensor, c: torch.Tensor, amax: torch.Tensor, ceiling: torch.Tensor) -> None:
        """Blocks (g, c), with their largest values and ceiling exponents [M, 1]: search_exponents' answer, on
        squared errors from the tables; their exponents and tables set."""
        codes = self.blocks.permute(0, 2, 1, 3)[g, c].to(torch.int64).bitwise_and_(NAN_MAGNITUDE)  # [M, bn, bk]
        in_id = self.in_id[g, c]
        squares = (self.err2 * self.scale2[:, None]).reshape(-1)  # each value's square, in the value's units

        def errors_at(rows: torch.Tensor, _: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
            tables = self._table(in_id[rows], exponents[:, 0]).to(torch.int64)
            return block_sums(squares[codes[rows] + (tables * MAGNITUDES)[:, None, None]].unsqueeze(2))

        every = torch.ones(amax.shape, dtype=torch.bool)
        chosen = search_exponents(amax, ceiling, every, errors_at)[:, 0]
        self.exponents[g, c] = (chosen + E8M0_BIAS).to(torch.uint8)
        self.table_of[g, c] = self._table(in_id, chosen)

    def _table(self, in_id: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        """The table of each (input block, exponent)."""
        return self.table_at[in_id * EXPONENT_SPAN + self.top_exponent[in_id] - exponents]

    def _build_tables(self, keys: torch.Tensor) -> None:
        """Each (input block, exponent) key's table: output codes, and per magnitude code its squared error
        and value (units of 2^e), whether it saturates and whether it flushes to zero."""
        blocks_in = keys // EXPONENT_SPAN
        e = self.top_exponent[blocks_in] - keys % EXPONENT_SPAN
        x = self.values[blocks_in]
        y = x * powers_of_two(-e)[:, None]  # as quantize_pow2_rows: x / 2^e, then the clamp and one cast
        codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.codes = torch.cat((codes.view(torch.uint8), codes.view(torch.uint8) | SIGN), dim=1).reshape(-1)
        written = codes.to(torch.float32)
        absent = ~torch.isfinite(y)  # codes no block of the band holds (NaN, or past float32): counted 0 times
        self.err2 = (written - y).to(torch.float64).square_().masked_fill_(absent, 0.0)
        self.norm2 = y.to(torch.float64).square_().masked_fill_(absent, 0.0)
        self.saturated = y.abs() > FP8_MAX
        self.flushed = (x != 0) & (written == 0)
        self.scale2 = 4.0 ** e.to(torch.float64)

    def apply(self, q_out: torch.Tensor) -> list[ReportSums]:
        """Write the output codes of every chunk of report rows into q_out (uint8 laid out as the blocks) and
        return each chunk's report sums."""
        gn, bn, gk, bk = self.blocks.shape
        step = max(1, self.report_rows // bn)
        parts = []
        for g0 in range(0, gn, step):
            g1 = min(gn, g0 + step)
            tables = self.table_of[g0:g1]
            t0, t1 = int(tables.min()), int(tables.max()) + 1
            index = scratch("pow2 codes index", (g1 - g0, bn, gk, bk), torch.int32)
            index.copy_(self.blocks[g0:g1])
            index.add_(((tables - t0) * CODES)[:, None, :, None])
            counts = torch.bincount(index.view(-1), minlength=(t1 - t0) * CODES).view(t1 - t0, 2, MAGNITUDES)
            torch.index_select(self.codes[t0 * CODES : t1 * CODES], 0, index.view(-1), out=q_out[g0:g1].view(-1))
            parts.append(self._report(counts.sum(dim=1), t0, t1))
        return parts

    def _report(self, counts: torch.Tensor, t0: int, t1: int) -> ReportSums:
        """One chunk's sums from its magnitude counts per table (tables t0..t1, those it does not use dropped)."""
        present = counts.sum(dim=1) > 0
        c = counts[present]
        n = c.to(torch.float64)
        scale2 = self.scale2[t0:t1][present]
        err2 = pairwise_sum_(n * self.err2[t0:t1][present], 1) * scale2
        norm2 = pairwise_sum_(n * self.norm2[t0:t1][present], 1) * scale2
        saturated = int((c * self.saturated[t0:t1][present]).sum())
        flushed = int((c * self.flushed[t0:t1][present]).sum())
        return (sum64(err2), sum64(norm2), saturated, flushed)


def _kept_exponents(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per input block (grid [n_in] float32): the exponent of its scale, and whether the scale is a power of two
    E8M0 holds, so that its blocks keep their bytes (rewrite.pow2.kept_exponents' rule)."""
    mantissa, exponent = torch.frexp(grid)
    e = exponent.to(torch.int32) - 1  # 0.5 x 2^E = 2^(E - 1)
    return e, (mantissa == 0.5) & (e >= -E8M0_BIAS) & (e <= E8M0_BIAS)


def _largest_magnitudes(blocks: torch.Tensor, report_rows: int) -> torch.Tensor:
    """[gn, gk] int32: each block's largest code magnitude (its sign bit cleared), a chunk at a time: over a
    block's rows first where it has several (elementwise maxima of whole rows: fast in uint8), in int32
    within a row (a reduction over a few contiguous values runs ~8x faster in int32 than in uint8)."""
    gn, bn, gk, bk = blocks.shape
    step = max(1, report_rows // bn)
    top = torch.empty((gn, gk), dtype=torch.int32)
    for g0 in range(0, gn, step):
        g1 = min(gn, g0 + step)
        if bn == 1:
            magnitudes = scratch("pow2 codes magnitudes", (g1 - g0, gk, bk), torch.int32)
            magnitudes.copy_(blocks[g0:g1, 0]).bitwise_and_(NAN_MAGNITUDE)
            top[g0:g1] = magnitudes.amax(dim=2)
        else:
            codes = scratch("pow2 codes magnitudes", (g1 - g0, bn, gk, bk), torch.uint8)
            torch.bitwise_and(blocks[g0:g1], NAN_MAGNITUDE, out=codes)
            top[g0:g1] = codes.amax(dim=1).amax(dim=2)
    return top


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
    tables = PowerOfTwoTables(blocks, grid, in_block, report_rows)
    if not tables.usable:
        return None
    aligned = blocks.data_ptr() == codes.data_ptr()
    written = q_out.view(torch.uint8).view(blocks.shape) if aligned else torch.empty(blocks.shape, dtype=torch.uint8)
    parts = tables.apply(written)
    if not aligned:
        q_out.view(torch.uint8).copy_(written.view(blocks.shape[0] * bn, -1)[:n, :k])
    return tables.exponents, parts, tables.kept_all
