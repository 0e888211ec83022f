"""Power-of-two requantization of e4m3 block FP8 straight from its codes: the fast path of quantize_pow2_rows
(the definition) for FP8 weights whose input blocks each hold whole output blocks (DeepSeek's 128x128 blocks
into ue8m0 blocks or MXFP8 groups).

Every value of an input block is one of 256 (backends.pow2_tables), and so is what it is written as at an
exponent, and its error: a 256-entry table per (input block, exponent) gives the output codes (one gather a
chunk), and a count of each input code per table (torch.bincount) the error report; the weight is never
decoded into float32. Each table is the definition's own operations on the 256 values, so the bytes are
the definition's. Exponents: a block's largest value is its largest magnitude code's (e4m3 magnitudes order
as their bytes); the blocks ceiling_wins cannot settle are searched on the same exact squares the
definition sums, each choice proven to be the definition's (BlockTables._search, GroupTables._search).

Two plans: BlockTables where each input block is one output block (ue8m0 from 128x128 blocks: counts first,
every choice from them), GroupTables where input blocks hold many (MXFP8's 1x32 groups: choices per (input
block, largest code), counts as the codes are written). Runs on the host for every backend: table lookups
and integer counts. Measured in docs/performance.md.
"""

from __future__ import annotations

import torch

from .pow2 import (
    E8M0_BIAS,
    HALF_FP8_MAX,
    SEARCH_BELOW,
    ReportSums,
    block_sums,
    blocks_of,
    ceil_exponents,
    ceiling_wins,
    choose_exponents,
    powers_of_two,
    search_exponents,
)
from .pow2_tables import (
    CODES,
    MAGNITUDES,
    NAN_MAGNITUDE,
    SIGN,
    chunk_sums,
    kept_exponents,
    magnitude_values,
    squares_at,
    table_sums,
    tables_at,
)
from .scratch import scratch

EXPONENT_SPAN = 32  # tables per input block at most: e4m3 spans 2^-9..448 (under 18 binades), search 3 below
# a search decided from counts: two squared-error totals this far apart relatively are ordered the same by any
# float64 summation of their exact terms (the definition's pairwise one errs by under 16 x 2^-53 of the total
# for 2^14 terms, a sum of 128 counted terms by under 129 x 2^-53); nearer, the definition's own sums decide
DECISION_MARGIN = 2.0**-40


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


class BlockTables:
    """Output blocks that are the input's blocks (ue8m0 from 128x128 block FP8): each block's codes counted
    first, one bincount a chunk of report rows; its largest value, exponent (_search) and report all from
    its counts; then one gather a chunk through its block's table."""

    def __init__(self, blocks: torch.Tensor, grid: torch.Tensor, report_rows: int) -> None:
        gn, bn, gk, bk = blocks.shape
        self.blocks, self.step = blocks, max(1, report_rows // bn)
        columns = torch.arange(self.step)[:, None] * gk + torch.arange(gk)[None, :]  # a chunk's blocks, in order
        self.offsets = (columns * CODES).to(torch.int32)[:, None, :, None]
        counts = self._counts()
        present = counts > 0
        x = magnitude_values(grid)
        top = (present * torch.arange(MAGNITUDES)).amax(dim=1)
        amax = x.gather(1, top[:, None])[:, 0].abs()  # each block's largest value: its largest code's
        self.usable = not bool(present[:, NAN_MAGNITUDE].any()) and bool(torch.isfinite(amax).all())
        if not self.usable:
            return
        kept, keeps = kept_exponents(grid)
        ceiling = ceil_exponents(amax)
        exponents = torch.where(keeps, kept, ceiling)
        rows = torch.nonzero(~ceiling_wins(amax, ceiling, bn * bk) & ~keeps)[:, 0]
        if rows.numel():
            exponents[rows] = self._search(rows, counts[rows], x[rows], amax[rows], ceiling[rows])
        self.tables = tables_at(x, exponents)
        self.exponents = (exponents + E8M0_BIAS).to(torch.uint8).view(gn, gk)
        self.kept_all = bool(keeps.all())
        sums, per_chunk = table_sums(counts, self.tables, slice(None)), self.step * gk
        self.parts = [chunk_sums(sums[r : r + per_chunk]) for r in range(0, gn * gk, per_chunk)]

    def _index(self, g0: int, g1: int) -> torch.Tensor:
        """Block rows g0..g1's codes as indexes into their blocks' tables (code + 256 x the block's place)."""
        _, bn, gk, bk = self.blocks.shape
        index = scratch("pow2 codes index", (g1 - g0, bn, gk, bk), torch.int32)
        return index.copy_(self.blocks[g0:g1]).add_(self.offsets[: g1 - g0])

    def _counts(self) -> torch.Tensor:
        """[blocks, 128] int64: how many of each block's values have each magnitude code."""
        gn, gk = self.blocks.shape[0], self.blocks.shape[2]
        counts = torch.empty((gn * gk, 2, MAGNITUDES), dtype=torch.int64)
        for g0 in range(0, gn, self.step):
            g1 = min(gn, g0 + self.step)
            index = self._index(g0, g1).view(-1)
            counts[g0 * gk : g1 * gk] = torch.bincount(index, minlength=(g1 - g0) * gk * CODES).view(-1, 2, MAGNITUDES)
        return counts.sum(dim=1)

    def _search(
        self, rows: torch.Tensor, counts: torch.Tensor, x: torch.Tensor, amax: torch.Tensor, ceiling: torch.Tensor
    ) -> torch.Tensor:
        """int32 [M]: search_exponents' answer for blocks `rows`, from their counts [M, 128]: each candidate's
        total squared error is counts x the exact squares the definition sums. A candidate none of whose
        present codes errs less than the best so far cannot beat it (every leaf of the definition's sums is
        as large or larger, and ties stay); one DECISION_MARGIN under it beats it, one over it does not; the
        rest (none on bench/synth.py's input) are searched by the definition on their values."""
        below = 1 if bool((amax > HALF_FP8_MAX * powers_of_two(ceiling)).all()) else SEARCH_BELOW
        n, present = counts.to(torch.float64), counts > 0
        best, best_squares = ceiling.clone(), squares_at(x, ceiling)
        best_error = (n * best_squares).sum(dim=1)
        unsure = torch.zeros(rows.shape, dtype=torch.bool)
        for i in range(1, below + 1):
            squares = squares_at(x, ceiling - i)
            error = (n * squares).sum(dim=1)
            may_win = (present & (squares < best_squares)).any(dim=1)
            margin = DECISION_MARGIN * (error + best_error)
            wins = may_win & (error < best_error - margin)
            unsure |= may_win & ~wins & (error <= best_error + margin)
            best = torch.where(wins, ceiling - i, best)
            best_squares = torch.where(wins[:, None], squares, best_squares)
            best_error = torch.where(wins, error, best_error)
        if bool(unsure.any()):
            best[unsure] = self._search_values(rows[unsure], x[unsure], amax[unsure])
        return best

    def _search_values(self, rows: torch.Tensor, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """int32 [M]: choose_exponents (the definition) on blocks `rows`' values, decoded from their codes."""
        gk = self.blocks.shape[2]
        codes = self.blocks.permute(0, 2, 1, 3)[rows // gk, rows % gk].to(torch.int64)  # [M, bn, bk]
        magnitudes = x.gather(1, (codes & NAN_MAGNITUDE).flatten(1)).view(codes.shape)
        values = torch.where(codes >= SIGN, -magnitudes, magnitudes)
        return choose_exponents(values.unsqueeze(2), amax[:, None], True)[:, 0]

    def apply(self, q_out: torch.Tensor) -> list[ReportSums]:
        """Write the output codes into q_out (uint8 laid out as the blocks); the report's sums per chunk."""
        gn, gk = self.blocks.shape[0], self.blocks.shape[2]
        for g0 in range(0, gn, self.step):
            g1 = min(gn, g0 + self.step)
            table = self.tables.codes[g0 * gk * CODES : g1 * gk * CODES]
            torch.index_select(table, 0, self._index(g0, g1).view(-1), out=q_out[g0:g1].view(-1))
        return self.parts


class GroupTables:
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
        self.values = magnitude_values(grid)
        self.top = _largest_magnitudes(blocks, report_rows).add_(self.in_id * MAGNITUDES)  # (input block, top)
        present = torch.bincount(self.top.view(-1), minlength=self.values.numel()).view(self.values.shape) > 0
        amax = self.values.abs()  # a block's largest value, by its largest code
        finite = bool((torch.isfinite(amax) | ~present).all())
        self.usable = finite and not bool(present[:, NAN_MAGNITUDE].any())
        if self.usable:
            self.usable = self._choose(amax, present, kept_exponents(grid))

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
        # the exponents the search may try: one lower where the largest value clamps there, else three
        clamps = amax > HALF_FP8_MAX * powers_of_two(ceiling)
        for i in range(1, SEARCH_BELOW + 1):
            used[keys[open_tops & (~clamps if i > 1 else True)] + i] = True
        self.table_at = (torch.cumsum(used, 0) - 1).to(torch.int32)  # dense (input block, exponent) key -> table
        self._build_tables(torch.nonzero(used)[:, 0])
        top = self.top.reshape(-1)

        def per_block(by_top: torch.Tensor) -> torch.Tensor:  # a lookup per block (int32 indexes: no copy)
            return torch.index_select(by_top.reshape(-1), 0, top).view(gn, gk)

        self.kept_all = bool(keeps.all())
        self.exponents = per_block((base + E8M0_BIAS).to(torch.uint8))
        self.table_of = per_block(self.table_at[keys])
        g, c = torch.nonzero(per_block(open_tops), as_tuple=True)
        if g.numel():
            self._search(g, c, amax.reshape(-1)[self.top[g, c]][:, None], ceiling.reshape(-1)[self.top[g, c]][:, None])
        return True

    def _search(self, g: torch.Tensor, c: torch.Tensor, amax: torch.Tensor, ceiling: torch.Tensor) -> None:
        """Blocks (g, c), with their largest values and ceiling exponents [M, 1]: search_exponents' answer; their
        exponents and tables set. Where the largest value clamps one exponent lower (over 224 x 2^e: every open
        block but those AMAX_FLOOR holds up), only the ceiling e and e - 1 can win (search_exponents); where no
        value errs more at e - 1 than at e (_gains; ceiling_wins leaves open only blocks whose largest value
        rounds down to 224 at e, its error there the same as clamped at e - 1), e - 1 wins if it gains beyond
        DECISION_MARGIN of the block's squared error, the ceiling if it gains nothing at all (equal leaves).
        The rest are searched on the tables' squares in the definition's pairwise order (_search_sums)."""
        in_id, e = self.in_id[g, c], ceiling[:, 0]
        error, gain, least = self._gains(g, c, in_id, e)
        clamps = amax[:, 0] > HALF_FP8_MAX * powers_of_two(e)
        lower = clamps & (least >= 0) & (gain > DECISION_MARGIN * 2 * error)
        settled = lower | (clamps & (least >= 0) & (gain == 0))
        rows = torch.nonzero(lower)[:, 0]
        self.exponents[g[rows], c[rows]] = (e[rows] - 1 + E8M0_BIAS).to(torch.uint8)
        self.table_of[g[rows], c[rows]] = self._table(in_id[rows], e[rows] - 1)
        for rest in (~settled & clamps, ~settled & ~clamps):  # apart: the first set tries one exponent lower only
            rows = torch.nonzero(rest)[:, 0]
            if rows.numel():
                self._search_sums(g[rows], c[rows], amax[rows], ceiling[rows])

    def _gains(
        self, g: torch.Tensor, c: torch.Tensor, in_id: torch.Tensor, e: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per block (g, c) at exponents e [M], float64 [M]: its squared error at e, the sum over its values of
        (squared error at e) - (squared error at e - 1), and the least such term (the terms: exact squares the
        definition sums)."""
        codes = self._codes_of(g, c).flatten(1).to(torch.int32).bitwise_and_(NAN_MAGNITUDE)
        squares = self.tables.err2.view(-1)
        at = codes.add_((self._table(in_id, e) * MAGNITUDES)[:, None])
        below = at + ((self._table(in_id, e - 1) - self._table(in_id, e)) * MAGNITUDES)[:, None]
        leaves = torch.index_select(squares, 0, at.view(-1)).view(codes.shape)
        terms = leaves - torch.index_select(squares, 0, below.view(-1)).view(codes.shape)
        return leaves.sum(dim=1), terms.sum(dim=1), terms.amin(dim=1)

    def _search_sums(self, g: torch.Tensor, c: torch.Tensor, amax: torch.Tensor, ceiling: torch.Tensor) -> None:
        """search_exponents on blocks (g, c): each candidate's squared error from the tables' exact squares,
        summed as block_squared_errors sums them (the definition's own order)."""
        codes = self._codes_of(g, c).to(torch.int64).bitwise_and_(NAN_MAGNITUDE)
        in_id = self.in_id[g, c]
        squares = self.tables.err2.view(-1)

        def errors_at(rows: torch.Tensor, _: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
            tables = self._table(in_id[rows], exponents[:, 0]).to(torch.int64)
            return block_sums(squares[codes[rows] + (tables * MAGNITUDES)[:, None, None]].unsqueeze(2))

        every = torch.ones(amax.shape, dtype=torch.bool)
        chosen = search_exponents(amax, ceiling, every, errors_at)[:, 0]
        self.exponents[g, c] = (chosen + E8M0_BIAS).to(torch.uint8)
        self.table_of[g, c] = self._table(in_id, chosen)

    def _codes_of(self, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """uint8 [M, bn, bk]: blocks (g, c)'s codes; groups within a row are rows of 32 bytes, gathered whole."""
        gn, bn, gk, bk = self.blocks.shape
        if bn == 1:
            return torch.index_select(self.blocks.view(gn * gk, bk), 0, g * gk + c).view(-1, 1, bk)
        return self.blocks.permute(0, 2, 1, 3)[g, c]

    def _table(self, in_id: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        """The table of each (input block, exponent)."""
        return self.table_at[in_id * EXPONENT_SPAN + self.top_exponent[in_id] - exponents]

    def _build_tables(self, keys: torch.Tensor) -> None:
        """Each (input block, exponent) key's table (pow2_tables.tables_at)."""
        blocks_in = keys // EXPONENT_SPAN
        self.tables = tables_at(self.values[blocks_in], self.top_exponent[blocks_in] - keys % EXPONENT_SPAN)

    def apply(self, q_out: torch.Tensor) -> list[ReportSums]:
        """Write the output codes of every chunk of report rows into q_out (uint8 laid out as the blocks) and
        return each chunk's report sums."""
        gn, bn, gk, bk = self.blocks.shape
        step = max(1, self.report_rows // bn)
        chunk_counts, chunk_tables = [], []
        for g0 in range(0, gn, step):
            g1 = min(gn, g0 + step)
            tables = self.table_of[g0:g1]
            t0, t1 = int(tables.min()), int(tables.max()) + 1
            index = scratch("pow2 codes index", (g1 - g0, bn, gk, bk), torch.int32)
            index.copy_(self.blocks[g0:g1])
            index.add_(((tables - t0) * CODES)[:, None, :, None])
            counts = torch.bincount(index.view(-1), minlength=(t1 - t0) * CODES).view(t1 - t0, 2, MAGNITUDES)
            table = self.tables.codes[t0 * CODES : t1 * CODES]
            torch.index_select(table, 0, index.view(-1), out=q_out[g0:g1].view(-1))
            counts = counts.sum(dim=1)
            used = torch.nonzero(counts.sum(dim=1) > 0)[:, 0]  # the chunk's own tables: its digits band-free
            chunk_counts.append(counts[used])
            chunk_tables.append(used + t0)
        sums = table_sums(torch.cat(chunk_counts), self.tables, torch.cat(chunk_tables)).split(
            [len(t) for t in chunk_tables]
        )
        return [chunk_sums(chunk) for chunk in sums]


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
